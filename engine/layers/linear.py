"""Linear projection with CPU shortcuts that keep ``F.linear``'s numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_decode_ops, cpu_has_native_half_gemm

_HALF = (torch.bfloat16, torch.float16)


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


# Up to this many tokens, projections and experts use the per-token native kernels (memory bound);
# beyond it (prefill chunks) a GEMM.
SMALL_BATCH = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with two CPU shortcuts that keep its numerics (fp32 accumulation, one
    rounding at the end):

    - one token, or a few ([M, K], M <= SMALL_BATCH: decode steps of several sequences): the
      native kernel streams the weight at memory speed once for all of them, and each row's
      result is bit-identical to computing it alone;
    - several tokens in bf16/fp16 on a CPU without native half-precision math: the GEMM runs in
      fp32 on exactly upcast operands, several times faster than PyTorch's emulated kernel there.
    """
    if weight.device.type == "cpu":
        ops = cpu_decode_ops()
        if ops is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH and weight.is_contiguous():
            return ops.linear_decode(x.contiguous(), weight, bias)
        if x.dtype in _HALF and x.shape[0] > 1 and not cpu_has_native_half_gemm():
            b = bias.float() if bias is not None else None
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)
