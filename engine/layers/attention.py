"""Grouped-query attention with RoPE over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine import hugepages
from hearth.engine.layers.batch import LayerContext, SequenceSlice, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.rope import apply_rotary
from hearth.engine.ops import deinterleave, linear


def step_mask(batch, index: int, seq: SequenceSlice, window: int | None, device: torch.device | str,
              explicit: bool = False) -> torch.Tensor | None:
    """:func:`attention_mask` of the batch's ``index``-th sequence, made once per step and window
    and shared by every layer (``explicit``: a causal mask even where ``is_causal`` would do)."""
    key = (index, window, explicit)
    if key not in batch.masks:
        mask = attention_mask(seq, window, device)
        if mask is None and explicit and seq.query_len > 1:
            mask = torch.ones(seq.query_len, seq.context_len, dtype=torch.bool, device=device).tril(
                seq.context_len - seq.query_len)
        batch.masks[key] = mask
    return batch.masks[key]


def attention_mask(seq: SequenceSlice, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Boolean [query_len, context_len] mask (True = attend), or None when plain causal attention
    (``is_causal``, or a single query that sees every key) is enough."""
    first_q = seq.context_len - seq.query_len
    windowed = window is not None and seq.context_len > window
    if not windowed and (seq.query_len == 1 or first_q == 0):
        return None
    q_pos = torch.arange(first_q, seq.context_len, device=device)[:, None]
    k_pos = torch.arange(seq.context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if windowed:
        mask &= k_pos > q_pos - window
    return mask


# torch's CPU flash kernel, with the log-sum-exp the public SDPA does not return (None if absent).
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_then_causal(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a later prefill chunk, q [heads, Q, D], over keys/vals [ctx, kv_heads, D]
    whose last Q rows are the chunk's own: the cached prefix, which every query sees whole, plus
    the causal diagonal block, merged by their log-sum-exps (as flash attention merges tiles).

    Against one masked call this needs no [Q, ctx] mask and folds each KV head's query group into
    the query axis of the prefix part (no K/V repeat): 1.37x faster at 16k context and 1.44x at
    32k on a 2-core CPU (``bench/long_prefill.py --attention``)."""
    heads, n, d = q.shape
    kv_heads = keys.shape[1]
    if keys.shape[0] <= n:
        raise ValueError("prefix_then_causal needs a cached prefix (context longer than the chunk)")
    groups = heads // kv_heads
    prefix_k = keys[:-n].transpose(0, 1)[None]  # [1, kv_heads, P, D]
    prefix_v = vals[:-n].transpose(0, 1)[None]
    folded = q.reshape(1, kv_heads, groups * n, d)  # head h = kv * groups + g: one KV head's group per row block
    o_prefix, lse_prefix = _FLASH_WITH_LSE(folded, prefix_k, prefix_v, scale=scale)
    own_k = keys[-n:].transpose(0, 1).repeat_interleave(groups, 0)[None]  # [1, heads, Q, D]: Q is small
    own_v = vals[-n:].transpose(0, 1).repeat_interleave(groups, 0)[None]
    o_own, lse_own = _FLASH_WITH_LSE(q[None], own_k, own_v, is_causal=True, scale=scale)
    lse_prefix = lse_prefix.reshape(heads, n, 1)
    lse_own = lse_own.reshape(heads, n, 1)
    top = torch.maximum(lse_prefix, lse_own)
    w_prefix, w_own = torch.exp(lse_prefix - top), torch.exp(lse_own - top)
    out = o_prefix.reshape(heads, n, d).float() * w_prefix + o_own[0].float() * w_own
    return (out / (w_prefix + w_own)).to(q.dtype)  # [heads, Q, D]


def gather_context(cache: torch.Tensor, seq: SequenceSlice, block_size: int) -> torch.Tensor:
    """The sequence's cached K or V [context_len, kv_heads, D]: a view when its blocks are
    consecutive (the common case for a lone sequence), else gathered block by block."""
    if seq.first_block >= 0:
        start = seq.first_block * block_size
        return cache[start : start + seq.context_len]
    blocks = cache.view(-1, block_size, *cache.shape[1:]).index_select(0, seq.block_ids)
    return blocks.flatten(0, 1)[: seq.context_len]


class Attention(nn.Module):
    """Grouped-query self-attention of one decoder layer; writes this step's K/V into the paged cache.

    What differs between families is chosen by the family, not read from a config: projection bias,
    a norm factory for per-head q/k norms (or None), and a sliding window. Subclasses change how the
    query projection is split and how the output leaves (see :class:`GatedAttention`)."""

    checkpoint_name = "self_attn"
    query_channels_per_head = 1  # units of head_dim in q_proj per head

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, *, bias: bool = False, qk_norm: Callable[[int], nn.Module] | None = None,
                 window: int | None = None, out_bias: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim = head_dim  # the values' width (a family may make them narrower)
        self.window = window
        q_out, kv_out = num_heads * head_dim * self.query_channels_per_head, num_kv_heads * head_dim
        self.q_proj = Projection(hidden, q_out, bias, dtype)
        self.k_proj = Projection(hidden, kv_out, bias, dtype)
        self.v_proj = Projection(hidden, kv_out, bias, dtype)
        self._fuse_qkv(hidden, q_out, kv_out, bias, dtype)
        self.o_proj = Projection(num_heads * head_dim, hidden, out_bias, dtype)
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.scale = head_dim**-0.5
        # Rotary on interleaved pairs (ERNIE-4.5): q and k de-interleaved first, so the half-split
        # rotation turns the same pairs; q.k is unchanged by the common channel order.
        self.interleaved_rope = False
        self.use_rope = True  # False: no rotary at all (EXAONE-MoE's global layers)
        # Rotate in fp32 over the model-dtype tables, then round (Cohere2-MoE's order).
        self.rotate_in_fp32 = False
        self.norm_after_rope = False  # the q/k norms after the rotary, not before (HunYuan's order)
        # q [T, heads, D] and the tokens' positions -> q scaled by position (Llama 4's NoPE layers)
        self.query_scale: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.rope_table: int | None = None  # a rotary table of its own: its index in LayerContext.ropes

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

    def adopt_block_weights(self) -> None:
        """After a loader put q/k/v_proj's weights in quantized blocks: fuse their block rows when
        the three share a format, else project them one by one (``qkv_weight`` None)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weights = [p.weight for p in projs]
        if not any(w.dtype == torch.uint8 for w in weights):
            return
        formats = {getattr(w, "block_format", w.dtype) for w in weights}
        if len(formats) == 1:
            # [q + 2kv, row bytes]: rows of blocks concatenate, into the buffer that stays (on huge pages)
            fused = torch.cat(weights, out=hugepages.empty(sum(w.shape[0] for w in weights), weights[0].shape[1],
                                                           dtype=torch.uint8))
            fused.block_format = formats.pop()
            self.qkv_weight = fused
            for proj, (lo, hi) in zip(projs, self._bounds(), strict=True):
                proj.weight = nn.Parameter(fused[lo:hi], requires_grad=False)
                proj.weight.block_format = fused.block_format
        else:
            self.qkv_weight = None

    def _bounds(self) -> tuple[tuple[int, int], ...]:
        q, kv = self.q_size, self.kv_size
        return (0, q), (q, q + kv), (q + kv, q + 2 * kv)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, q_size], k and v [T, kv_size]: one fused projection where the weights allow it."""
        if self.qkv_weight is not None:
            return linear(x, self.qkv_weight, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], -1)
        return tuple(linear(x, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head q/k norms, q [T, heads, D] and k [T, kv_heads, D], where the family has them."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def split_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_proj's output [T, q_size] -> (queries [T, heads, D], what the output needs from it, or None)."""
        return q.reshape(q.shape[0], self.num_heads, self.head_dim), None

    def gate_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the output needs from the layer's input x [T, H] where the query gives nothing (an output
        gate projected from x: Laguna's), or None."""
        return None

    def project_out(self, out: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """Attention output [T, heads * D] -> hidden states [T, H]."""
        return linear(out, self.o_proj.weight, self.o_proj.bias)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        t, batch = x.shape[0], ctx.batch
        k_cache, v_cache = ctx.kv.keys[self.layer_idx], ctx.kv.values[self.layer_idx]  # [slots, kv_heads, D]
        q, k, v = self.project_qkv(x)
        q, extra = self.split_query(q)
        extra = extra if extra is not None else self.gate_of(x)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.v_head_dim)
        if not self.norm_after_rope:
            q, k = self.norm_heads(q, k)
        if self.interleaved_rope:
            q, k = deinterleave(q), deinterleave(k)
        if self.use_rope:
            q, k = self.rotate(q, k, ctx.rope if self.rope_table is None else ctx.ropes[self.rope_table], x.dtype)
        if self.norm_after_rope:
            q, k = self.norm_heads(q, k)
        if self.query_scale is not None:
            q = self.query_scale(q, batch.positions)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        if isinstance(batch, StaticBatch):
            out = self.attend_static(q, batch, k_cache, v_cache)
        else:
            out = self.attend(q, batch, k_cache, v_cache)
        return self.project_out(out.reshape(t, self.num_heads * self.v_head_dim), extra)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k turned by the rotary tables, in ``dtype`` (fp32 tables turn them in fp32, as does
        ``rotate_in_fp32``; they go on in the model dtype)."""
        if self.rotate_in_fp32:
            q, k, rope = q.float(), k.float(), (rope[0].float(), rope[1].float())
        return apply_rotary(q, *rope).to(dtype), apply_rotary(k, *rope).to(dtype)

    def attend_static(self, q: torch.Tensor, batch: StaticBatch, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        """One query per row, q [B, heads, D], over each row's blocks gathered to a fixed length
        MB * block_size and masked past its context (and outside the window): static shapes, so
        the step compiles once per bucket. [B, heads, D]."""
        b, bs = q.shape[0], batch.block_size
        kv_heads, d = self.num_kv_heads, self.head_dim
        length = batch.block_tables.shape[1] * bs
        keys = k_cache.view(-1, bs, kv_heads, d)[batch.block_tables].view(b, length, kv_heads, d)
        vals = v_cache.view(-1, bs, kv_heads, d)[batch.block_tables].view(b, length, kv_heads, d)
        k_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
        mask = k_pos < batch.context_lens[:, None]  # [B, L]: the query is the last cached token
        if self.window is not None:
            mask &= k_pos > batch.context_lens[:, None] - 1 - self.window
        # Gathered positions past a context may never have been written (garbage, NaN even): a
        # masked score or a zero weight times NaN is still NaN, so they are zeroed first.
        keep = mask[:, :, None, None]
        keys, vals = keys.masked_fill(~keep, 0), vals.masked_fill(~keep, 0)
        groups = self.num_heads // kv_heads
        o = F.scaled_dot_product_attention(
            q.view(b, kv_heads, groups, d),  # each KV head's query group on the query axis (as _decode_one)
            keys.transpose(1, 2),  # [B, kv_heads, L, D]
            vals.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
        )
        return o.reshape(b, self.num_heads, d)

    def attend(self, q: torch.Tensor, batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention of queries q [T, heads, D] over each sequence's cached keys and values
        (this step's already written): [T, heads, D]."""
        out = torch.empty_like(q)
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = gather_context(k_cache, seq, batch.block_size)  # [ctx, kv_heads, D]
            vals = gather_context(v_cache, seq, batch.block_size)
            if self._splits(seq):  # a later prefill chunk: no [chunk, context] mask is built
                out[rows] = prefix_then_causal(q[rows].transpose(0, 1).contiguous(), keys, vals,
                                               self.scale).transpose(0, 1)
                continue
            mask = step_mask(batch, index, seq, self.window, q.device)
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
        return out

    def _splits(self, seq: SequenceSlice) -> bool:
        """Whether a chunk runs as cached prefix + causal block: several queries after a prefix,
        all of it in view (no window cuts into it)."""
        return (_FLASH_WITH_LSE is not None and 1 < seq.query_len < seq.context_len
                and (self.window is None or seq.context_len <= self.window))

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


class GatedAttention(Attention):
    """Attention with an output gate (Qwen3-Next, Qwen3.5): per head, q_proj yields D query channels
    then D gate channels, and the output is scaled by the gate's sigmoid before o_proj."""

    query_channels_per_head = 2

    def split_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = q.shape[0]
        q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, heads, D] each
        return q.reshape(t, self.num_heads, self.head_dim), gate.reshape(t, self.num_heads * self.head_dim)

    def project_out(self, out: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        return linear(out * torch.sigmoid(extra), self.o_proj.weight, self.o_proj.bias)


class ProjectionNormAttention(Attention):
    """Attention whose q/k norms span each whole projection, all heads at once, rather than each
    head (OLMoE); then q, k and v are clipped to ``[-clip, clip]`` where ``clip`` is set."""

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, *, norm: Callable[[int], nn.Module], clip: float | None = None,
                 bias: bool = False, window: int | None = None) -> None:
        super().__init__(layer_idx, hidden, num_heads, num_kv_heads, head_dim, dtype, bias=bias, window=window,
                         out_bias=bias)
        self.q_norm, self.k_norm = norm(self.q_size), norm(self.kv_size)
        self.clip = clip

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q, k, v

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # normed whole in project_qkv


