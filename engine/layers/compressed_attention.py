"""DeepSeek-V4's attention over the paged KV cache: shared-KV multi-query attention (one head read
as both key and value) over a sliding window, plus, on compressed layers, entries that each sum a
window of tokens: every ``rate`` tokens one entry (heavily compressed attention, HCA), or every
``rate`` tokens one entry over two overlapping windows of which a lightning indexer keeps the top
k per query (compressed sparse attention, CSA). Each head has a learned sink; the output is rotated
back by its query position and leaves through a grouped low-rank projection.

Everything a layer keeps about a token lives in that token's slot of the paged cache, so prefix
reuse, chunked prefill and preemption need no state besides the pages:

- keys [slots, 1, D]: the token's normalised, rotated K=V;
- values [slots, 1, C]: per compressor, the token's kv and gate projections, and in the slot of a
  window's last token, the window's entry (written when that token is). A CSA layer's indexer keeps
  the same columns after the compressor's.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.layers.batch import ForwardBatch, LayerContext, SequenceSlice, StaticBatch
from hearth.engine.layers.hyper import unweighted_rms_norm
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import RMSNormScaledInFp32
from hearth.engine.ops import linear


class PairRotary(nn.Module):
    """Rotary tables by kind ("main", "compress"): one (cos, sin) entry per channel pair, the pairs
    being adjacent channels at the end of each head (:func:`rotate_tail`)."""

    def __init__(self, frequencies: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.scales = {kind: scale for kind, (_, scale) in frequencies.items()}
        for kind, (inv_freq, _) in frequencies.items():
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)

    def table(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] at ``positions`` [T], cast to ``dtype`` (the reference's rounding)."""
        freqs = positions[:, None].float() * getattr(self, f"{kind}_inv_freq")[None, :]
        scale = self.scales[kind]
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last R channels of x [T, heads, D] as adjacent pairs (x0, x1), (x2, x3)… by
    cos/sin [T, R/2], in fp32, the rest passing; R/2 = cos's width."""
    rot = 2 * cos.shape[-1]
    c = cos.repeat_interleave(2, dim=-1)[:, None]  # [T, 1, R]
    s = sin.repeat_interleave(2, dim=-1)[:, None]
    head, tail = x[..., :-rot], x[..., -rot:]
    pairs = tail.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((head, (tail.float() * c + turned.float() * s).to(x.dtype)), dim=-1)


