"""Grouped-query attention with RoPE over the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch, SequenceSlice
from engine.config import ModelConfig
from engine.layers.linear import Projection, linear
from engine.layers.norm import make_norm
from engine.layers.rope import apply_rotary


def attention_mask(seq: SequenceSlice, window: int | None) -> torch.Tensor | None:
    """Boolean [query_len, context_len] mask (True = attend), or None when plain causal attention
    (``is_causal``, or a single query that sees every key) is enough."""
    first_q = seq.context_len - seq.query_len
    windowed = window is not None and seq.context_len > window
    if not windowed and (seq.query_len == 1 or first_q == 0):
        return None
    q_pos = torch.arange(first_q, seq.context_len)[:, None]
    k_pos = torch.arange(seq.context_len)[None, :]
    mask = k_pos <= q_pos
    if windowed:
        mask &= k_pos > q_pos - window
    return mask


def gather_context(cache: torch.Tensor, seq: SequenceSlice, block_size: int) -> torch.Tensor:
    """The sequence's cached K or V [context_len, kv_heads, D]: a view when its blocks are
    consecutive (the common case for a lone sequence), else gathered block by block."""
    if seq.first_block >= 0:
        start = seq.first_block * block_size
        return cache[start : start + seq.context_len]
    blocks = cache.view(-1, block_size, *cache.shape[1:]).index_select(0, seq.block_ids)
    return blocks.flatten(0, 1)[: seq.context_len]


class Attention(nn.Module):
    """Self-attention of one decoder layer; writes this step's K/V into the paged cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.window = cfg.sliding_windows[layer_idx]
        # Gated attention: q_proj yields, per head, D query channels then D gate channels.
        self.output_gate = cfg.attn_output_gate
        q_out, kv_out = cfg.num_heads * d * (2 if self.output_gate else 1), cfg.num_kv_heads * d
        self.q_proj = Projection(h, q_out, cfg.qkv_bias, cfg.dtype)
        self.k_proj = Projection(h, kv_out, cfg.qkv_bias, cfg.dtype)
        self.v_proj = Projection(h, kv_out, cfg.qkv_bias, cfg.dtype)
        self._fuse_qkv(h, q_out, kv_out, cfg.qkv_bias, cfg.dtype)
        self.o_proj = Projection(cfg.num_heads * d, h, False, cfg.dtype)
        norm = cfg.zero_centered_norm
        self.q_norm = make_norm(d, cfg.rms_norm_eps, cfg.dtype, norm) if cfg.qk_norm else None
        self.k_norm = make_norm(d, cfg.rms_norm_eps, cfg.dtype, norm) if cfg.qk_norm else None
        self.scale = d**-0.5

    def _fuse_qkv(self, h: int, q_out: int, kv_out: int, bias: bool, dtype: torch.dtype) -> None:
        """Back q/k/v_proj by one [q + 2kv, H] matrix (one GEMM instead of three); the per-projection
        parameters stay, as views, so checkpoint names load into it unchanged."""
        self.register_buffer("qkv_weight", torch.empty(q_out + 2 * kv_out, h, dtype=dtype), persistent=False)
        self.register_buffer(
            "qkv_bias", torch.zeros(q_out + 2 * kv_out, dtype=dtype) if bias else None, persistent=False
        )
        bounds = ((0, q_out), (q_out, q_out + kv_out), (q_out + kv_out, q_out + 2 * kv_out))
        for proj, (lo, hi) in zip((self.q_proj, self.k_proj, self.v_proj), bounds, strict=True):
            proj.weight = nn.Parameter(self.qkv_weight[lo:hi], requires_grad=False)
            if bias:
                proj.bias = nn.Parameter(self.qkv_bias[lo:hi], requires_grad=False)
        self.q_size, self.kv_size = q_out, kv_out

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [slots, kv_heads, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = linear(x, self.qkv_weight, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], -1)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, heads, D] each
            gate = gate.reshape(t, self.num_heads * self.head_dim)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)

        out = torch.empty_like(q)
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = gather_context(k_cache, seq, batch.block_size)  # [ctx, kv_heads, D]
            vals = gather_context(v_cache, seq, batch.block_size)
            if (index, self.window) not in batch.masks:
                batch.masks[index, self.window] = attention_mask(seq, self.window)
            mask = batch.masks[index, self.window]
            if seq.query_len == 1 and mask is None:
                out[rows] = self._decode_one(q[rows], keys, vals)
                continue
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],  # [1, heads, q, D]
                keys.transpose(0, 1)[None],  # [1, kv_heads, ctx, D]
                vals.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None and seq.query_len > 1,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[rows] = o[0].transpose(0, 1)
        out = out.reshape(t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o_proj.weight)

    def _decode_one(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One query token: fold each KV head's query group into the query axis so the kernel
        runs plain attention per KV head (several times faster on CPU than ``enable_gqa``)."""
        groups = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.view(self.num_kv_heads, groups, self.head_dim)[None],  # [1, kv_heads, groups, D]
            keys.transpose(0, 1)[None],  # [1, kv_heads, ctx, D]
            vals.transpose(0, 1)[None],
            scale=self.scale,
        )
        return o.view(1, self.num_heads, self.head_dim)
