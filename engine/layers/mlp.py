"""Dense gated MLP (dense layers of MoE models and Qwen2-MoE's shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.layers.linear import Projection
from hearth.engine.ops import activation, linear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Projection(hidden, intermediate, False, dtype)
        self.up_proj = Projection(hidden, intermediate, False, dtype)
        self.down_proj = Projection(intermediate, hidden, False, dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:  # ctx: the decoder layer's, unused
        gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        return linear(self.act(gate) * up, self.down_proj.weight)