class ClippedAttention(Attention):
    """Attention whose q, k and v are clipped to ``[-clip, clip]`` as they leave the projection,
    before the rotary (DBRX's ``clip_qkv``)."""

    def __init__(self, *args, clip: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clip = clip

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.clamp(-self.clip, self.clip) for t in super().project_qkv(x))


class SinkAttention(Attention):
    """Attention with a learned sink per head (GPT-OSS): one more logit in every softmax, whose
    probability is dropped, so a query can attend to nothing. Computed as transformers' eager path
    does (scores in the model dtype, the max subtracted, the softmax in that dtype), so low
    precision matches it."""

    scores_in_fp32 = False  # the scores, the sinks and the softmax in fp32 (Flint's), whatever the model dtype

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dtype = torch.float32 if self.scores_in_fp32 else self.o_proj.weight.dtype
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)

    def attend_static(self, q, batch, k_cache, v_cache):
        raise NotImplementedError("fixed-shape decode steps do not run attention sinks yet")

    def attend(self, q: torch.Tensor, batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [T, heads, value width]
        groups = self.num_heads // self.num_kv_heads
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = gather_context(k_cache, seq, batch.block_size).repeat_interleave(groups, 1)  # [ctx, heads, D]
            vals = gather_context(v_cache, seq, batch.block_size).repeat_interleave(groups, 1)
            query = q[rows].float() if self.scores_in_fp32 else q[rows]
            keys = keys.float() if self.scores_in_fp32 else keys
            scores = torch.matmul(query.transpose(0, 1), keys.permute(1, 2, 0)) * self.scale  # [heads, Q, ctx]
            mask = step_mask(batch, index, seq, self.window, q.device, explicit=True)
            if mask is not None:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            out[rows] = self.weigh(scores, vals).transpose(0, 1)  # [Q, heads, D]
        return out

    def weigh(self, scores: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """Masked scores [heads, Q, ctx] and values [ctx, heads, Dv] -> [heads, Q, Dv]: the sink one more
        logit of the softmax, its probability dropped (a layer whose ``sinks`` is None: the same eager
        softmax without one, MiMo-V2-Flash's global layers)."""
        logits = scores
        if self.sinks is not None:
            sinks = self.sinks.view(-1, 1, 1).expand(-1, scores.shape[1], 1).to(scores.dtype)
            logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)
        probs = probs[..., :-1] if self.sinks is not None else probs
        return torch.matmul(probs.to(vals.dtype), vals.transpose(0, 1))


class Fp32SinkAttention(SinkAttention):
    """Sinks as Flint's eager path computes them: scores, sinks (kept in fp32) and the softmax in fp32,
    the probabilities rounded to the values' dtype."""

    scores_in_fp32 = True


class SigmoidSinkAttention(SinkAttention):
    """The same sink computed as GraniteSWA's eager path does: the plain softmax (in fp32, rounded)
    times ``sigmoid(logsumexp(scores) - sink)`` in fp32, so low precision matches it."""

    def weigh(self, scores: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        scale = (torch.logsumexp(scores, dim=-1) - self.sinks.view(-1, 1)).float().sigmoid()  # [heads, Q]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals.dtype)
        return torch.matmul(probs, vals.transpose(0, 1)) * scale.unsqueeze(-1).to(vals.dtype)


class ChunkedAttention(Attention):
    """Attention whose queries see only the keys of their own ``chunk``-token block (and before them
    in it: Llama 4's chunked layers); with ``chunk`` None it is plain causal attention."""

    def __init__(self, *args, chunk: int | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunk = chunk

    def attend_static(self, q, batch, k_cache, v_cache):
        raise NotImplementedError("fixed-shape decode steps do not run chunked attention yet")

    def _chunk_mask(self, batch, index: int, seq: SequenceSlice, device) -> torch.Tensor:
        """[Q, ctx]: each query's own chunk, up to itself; made once per step and shared by the layers."""
        key = (index, ("chunk", self.chunk), True)
        if key not in batch.masks:
            q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=device)[:, None]
            k_pos = torch.arange(seq.context_len, device=device)[None, :]
            batch.masks[key] = (k_pos <= q_pos) & (k_pos // self.chunk == q_pos // self.chunk)
        return batch.masks[key]

    def attend(self, q: torch.Tensor, batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.chunk is None:
            return super().attend(q, batch, k_cache, v_cache)
        out = torch.empty_like(q)
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = gather_context(k_cache, seq, batch.block_size)  # [ctx, kv_heads, D]
            vals = gather_context(v_cache, seq, batch.block_size)
            mask = self._chunk_mask(batch, index, seq, q.device)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                               vals.transpose(0, 1)[None], attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[rows] = o[0].transpose(0, 1)
        return out
