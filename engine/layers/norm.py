"""The norms (RMSNorm and its variants, LayerNorms), computed in fp32 and cast back exactly as the
reference implementations do (RMSNorm natively where the CPU kernels are available)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.kernels.cpu import cpu_decode_ops


class WeightedNorm(nn.Module):
    """What every norm here holds: a weight over the last dimension (ones, in ``dtype``), its eps and
    the normalised shape."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.normalized_shape = (size,)


class RMSNorm(WeightedNorm):
    """Root-mean-square layer norm over the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32, cast back, then scaled: the reference's order.
        if torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return torch.ops.hearth.rms_norm(x, self.weight, self.eps)  # one node (engine/executor/graph_ops.py)
        ops = cpu_decode_ops()
        # bf16 and fp16 keep torch's path: the native fp32 sum and 1/sqrt differ from torch's in the
        # last bits, which the half types' rounding shows now and then, and a greedy near-tie then
        # parts from transformers (bf16 OLMoE on a Zen 4: one step in 32, the top two logits one
        # bf16 step apart). The native kernel serves fp32 models, whose bar is 1e-4.
        if ops is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            return ops.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)


class Fp32ScaledRMSNorm(nn.Module):
    """RMSNorm scaled in fp32 and cast once at the end (``(weight * norm(x)).to(dtype)``, AfMoE's
    order), its weight held in fp32 (transformers keeps it so in every dtype)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps
        self.normalized_shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is centred on zero: scales by ``1 + weight``, in fp32, and casts
    once at the end (Qwen3-Next / Qwen3.5 order)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.normalized_shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(WeightedNorm):
    """RMSNorm then a SiLU gate: ``weight * norm(x) * silu(gate)`` (the DeltaNet output norm)."""


    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class LayerNormScaledInFp32(WeightedNorm):
    """LayerNorm without a bias, in fp32, its weight scaling before the one cast back (Cohere's)."""


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class LayerNorm(WeightedNorm):
    """``nn.LayerNorm(bias=False)`` in the model dtype (DBRX's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


class BiasedLayerNorm(WeightedNorm):
    """``nn.LayerNorm`` with weight and bias in the model dtype (Phi-3.5-MoE's)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNormScaledInFp32(RMSNorm):
    """RMSNorm whose weight scales the fp32 normalised value before the one cast back (GPT-OSS's
    order; :class:`RMSNorm` casts first, then scales)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class SigmoidGatedRMSNorm(WeightedNorm):
    """RMSNorm then a sigmoid gate, all in fp32, cast once at the end: ``weight * norm(x) *
    sigmoid(gate)`` (Kimi's delta-attention output norm)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