def token_slots(seq: SequenceSlice, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of the sequence's tokens at ``positions``."""
    return seq.block_ids.to(positions.device)[positions // block_size] * block_size + positions % block_size


class WindowCompressor(nn.Module):
    """One entry per ``rate`` tokens: the window's kv projections summed under a softmax over its
    gate projections (plus a learned bias per position in the window), normalised and rotated at
    the window's first position. With ``overlap`` (CSA) the projections are twice as wide and an
    entry also sums the previous window's first half: windows of 2 x rate with stride rate."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, norm_eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = Projection(hidden, width, False, dtype)
        self.gate_proj = Projection(hidden, width, False, dtype)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = RMSNormScaledInFp32(head_dim, norm_eps, torch.float32)
        self.head_dim, self.rate, self.overlap, self.width = head_dim, rate, overlap, width
        self.offset = 0  # where this compressor's columns start in the layer's cache values

    @property
    def columns(self) -> int:
        """Cache columns per token: kv and gate projections, then the entry (a window's last token)."""
        return 2 * self.width + self.head_dim

    def write(self, x: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, rotary: PairRotary) -> None:
        """Store this step's projections of x [T, hidden], then each sequence's windows that closed."""
        a, w, r = self.offset, self.width, self.rate
        proj = torch.cat((linear(x, self.kv_proj.weight), linear(x, self.gate_proj.weight)), dim=-1)  # [T, 2W]
        values[:, 0, a : a + 2 * w].index_copy_(0, batch.slot_mapping, proj)
        for seq in batch.sequences:
            first, last = (seq.context_len - seq.query_len) // r, seq.context_len // r  # windows first..last-1 close
            if last == first:
                continue
            lo = first - 1 if self.overlap and first > 0 else first  # an overlapping entry reads the window before
            positions = torch.arange(lo * r, last * r, device=x.device)
            rows = values.index_select(0, token_slots(seq, positions, batch.block_size))[:, 0, a : a + 2 * w]
            entries = self.close(rows, first, last, lo, rotary)
            ends = torch.arange(first + 1, last + 1, device=x.device) * r - 1
            slots = token_slots(seq, ends, batch.block_size)
            values[:, 0, a + 2 * w : a + 2 * w + self.head_dim].index_copy_(0, slots, entries)

    def close(self, seg: torch.Tensor, first: int, last: int, lo: int, rotary: PairRotary) -> torch.Tensor:
        """Entries [n, D] of windows ``first..last-1`` from the projections ``seg`` [(last - lo) * rate, 2W]
        of windows ``lo..last-1``."""
        r, d, w = self.rate, self.head_dim, self.width
        kv = seg[:, :w].reshape(-1, r, w)  # [windows, r, W]
        gate = seg[:, w:].reshape(-1, r, w).float() + self.position_bias
        if self.overlap:  # entry = window's second half (Cb) after the previous window's first (Ca)
            prev_kv, prev_gate = kv[..., :d], gate[..., :d]
            kv, gate = kv[first - lo :, :, d:], gate[first - lo :, :, d:]
            if first == lo:  # window 0 has no previous window: weight 0 (a -inf gate) on zeros
                prev_kv = torch.cat((torch.zeros_like(prev_kv[:1]), prev_kv), dim=0)
                prev_gate = torch.cat((torch.full_like(prev_gate[:1], float("-inf")), prev_gate), dim=0)
            kv = torch.cat((prev_kv[: last - first], kv), dim=1)  # [n, 2r, D]
            gate = torch.cat((prev_gate[: last - first], gate), dim=1)
        weights = torch.softmax(gate, dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))  # [n, D]
        positions = torch.arange(first, last, device=seg.device) * r
        cos, sin = rotary.table("compress", positions, entries.dtype)
        return rotate_tail(entries[:, None], cos, sin)[:, 0]

    def entries(self, values: torch.Tensor, seq: SequenceSlice, count: int, block_size: int) -> torch.Tensor:
        """The sequence's first ``count`` entries [count, D], read from their slots in ``values``."""
        ends = torch.arange(1, count + 1, device=values.device) * self.rate - 1
        a = self.offset + 2 * self.width
        return values.index_select(0, token_slots(seq, ends, block_size))[:, 0, a : a + self.head_dim]

    def context(self, values: torch.Tensor, seq: SequenceSlice, block_size: int, q_pos: torch.Tensor,
                q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The entries [n, D] the queries at ``q_pos`` [Q] may see and which of them each sees
        [Q, n] (bool); None before the first entry. HCA: every entry whose window ends at or before
        the query."""
        count = seq.context_len // self.rate
        if count == 0:
            return None
        ready = (q_pos + 1) // self.rate  # [Q]: entries closed by each query's own token
        keep = torch.arange(count, device=q_pos.device)[None, :] < ready[:, None]
        return self.entries(values, seq, count, block_size), keep


class IndexScorer(nn.Module):
    """The indexer's per-head weights of a query (``weights_proj``)."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = Projection(hidden, heads, False, dtype)


class LightningIndexer(WindowCompressor):
    """CSA's indexer: its own overlapping compressor at ``head_dim`` (the index keys), and queries
    from the attention's low-rank query; an entry's score for a query is
    ``sum_h w_h relu(q_h . k)``, and each query keeps the ``topk`` best entries already closed."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rate: int, topk: int,
                 norm_eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden, head_dim, rate, True, norm_eps, dtype)
        self.q_b_proj = Projection(q_lora_rank, heads * head_dim, False, dtype)
        self.scorer = IndexScorer(hidden, heads, dtype)
        self.heads, self.topk = heads, topk

    def select(self, keys: torch.Tensor, q_pos: torch.Tensor, q_res: torch.Tensor, x: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Which of the index keys [n, Di] each query [Q] keeps: [Q, n] bool."""
        n, q = keys.shape[0], q_pos.shape[0]
        queries = rotate_tail(linear(q_res, self.q_b_proj.weight).view(q, self.heads, self.head_dim), cos, sin)
        scores = torch.relu(torch.matmul(queries.float(), keys.float().T)) * self.head_dim**-0.5  # [Q, Hi, n]
        weights = linear(x, self.scorer.weights_proj.weight).float() * self.heads**-0.5  # [Q, Hi]
        scores = (scores * weights[..., None]).sum(dim=1)  # [Q, n]
        ready = (q_pos + 1) // self.rate
        scores = scores.masked_fill(torch.arange(n, device=keys.device)[None, :] >= ready[:, None], float("-inf"))
        picked = scores.topk(min(self.topk, n), dim=-1).indices  # [Q, k]
        keep = torch.zeros(q, n, dtype=torch.bool, device=keys.device)
        return keep.scatter_(1, picked, picked < ready[:, None])


class SparseCompressor(WindowCompressor):
    """CSA: an overlapping compressor whose entries a :class:`LightningIndexer` (columns after its
    own) selects per query."""

    def __init__(self, hidden: int, head_dim: int, rate: int, norm_eps: float, dtype: torch.dtype,
                 indexer: LightningIndexer) -> None:
        super().__init__(hidden, head_dim, rate, True, norm_eps, dtype)
        self.indexer = indexer
        indexer.offset = super().columns

    @property
    def columns(self) -> int:
        return super().columns + self.indexer.columns

    def write(self, x: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, rotary: PairRotary) -> None:
        super().write(x, values, batch, rotary)
        self.indexer.write(x, values, batch, rotary)

    def context(self, values, seq, block_size, q_pos, q_res, x, cos, sin):
        count = seq.context_len // self.rate
        if count == 0:
            return None
        keys = self.indexer.entries(values, seq, count, block_size)
        return self.entries(values, seq, count, block_size), self.indexer.select(keys, q_pos, q_res, x, cos, sin)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention of one layer (``self_attn``): query through the low rank
    ``q_a_proj`` -> norm -> ``q_b_proj`` and a per-head norm, one shared K=V head (``kv_proj``, norm),
    rotary on the last R channels (the "main" table on sliding layers, "compress" on compressed
    ones), a sliding window of ``window`` tokens plus the compressor's entries, a sink per head,
    the output turned back by its position, then ``o_a_proj`` per group of heads and ``o_b_proj``."""

    checkpoint_name = "self_attn"

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, head_dim: int, *, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, window: int, norm_eps: float, dtype: torch.dtype,
                 compressor: WindowCompressor | None = None) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.q_a_proj = Projection(hidden, q_lora_rank, False, dtype)
        self.q_a_norm = RMSNormScaledInFp32(q_lora_rank, norm_eps, torch.float32)
        self.q_b_proj = Projection(q_lora_rank, num_heads * head_dim, False, dtype)
        self.kv_proj = Projection(hidden, head_dim, False, dtype)
        self.kv_norm = RMSNormScaledInFp32(head_dim, norm_eps, torch.float32)
        self.o_a_proj = Projection(num_heads * head_dim // o_groups, o_groups * o_lora_rank, False, dtype)
        self.o_b_proj = Projection(o_groups * o_lora_rank, hidden, False, dtype)
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
        self.compressor = compressor
        self.rope_kind = "main" if compressor is None else "compress"
        self.window, self.o_groups, self.norm_eps, self.scale = window, o_groups, norm_eps, head_dim**-0.5

    @property
    def cache_columns(self) -> int:
        """Width of this layer's per-token cache values (the compressor's columns; 0 without one)."""
        return self.compressor.columns if self.compressor is not None else 0

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, hidden]
        batch, t = ctx.batch, x.shape[0]
        if isinstance(batch, StaticBatch):
            raise NotImplementedError("fixed-shape decode steps do not run compressed attention")
        cos, sin = ctx.extras[self.rope_kind]  # [T, R/2]
        q_res = self.q_a_norm(linear(x, self.q_a_proj.weight))  # [T, q_lora_rank]
        q = linear(q_res, self.q_b_proj.weight).view(t, self.num_heads, self.head_dim)
        q = rotate_tail(unweighted_rms_norm(q, self.norm_eps), cos, sin)
        kv = rotate_tail(self.kv_norm(linear(x, self.kv_proj.weight))[:, None], cos, sin)  # [T, 1, D]
        keys, values = ctx.kv.keys[self.layer_idx], ctx.kv.values[self.layer_idx]
        keys.index_copy_(0, batch.slot_mapping, kv)
        if self.compressor is not None:
            self.compressor.write(x, values, batch, ctx.extras["rotary"])
        out = torch.empty_like(q)
        for seq in batch.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._attend(q[rows], keys, values, seq, batch.block_size, q_res[rows], x[rows],
                                     cos[rows], sin[rows])
        out = rotate_tail(out, cos, -sin)  # K=V carried the key's rotation into the output: undo it
        groups = out.reshape(t, self.o_groups, -1).transpose(0, 1)  # [g, T, H*D/g]
        w = self.o_a_proj.weight.view(self.o_groups, -1, groups.shape[-1]).transpose(1, 2)  # [g, H*D/g, o_lora]
        mid = torch.bmm(groups, w).transpose(0, 1).reshape(t, -1)  # [T, g * o_lora]
        return linear(mid, self.o_b_proj.weight)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq: SequenceSlice,
                block_size: int, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """One sequence's queries q [Q, heads, D] over its window and entries: [Q, heads, D]."""
        start, end = seq.context_len - seq.query_len, seq.context_len
        lo = max(0, start - self.window + 1)  # the earliest token any of the queries sees
        q_pos = torch.arange(start, end, device=q.device)
        k_pos = torch.arange(lo, end, device=q.device)
        kv = keys.index_select(0, token_slots(seq, k_pos, block_size))[:, 0]  # [K, D]: the window only
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - self.window)
        if self.compressor is not None:
            found = self.compressor.context(values, seq, block_size, q_pos, q_res, x, cos, sin)
            if found is not None:
                kv, mask = torch.cat((kv, found[0]), dim=0), torch.cat((mask, found[1]), dim=1)
        scores = torch.matmul(q.transpose(0, 1), kv.T) * self.scale  # [heads, Q, K]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        sinks = self.sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat((scores, sinks), dim=-1)  # fp32: the sinks are kept in fp32
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(kv.dtype), kv).transpose(0, 1)  # [Q, heads, D]
