"""Dense gated MLP (dense layers of MoE models and Qwen2-MoE's shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.layers.linear import Projection
from hearth.engine.ops import activation, gated, linear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Projection(hidden, intermediate, bias, dtype)
        self.up_proj = Projection(hidden, intermediate, bias, dtype)
        self.down_proj = Projection(intermediate, hidden, bias, dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:  # ctx: the decoder layer's, unused
        gate = linear(x, self.gate_proj.weight, self.gate_proj.bias)
        up = linear(x, self.up_proj.weight, self.up_proj.bias)
        return linear(gated(self.act, gate, up), self.down_proj.weight, self.down_proj.bias)
