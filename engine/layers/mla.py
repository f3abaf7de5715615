"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the paged KV cache.

The cache holds what the model compresses each token to, not expanded keys and values: per token
and layer the normalised latent ``c`` [kv_lora_rank] (as the cache's keys, one head) and the
shared rotary key ``k_rot`` [qk_rope_head_dim] (as its values). Attention expands the context's
latents through ``kv_b_proj`` into per-head keys (no-rope part) and values, as transformers does,
so the numerics match it; the query comes straight from ``q_proj`` or through the low-rank
``q_a_proj`` -> norm -> ``q_b_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.layers.attention import gather_context, step_mask
from hearth.engine.layers.batch import LayerContext, SequenceSlice, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.layers.rope import apply_rotary
from hearth.engine.ops import deinterleave, linear

LATENT_NORM_EPS = 1e-6  # transformers builds the latent norms with their default eps, not the config's


def yarn_softmax_scale(head_dim: int, rope_type: str, params: dict) -> float:
    """``head_dim ** -0.5``, times mscale(factor, mscale_all_dim)² under YaRN (DeepSeek's rule)."""
    scale = head_dim**-0.5
    all_dim = params.get("mscale_all_dim") or 0
    if rope_type != "default" and all_dim and params.get("factor", 1) > 1:
        m = 0.1 * all_dim * math.log(params["factor"]) + 1.0
        scale *= m * m
    return scale


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotation: channel pairs (x0, x1), (x2, x3)… turned as complex numbers, in fp32,
    and left interleaved; x [T, heads, R], cos/sin [T, R] (the half-split form, cat(f, f))."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(x.dtype)


class LatentAttention(nn.Module):
    """MLA of one decoder layer; writes this step's latent and rotary key into the paged cache."""

    checkpoint_name = "self_attn"

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, dtype: torch.dtype, *, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool,
                 rope_style: str, softmax_scale: float) -> None:
        """``rope_style``: "half" (rotate halves), "interleaved" (pairs, de-interleaved first: V3's
        ``rope_interleave``), "pairs" (pairs turned in fp32 and kept in place: V2, whose config
        asks for fp32 rotary tables) or "none" (no rotary at all: Kimi-Linear's)."""
        super().__init__()
        if rope_style not in ("half", "interleaved", "pairs", "none"):
            raise ValueError(f"rope style {rope_style!r}: half, interleaved, pairs or none")
        self.layer_idx, self.num_heads = layer_idx, num_heads
        self.rank, self.nope, self.rope, self.v_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Projection(hidden, num_heads * qk_head, False, dtype)
        else:
            self.q_a_proj = Projection(hidden, q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Projection(q_lora_rank, num_heads * qk_head, False, dtype)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = Projection(hidden, kv_lora_rank + qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = Projection(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, dtype)
        self.o_proj = Projection(num_heads * v_head_dim, hidden, bias, dtype)
        self.rope_style, self.scale = rope_style, softmax_scale

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        t, batch = x.shape[0], ctx.batch
        if isinstance(batch, StaticBatch):
            raise NotImplementedError("fixed-shape decode steps do not run latent attention yet")
        q_res = self.q_a_layernorm(linear(x, self.q_a_proj.weight, self.q_a_proj.bias)) if self.q_lora else None
        q = linear(x, self.q_proj.weight) if not self.q_lora else linear(q_res, self.q_b_proj.weight)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        compressed = linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)  # [T, rank + rope]
        latent = self.kv_a_layernorm(compressed[:, : self.rank])[:, None, :]  # [T, 1, rank]
        k_rot = compressed[:, None, self.rank :]  # [T, 1, rope]
        if self.rope_style == "pairs":
            q_rot, k_rot = rotate_pairs(q_rot, *ctx.rope), rotate_pairs(k_rot, *ctx.rope)
        elif self.rope_style != "none":
            if self.rope_style == "interleaved":
                q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
            q_rot, k_rot = apply_rotary(q_rot, *ctx.rope), apply_rotary(k_rot, *ctx.rope)
        latents, rot_keys = ctx.kv.keys[self.layer_idx], ctx.kv.values[self.layer_idx]  # [slots, 1, rank|rope(+)]
        latents.index_copy_(0, batch.slot_mapping, latent)
        rot_keys.index_copy_(0, batch.slot_mapping, self.cache_row(k_rot, x, ctx).contiguous())
        q = torch.cat((q_pass, q_rot), dim=-1)  # [T, heads, nope + rope]
        out = q.new_empty(t, self.num_heads, self.v_dim)
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            latent_ctx, values_ctx = (gather_context(latents, seq, batch.block_size),
                                      gather_context(rot_keys, seq, batch.block_size))
            mask = self.sequence_mask(ctx, index, seq, values_ctx, rows, q_res, x)
            out[rows] = self._attend(q[rows], latent_ctx, values_ctx[..., : self.rope], mask)
        out = self.gate_heads(out, x)
        return linear(out.reshape(t, self.num_heads * self.v_dim), self.o_proj.weight, self.o_proj.bias)

    def gate_heads(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [T, heads, v] before ``o_proj`` (a subclass may gate them)."""
        return out

    def cache_row(self, k_rot: torch.Tensor, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """What the cache's values keep of each new token: the rotary key [T, 1, rope] (a subclass
        may append its own columns)."""
        return k_rot

    def sequence_mask(self, ctx: LayerContext, index: int, seq: SequenceSlice, values: torch.Tensor, rows: slice,
                      q_res: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of the step's ``index``-th sequence (None: plain causal); ``values`` are
        its cached value rows [ctx, 1, width], ``rows`` its queries' rows of ``q_res`` and ``x``."""
        return step_mask(ctx.batch, index, seq, None, x.device)

    def _attend(self, q: torch.Tensor, latents: torch.Tensor, rot_keys: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q [Q, heads, nope + rope] over one sequence's cache (latents [ctx, 1, rank], rotary keys
        [ctx, 1, rope]), its last Q tokens being the queries' own: [Q, heads, v]."""
        n, ctx = q.shape[0], latents.shape[0]
        kv = linear(latents[:, 0], self.kv_b_proj.weight).view(ctx, self.num_heads, self.nope + self.v_dim)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat((k_nope, rot_keys.expand(ctx, self.num_heads, self.rope)), dim=-1)  # [ctx, heads, qk]
        # In fp32, values padded to the query/key width: torch's CPU flash kernel wants one head width
        # and otherwise falls back to the math path (11x slower on a 512-token prefill, DeepSeek-V3
        # shape). In bf16/fp16 the math path stays: it is transformers' (sdpa), and the flash kernel's
        # rounding differs enough to change greedy tokens.
        pad = keys.shape[-1] - self.v_dim if q.dtype == torch.float32 else 0
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, heads, Q, qk]
            keys.transpose(0, 1)[None],
            F.pad(values, (0, max(pad, 0))).transpose(0, 1)[None],  # [1, heads, ctx, max(v, qk)]
            attn_mask=mask,
            is_causal=mask is None and n > 1,
            scale=self.scale,
        )
        return o[0, ..., : self.v_dim].transpose(0, 1)


class HeadGatedLatentAttention(LatentAttention):
    """MLA whose heads' outputs are scaled by ``sigmoid(g_proj(x))``, one gate per head, before
    ``o_proj`` (Ling 3.0's, ``BailingHybridForCausalLM``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.g_proj = Projection(self.o_proj.weight.shape[0], self.num_heads, False, self.o_proj.weight.dtype)

    def gate_heads(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(linear(x, self.g_proj.weight).float()).to(x.dtype)[..., None]
