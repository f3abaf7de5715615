"""Dense gated MLP (dense layers of MoE models and Qwen2-MoE's shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Projection, linear

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str):
    """The activation function for a config's ``hidden_act``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act '{name}' is not supported ({', '.join(ACTIVATIONS)} are)")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Projection(hidden, intermediate, False, dtype)
        self.up_proj = Projection(hidden, intermediate, False, dtype)
        self.down_proj = Projection(intermediate, hidden, False, dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        return linear(self.act(gate) * up, self.down_proj.weight)
