"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): multi-head latent attention in which each
query attends only to the ``topk`` earlier tokens a lightning indexer scores best.

The indexer has its own small query (from the attention's low-rank query ``q_res``) and one key per
token (``k_norm(wk(x))``, rotated on its first R channels). A token's score for a query is
``sum_h w_h * relu(q_h . k) / sqrt(D)``, with per-head weights ``w = weights_proj(x) / sqrt(H)``
(that projection in fp32 for fp16 models, as transformers keeps it there; in the model dtype
else). While a query sees at most ``topk`` tokens it sees them all, so the indexer only decides
anything past ``topk`` tokens of context.

The index keys live in the paged cache beside each token's rotary key (the values' columns after
the first R), so prefix reuse, chunked prefill and preemption need nothing else. GLM-5's "shared"
layers have no indexer: they reuse the selection of the last layer before them that has one, made
in the same forward pass (kept in ``LayerContext.extras``).
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.layers.attention import step_mask
from hearth.engine.layers.batch import LayerContext, SequenceSlice
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.mla import LatentAttention
from hearth.engine.layers.norm import BiasedLayerNorm
from hearth.engine.layers.rope import apply_rotary
from hearth.engine.ops import deinterleave, linear

INDEX_KEY_NORM_EPS = 1e-6  # the reference builds the indexer's key LayerNorm with 1e-6 (not the config's eps)
SCORE_ELEMENTS = 1 << 24  # fp32 scores held at once per indexer call (64 MiB), whatever the context
SELECTIONS = "dsa_selections"  # LayerContext.extras key: sequence index -> [Q, ctx] bool or None


class TokenIndexer(nn.Module):
    """The lightning indexer of one layer (``self_attn.indexer``)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int, topk: int,
                 interleaved: bool, dtype: torch.dtype) -> None:
        """``interleaved``: the first R channels rotate as adjacent pairs (GLM-5), else as halves
        (DeepSeek-V3.2)."""
        super().__init__()
        self.wq_b = Projection(q_lora_rank, heads * head_dim, False, dtype)
        self.wk = Projection(hidden, head_dim, False, dtype)
        self.k_norm = BiasedLayerNorm(head_dim, INDEX_KEY_NORM_EPS, dtype)
        self.weights_proj = Projection(hidden, heads, False, torch.float32 if dtype == torch.float16 else dtype)
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.interleaved = interleaved

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] with its first R channels turned by cos/sin [T, R]."""
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        if self.interleaved:
            rot = deinterleave(rot)
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The index keys of new tokens x [T, hidden]: [T, 1, D]."""
        return self._rotate(self.k_norm(linear(x, self.wk.weight))[:, None], cos, sin)

    def select(self, q_res: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor | None:
        """Which of the sequence's tokens (index keys [ctx, D]) each query keeps: [Q, ctx] bool,
        causal; None while no query sees more than ``topk`` tokens (then it keeps them all). The
        queries are the sequence's last Q tokens: q_res [Q, r], x [Q, hidden], cos/sin [Q, R]."""
        n, q_len = keys.shape[0], x.shape[0]
        if n <= self.topk:
            return None
        q = self._rotate(linear(q_res, self.wq_b.weight).view(q_len, self.heads, self.head_dim), cos, sin).float()
        w = self.weights_proj.weight
        weights = linear(x.to(w.dtype), w).float()[:, None, :] * self.heads**-0.5  # [Q, 1, H]
        index = torch.empty(q_len, n, dtype=torch.float32, device=x.device)  # [Q, ctx]
        block = max(128, SCORE_ELEMENTS // (q_len * self.heads))  # keys a time: [Q, H, block] fp32 stays bounded
        for lo in range(0, n, block):
            scores = torch.relu(torch.matmul(q, keys[lo : lo + block].float().T) * self.head_dim**-0.5)  # [Q, H, b]
            index[:, lo : lo + block] = torch.matmul(weights, scores)[:, 0]
        q_pos = torch.arange(n - q_len, n, device=x.device)[:, None]
        causal = torch.arange(n, device=x.device)[None, :] <= q_pos
        picked = index.masked_fill(~causal, float("-inf")).topk(self.topk, dim=-1).indices  # [Q, topk]
        return torch.zeros_like(causal).scatter_(1, picked, True) & causal


class IndexedLatentAttention(LatentAttention):
    """MLA whose queries attend to their indexer's choice (``indexer``), or to the choice of the
    layer before that has one (``indexer=None``: GLM-5's shared layers). The cache's values hold the
    rotary key, then (with an indexer) the index key."""

    def __init__(self, *args, indexer: TokenIndexer | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if indexer is not None and not self.q_lora:
            raise ValueError("sparse attention's indexer reads the low-rank query: q_lora_rank is required")
        self.indexer = indexer

    def cache_row(self, k_rot: torch.Tensor, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if self.indexer is None:
            return k_rot
        return torch.cat((k_rot, self.indexer.keys(x, *ctx.rope)), dim=-1)  # [T, 1, rope + D]

    def sequence_mask(self, ctx: LayerContext, index: int, seq: SequenceSlice, values: torch.Tensor, rows: slice,
                      q_res: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        selections = ctx.extras.setdefault(SELECTIONS, {})
        if self.indexer is not None:
            cos, sin = ctx.rope
            selections[index] = self.indexer.select(q_res[rows], x[rows], values[:, 0, self.rope :], cos[rows],
                                                    sin[rows])
        elif index not in selections:
            raise RuntimeError(f"layer {self.layer_idx} reuses the sparse selection of an earlier layer, but none "
                               "ran before it in this pass (a pipeline stage cannot start at a shared layer)")
        keep = selections[index]
        return keep if keep is not None else step_mask(ctx.batch, index, seq, None, x.device)
