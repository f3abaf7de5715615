"""LFM2's gated short convolution, the token mixer of its ``conv`` layers: ``in_proj`` gives B, C and x
(each ``hidden`` wide), B * x goes through a causal depthwise convolution of ``L`` taps (no activation),
C gates the result and ``out_proj`` maps it back. Its state is the last ``L - 1`` inputs of the
convolution per sequence, kept in the recurrent-state pool's conv slots like a gated DeltaNet's (the
pool's recurrent state is empty for these layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.layers.batch import LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.ops import linear


class _Conv(nn.Module):
    """The depthwise convolution's ``weight`` [H, 1, L] and optional ``bias`` [H] (checkpoint: ``conv.*``)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """``window`` [B, H, L - 1 + n] -> [B, H, n], in the window's dtype."""
        out = F.conv1d(window.to(self.weight.dtype), self.weight, self.bias, groups=self.weight.shape[0])
        return out.to(window.dtype)


class ShortConv(nn.Module):
    """One LFM2 convolution layer; its convolution history lives in the state pool's slots."""

    checkpoint_name = "conv"

    def __init__(self, layer_idx: int, hidden: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = Projection(hidden, 3 * hidden, bias, dtype)
        self.conv = _Conv(hidden, kernel, bias, dtype)
        self.out_proj = Projection(hidden, hidden, bias, dtype)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        batch, cache = ctx.batch, ctx.states.conv[self.layer_idx]  # cache: [slots, H, L - 1]
        b, c, v = linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
        bx = b * v  # [T, H]
        if isinstance(batch, StaticBatch):  # a fixed-shape decode step: every row one token of its slot
            mixed = self._step(bx, batch.state_slots, cache)
        else:
            mixed = torch.empty_like(bx)
            for index, seq in enumerate(batch.sequences):
                self._sequence(index, seq, bx, mixed, batch, cache)
        return linear(c * mixed, self.out_proj.weight, self.out_proj.bias)

    def _step(self, bx: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One new token per row (bx [B, H]) of the sequences in state ``slots`` [B]; their histories
        advance in place. [B, H]."""
        window = torch.cat([cache.index_select(0, slots), bx[:, :, None].to(cache.dtype)], dim=-1)
        cache.index_copy_(0, slots, window[:, :, 1:])
        return self.conv(window)[:, :, -1].to(bx.dtype)

    def _sequence(self, index: int, seq, bx: torch.Tensor, mixed: torch.Tensor, batch, cache: torch.Tensor) -> None:
        """One sequence's new tokens after its history; the histories at the step's capture points are
        kept (the pool's snapshots: conv window, and an empty recurrent state)."""
        start, n, slot = seq.query_start, seq.query_len, seq.state_slot
        history = cache.shape[-1]  # L - 1
        window = torch.cat([cache[slot], bx[start : start + n].T.to(cache.dtype)], dim=-1)  # [H, L - 1 + n]
        mixed[start : start + n] = self.conv(window[None])[0].T.to(bx.dtype)
        for cut in seq.captures:
            batch.captured.setdefault((index, cut), {})[self.layer_idx] = (
                window[:, cut : cut + history].clone(), torch.empty(0, 0, 0, dtype=torch.float32))
        cache[slot] = window[:, n:]
