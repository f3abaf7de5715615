"""Native CPU kernels, built when the package is installed, chosen at run time by CPU features.

The extension modules (``_native_base`` on every machine, ``_native_avx2`` for AVX2 + FMA + F16C) are
plain C++ that takes tensors as data pointers and sizes, so they build without torch's headers and
survive torch upgrades; see ``setup.py``. ``_native_avx2`` is imported only on a CPU that has those
instructions. :func:`cpu_decode_ops` returns the kernels this machine can run, or None where they
are unavailable (not built, another architecture, a CPU without AVX2, ``HEARTH_CPU_KERNELS=0``);
callers then take the torch paths, which give the same results up to fp32 rounding order. Nothing
is compiled at run time.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from hearth.engine.kernels.sources import source_hash

log = logging.getLogger(__name__)
FEATURE_AVX2 = 1 << 0
FEATURE_AVX512 = 1 << 1
FEATURE_AVX512_BF16 = 1 << 2
FEATURE_AVX512_VNNI = 1 << 3
FEATURE_AMX = 1 << 4
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK_KERNELS = frozenset({"q8_0"})  # block formats whose experts the native kernels compute in their blocks
_HERE = Path(__file__).resolve().parent


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        return None


class NativeKernels:
    """The loaded kernel modules, as tensor-level calls (inputs checked here, not in C++)."""

    def __init__(self, base: ModuleType, decode: ModuleType, features: int) -> None:
        self.features = features
        self._base, self._decode = base, decode

    def linear_decode(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] = x [M, K] @ w [N, K]^T (+ bias) for a few tokens, in the weight's dtype."""
        # The checks are kept to what is cheap: this runs for every projection of every decode step.
        if x.dtype != w.dtype or x.dim() != 2 or x.shape[1] != w.shape[1] or not (w.is_cpu and w.is_contiguous()) \
                or (bias is not None and not bias.is_contiguous()):
            raise ValueError("linear_decode: x [M, K] and a contiguous CPU weight [N, K] of the same dtype")
        if not x.is_contiguous():
            x = x.contiguous()
        m, (n, k) = x.shape[0], w.shape
        out = x.new_empty((m, n))
        self._decode.linear_decode(_code(w.dtype), x.data_ptr(), m, k, w.data_ptr(), n,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def experts_decode_blocks(self, fmt: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                              ids: list[int], weights: torch.Tensor) -> torch.Tensor | None:
        """One token's routed block-quantized experts (fp32 ``x`` [1, H], uint8 banks): the fp32 sum
        [1, H], or None for a format this build has no kernel for (the caller decodes instead)."""
        if fmt != "q8_0":
            return None
        rows, two_i = gate_up.shape[0], gate_up.shape[1]
        hidden, inter = x.shape[-1], two_i // 2
        block, block_bytes = 32, 34
        if x.dtype != torch.float32 or tuple(x.shape) != (1, hidden) or hidden % block or inter % block \
                or gate_up.dtype != torch.uint8 or down.dtype != torch.uint8 or not (gate_up.is_cpu and down.is_cpu) \
                or tuple(gate_up.shape) != (rows, 2 * inter, hidden // block * block_bytes) \
                or tuple(down.shape) != (rows, hidden, inter // block * block_bytes) \
                or not (gate_up.is_contiguous() and down.is_contiguous()) or len(ids) != weights.numel():
            raise ValueError("experts_decode_blocks: one fp32 token [1, H], contiguous uint8 Q8_0 banks "
                             "[rows, 2I, H/32*34] and [rows, H, I/32*34] (H, I multiples of 32), one weight per expert")
        x = x.contiguous()
        weights = weights.contiguous()
        out = x.new_empty((1, hidden))
        self._decode.experts_decode_q8_0(x.data_ptr(), hidden, gate_up.data_ptr(), down.data_ptr(), inter,
                                         gate_up.shape[0], ids, weights.data_ptr(), _code(weights.dtype),
                                         out.data_ptr(), torch.get_num_threads())
        return out

    def experts_decode(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: list[int],
                       weights: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """One token's routed experts (pool rows ``ids``) weighted and summed: [1, H] in the model dtype,
        or the unrounded fp32 sum with ``fp32_out``."""
        hidden = gate_up.shape[2]
        if x.numel() != hidden or x.dtype != gate_up.dtype or not (gate_up.is_cpu and gate_up.is_contiguous()
                                                                  and down.is_contiguous()) \
                or len(ids) != weights.numel():
            raise ValueError("experts_decode: one token [1, H] in the experts' dtype, contiguous CPU banks, "
                             "one weight per expert")
        if not x.is_contiguous():
            x = x.contiguous()
        if not weights.is_contiguous():
            weights = weights.contiguous()
        out = x.new_empty((1, hidden), dtype=torch.float32 if fp32_out else x.dtype)
        self._decode.experts_decode(_code(x.dtype), x.data_ptr(), hidden, gate_up.data_ptr(), down.data_ptr(),
                                    down.shape[2], gate_up.shape[0], ids, weights.data_ptr(),
                                    _code(weights.dtype), out.data_ptr(), int(fp32_out), torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * round(x * rsqrt(mean(x^2) + eps))`` over the last dimension."""
        if x.dtype != weight.dtype or not (x.is_cpu and weight.is_contiguous()) or x.shape[-1] != weight.shape[0]:
            raise ValueError("rms_norm: a CPU tensor [..., D] and a contiguous weight [D] of the same dtype")
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        d = x.shape[-1]
        self._decode.rms_norm(_code(x.dtype), x.data_ptr(), x.numel() // d, d, weight.data_ptr(), eps,
                              out.data_ptr(), torch.get_num_threads())
        return out

    def copy_rows(self, dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """``dst[dst_rows[j]] = src[src_rows[j]]`` for every j, rows copied in parallel."""
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                and dst[0].numel() == src[0].numel() and dst.device.type == src.device.type == "cpu"):
            raise ValueError("copy_rows: contiguous CPU tensors with rows of the same size and dtype")
        d, s = dst_rows.to(torch.int64).contiguous(), src_rows.to(torch.int64).contiguous()
        if d.numel() != s.numel():
            raise ValueError("copy_rows: row lists of equal length")
        row_bytes = src[0].numel() * src.element_size()
        if self._base.copy_rows(dst.data_ptr(), d.data_ptr(), dst.shape[0], src.data_ptr(), s.data_ptr(),
                                       src.shape[0], d.numel(), row_bytes, torch.get_num_threads()) != 0:
            raise RuntimeError("copy_rows: row out of range")

    def cache_step_host(self, ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor,
                        last_used: torch.Tensor, clock: torch.Tensor, qtable: torch.Tensor, stats: torch.Tensor,
                        num_candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expert cache's control step on host-memory tables (see ``experts/cache.py``), in place;
        returns (pair_slot, src, dst, count) like the tensor version."""
        for t in (ids, slot_of, expert_of, last_used, clock, qtable, stats):
            if t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("cache tables must be contiguous int64 CPU tensors")
        pair_slot = torch.empty_like(ids)
        src = torch.empty(num_candidates, dtype=torch.int64)
        dst = torch.empty(num_candidates, dtype=torch.int64)
        q = self._base.cache_step(ids.data_ptr(), ids.numel(), slot_of.data_ptr(), expert_of.data_ptr(),
                                  expert_of.numel() - 1, last_used.data_ptr(), clock.data_ptr(), qtable.data_ptr(),
                                  qtable.numel(), stats.data_ptr(), num_candidates, pair_slot.data_ptr(),
                                  src.data_ptr(), dst.data_ptr())
        return pair_slot, src, dst, torch.tensor(q)


def _code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"native kernels take float32, bfloat16 or float16, not {dtype}")
    return code


@functools.cache
def cpu_decode_ops() -> NativeKernels | None:
    """The native kernels this machine runs, or None (with one warning saying why, when that is a
    surprise: a build that is missing or older than the sources beside it)."""
    if os.environ.get("HEARTH_CPU_KERNELS", "1") == "0":
        return None
    try:
        base = _module("_native_base")
    except ImportError as exc:  # built, but does not load here (another machine's build, a missing runtime)
        log.warning("hearth: the native CPU kernels do not load (%s); using PyTorch kernels", exc)
        return None
    if base is None:
        log.warning("hearth: native CPU kernels are not built (no C++ compiler at install?); using PyTorch "
                    "kernels. Reinstall with a compiler (e.g. `pip install -e .`) for faster decoding.")
        return None
    present = source_hash(_HERE)
    if present is not None and base.source_hash() != present:
        log.warning("hearth: the native CPU kernels were built from other sources than these; using PyTorch "
                    "kernels until they are rebuilt (`pip install -e .`, or `make` in a checkout)")
        return None
    features = base.cpu_features()
    if not features & FEATURE_AVX2:
        return None  # not an AVX2 machine: the torch paths are the right ones, nothing to warn about
    try:
        decode = _module("_native_avx2")
    except ImportError as exc:
        log.warning("hearth: the AVX2 decode kernels do not load (%s); using PyTorch kernels", exc)
        return None
    if decode is None:
        log.warning("hearth: the AVX2 decode kernels are not built; using PyTorch kernels")
        return None
    return NativeKernels(base, decode, features)


@functools.cache
def cpu_has_native_half_gemm() -> bool:
    """True where PyTorch's bf16/fp16 GEMM runs on hardware support (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
