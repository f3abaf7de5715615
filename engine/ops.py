"""Tensor operations with CPU fast paths that keep PyTorch's numerics, shared by the layers and the
experts: projections and activations.

They sit below both ``layers/`` and ``experts/`` (which import them, never each other's modules),
and dispatch to the native kernels (:mod:`hearth.engine.kernels`) where those run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.engine.kernels import cpu_decode_ops, cpu_has_native_half_gemm

_HALF = (torch.bfloat16, torch.float16)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}

# Up to this many tokens, projections and experts use the per-token native kernels (memory bound);
# beyond it (prefill chunks) a GEMM.
SMALL_BATCH = 8


def activation(name: str):
    """The activation function for a config's ``hidden_act``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act '{name}' is not supported ({', '.join(ACTIVATIONS)} are)")
    return ACTIVATIONS[name]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with two CPU shortcuts that keep its numerics (fp32 accumulation, one
    rounding at the end):

    - one token, or a few ([M, K], M <= SMALL_BATCH: decode steps of several sequences): the
      native kernel streams the weight at memory speed once for all of them, and each row's
      result is bit-identical to computing it alone;
    - several tokens in bf16/fp16 on a CPU without native half-precision math: the GEMM runs in
      fp32 on exactly upcast operands, several times faster than PyTorch's emulated kernel there.
    """
    if weight.is_cpu:
        ops = cpu_decode_ops()
        if ops is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH and weight.is_contiguous():
            return ops.linear_decode(x, weight, bias)
        if x.dtype in _HALF and x.shape[0] > 1 and not cpu_has_native_half_gemm():
            b = bias.float() if bias is not None else None
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)
