"""Tensor operations with CPU fast paths that keep PyTorch's numerics, shared by the layers and the
experts: projections and activations.

They sit below both ``layers/`` and ``experts/`` (which import them, never each other's modules),
and dispatch to the native kernels (:mod:`hearth.engine.kernels.cpu`) where those run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.engine.kernels.cpu import BLOCK_KERNELS, cpu_decode_ops, cpu_has_native_half_gemm
from hearth.engine.quant.registry import dequantize

_HALF = (torch.bfloat16, torch.float16)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}

# Up to this many tokens, projections and experts use the per-token native kernels (memory bound);
# beyond it (prefill chunks) a GEMM.
SMALL_BATCH = 8


class ClampedSwiGLU:
    """GPT-OSS's gated unit: gate clamped above at ``limit``, up clamped to ±``limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Named ``clamped_swiglu:ALPHA:LIMIT`` as a
    ``hidden_act``, so the expert workers in other processes rebuild it from the name."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit
        self.name = f"clamped_swiglu:{alpha!r}:{limit!r}"

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class ClampedSiLU:
    """DeepSeek-V4's gated unit: ``silu(gate)`` with the gate clamped above at ``limit``, times up
    clamped to ±``limit``. Named ``clamped_silu:LIMIT`` as a ``hidden_act`` (see :class:`ClampedSwiGLU`)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.name = f"clamped_silu:{limit!r}"

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(min=None, max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def deinterleave(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)… along ``dim`` -> (x0, x2, …, x1, x3, …): DeepSeek-V3's interleaved
    rotary channels, GPT-OSS's interleaved gate and up."""
    x = x.movedim(dim, -1)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).movedim(-1, dim)


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated unit of an expert or MLP: ``act(gate) * up``, or the activation's own
    (:class:`ClampedSwiGLU`, :class:`ClampedSiLU`)."""
    return act.glu(gate, up) if isinstance(act, (ClampedSwiGLU, ClampedSiLU)) else act(gate) * up


def activation_name(fn) -> str:
    """The ``hidden_act`` name of an activation function from :func:`activation`."""
    if isinstance(fn, (ClampedSwiGLU, ClampedSiLU)):
        return fn.name
    return next(name for name, f in ACTIVATIONS.items() if f is fn)


def activation(name: str):
    """The activation function for a config's ``hidden_act`` (or a clamped unit by its name)."""
    if name.startswith("clamped_swiglu:"):
        _, alpha, limit = name.split(":")
        return ClampedSwiGLU(float(alpha), float(limit))
    if name.startswith("clamped_silu:"):
        return ClampedSiLU(float(name.split(":")[1]))
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

    A weight kept in its quantized blocks (uint8 [N, row bytes] tagged ``block_format``, see
    :func:`block_weight`) is read in them for a few tokens, and decoded once per call otherwise.

    Under ``torch.compile`` the same work is one custom op (``engine/executor/graph_ops.py``).
    """
    if torch.compiler.is_compiling() and weight.is_cpu:
        if weight.dtype == torch.uint8:
            return torch.ops.hearth.linear_blocks(x, weight, bias, weight.block_format.name,
                                                  getattr(weight, "int8_activations", False))
        return torch.ops.hearth.linear(x, weight, bias)
    if weight.dtype == torch.uint8:
        return _block_linear(x, weight, bias)
    if weight.is_cpu:
        ops = cpu_decode_ops()
        if ops is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH and weight.is_contiguous():
            return ops.linear_decode(x, weight, bias)
        if x.dtype in _HALF and x.shape[0] > 1 and not cpu_has_native_half_gemm():
            b = bias.float() if bias is not None else None
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def block_weight(data: torch.Tensor, fmt) -> torch.nn.Parameter:
    """A frozen parameter holding a weight in its quantized blocks (uint8 [N, row bytes] of the
    :class:`~hearth.engine.quant.block.BlockFormat` ``fmt``), which :func:`linear` and
    :func:`embedding_rows` recognise."""
    param = torch.nn.Parameter(data, requires_grad=False)
    param.block_format = fmt
    return param


def decode_blocks(data: torch.Tensor, fmt, cols: int) -> torch.Tensor:
    """uint8 rows of blocks [rows, row bytes] -> float32 [rows, cols]: natively (in parallel) where
    the kernels run, else by the torch decoder. Prefill decodes each weight once per step this way."""
    if torch.compiler.is_compiling() and data.is_cpu:
        return torch.ops.hearth.decode_blocks(data, fmt.name, cols)  # one node (engine/executor/graph_ops.py)
    ops = cpu_decode_ops()
    if ops is not None and data.is_cpu and fmt.name in BLOCK_KERNELS and data.stride(-1) == 1:
        return ops.dequantize_blocks(data, fmt.name, cols)
    return dequantize(data, fmt, cols)


def _block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    fmt = weight.block_format
    x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    ops = cpu_decode_ops()
    int8 = getattr(weight, "int8_activations", False)
    # A few tokens, or any number in the int8 mode (its integer products outrun decoding the weight
    # for an fp32 GEMM at every token count: 2.3x on a 5B model's prefill, 2-core Zen 4)
    if ops is not None and (x2.shape[0] <= SMALL_BATCH or int8) and fmt.name in BLOCK_KERNELS:
        y = ops.linear_blocks(x2, weight, fmt.name, int8)
    else:  # many tokens: decode once, one GEMM
        y = x2 @ decode_blocks(weight, fmt, x2.shape[1]).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def embedding_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of an embedding table [V, H], decoded from blocks when it is kept in them."""
    if weight.dtype != torch.uint8:
        return F.embedding(ids, weight)
    fmt = weight.block_format
    rows = weight.index_select(0, ids.reshape(-1))  # [T, row bytes]
    cols = rows.shape[1] // fmt.block_bytes * fmt.block_elems
    return decode_blocks(rows, fmt, cols).to(dtype).reshape(*ids.shape, cols)
