"""The projection parameter holder of every layer (the math is :func:`hearth.engine.ops.linear`)."""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.ops import embedding_rows, linear


class Projection(nn.Module):
    """Holds one projection's ``weight`` [out, in] (and ``bias``) under the checkpoint's names.

    Allocated uninitialised: the loader overwrites every element, so the random init of
    ``nn.Linear`` would be wasted work at start-up. Hot paths call :func:`linear` on the weight.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class TokenEmbedding(nn.Module):
    """The token embedding table ``weight`` [vocab, hidden] (or its quantized blocks)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.weight, ids, self.dtype)
