"""Native CPU kernels, built when the package is installed, chosen at run time by CPU features.

The extension modules are ``_native_base`` on every machine and one decode library per x86-64
instruction set: ``_native_avx2`` (AVX2 + FMA + F16C), ``_native_avxvnni`` (the same with AVX-VNNI),
``_native_avx512`` (16-lane block-quantized products) and ``_native_avx512vnni`` (those with AVX-512
VNNI). Each has the integer dot-product kernels of the GGML formats (kernels/cpu/q8.h), 256 or 512
bits wide. They are plain C++ that takes tensors as data pointers and sizes, so they build without
torch's headers and survive torch upgrades; see ``setup.py``. One decode library is imported, on a
CPU that has its instructions: ``HEARTH_CPU_ISA`` pins it, otherwise the fastest by measurement
(``dispatch.py``).
:func:`cpu_decode_ops` returns the kernels this machine can run, or None where they are unavailable
(not built, another architecture, a CPU without AVX2, ``HEARTH_CPU_KERNELS=0``); callers then take
the torch paths, which give the same results up to fp32 rounding order. Nothing is compiled at run
time."""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from hearth.config import cache_dir
from hearth.engine.kernels.cpu.dispatch import KernelChoice, cache_key, choose
from hearth.engine.kernels.cpu.sources import source_hash
from hearth.engine.quant.registry import REGISTRY, block_format

log = logging.getLogger(__name__)
FEATURE_AVX2 = 1 << 0
FEATURE_AVX512 = 1 << 1
FEATURE_AVX512_BF16 = 1 << 2
FEATURE_AVX512_VNNI = 1 << 3
FEATURE_AMX = 1 << 4
FEATURE_AVX_VNNI = 1 << 5
# The decode libraries (``_native_<isa>``) and the feature bits each needs, widest first.
LIBRARIES = (("avx512vnni", FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_AVX512_VNNI),
             ("avx512", FEATURE_AVX2 | FEATURE_AVX512), ("avxvnni", FEATURE_AVX2 | FEATURE_AVX_VNNI),
             ("avx2", FEATURE_AVX2))
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Block formats the native kernels compute in their blocks, with their codes in blocks.h (each
# format's module declares its entry).
BLOCK_CODES = REGISTRY.kernel_codes()
BLOCK_KERNELS = frozenset(BLOCK_CODES)
_HERE = Path(__file__).resolve().parent


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        return None


class NativeKernels:
    """The loaded kernel modules, as tensor-level calls (inputs checked here, not in C++)."""

    def __init__(self, base: ModuleType, decode: ModuleType, features: int,
                 choice: KernelChoice | None = None) -> None:
        self.features = features
        self._base, self._decode = base, decode
        self.isa = decode.__name__.rsplit("_native_", 1)[-1]
        self.choice = choice or KernelChoice(self.isa, "loaded directly")
        # The integer dot-product kernels of the GGML formats (q8.h): every x86-64 library has them.
        self.q8_kernel: str = decode.q8_kernel() if hasattr(decode, "q8_kernel") else ""
        self.int8_activations = bool(self.q8_kernel)

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

    def linear_blocks(self, x: torch.Tensor, w: torch.Tensor, fmt: str, int8: bool = False) -> torch.Tensor:
        """y fp32 [M, N] = x fp32 [M, K] @ W^T for W uint8 [N, K / elems * bytes] in block format
        ``fmt`` (read in its blocks; every 8 tokens share one pass over W). Where this library has VNNI,
        the GGML formats with K a multiple of 256 take x in three int8 pieces (about 1e-6 relative;
        ``HEARTH_SPLIT_ACTIVATIONS=0`` keeps fp32). ``int8``: the int8-activation mode, one piece, for
        those (others keep fp32 activations)."""
        code = BLOCK_CODES[fmt]
        if x.dtype != torch.float32 or x.dim() != 2 or w.dtype != torch.uint8 or w.dim() != 2 \
                or not (w.is_cpu and w.is_contiguous()) or w.shape[1] != _row_bytes(fmt, x.shape[1]):
            raise ValueError(f"linear_blocks: fp32 x [M, K] and a contiguous uint8 {fmt} weight [N, K-row bytes]")
        x = x.contiguous()
        out = x.new_empty((x.shape[0], w.shape[0]))
        self._decode.linear_blocks(code, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                                   out.data_ptr(), torch.get_num_threads(), int(int8))
        return out

    def dequantize_blocks(self, w: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
        """fp32 [rows, cols] from uint8 rows of blocks [rows, >= row bytes] (rows may be strided, as
        a bank's expert rows are): each weight q * scale + bias in one rounding."""
        if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(1) != 1 or not w.is_cpu \
                or w.shape[1] < _row_bytes(fmt, cols):
            raise ValueError(f"dequantize_blocks: uint8 CPU rows [rows, >= row bytes] of {fmt}")
        out = torch.empty((w.shape[0], cols), dtype=torch.float32)
        self._decode.dequantize_blocks(BLOCK_CODES[fmt], w.data_ptr(), w.shape[0], cols, w.stride(0), out.data_ptr(),
                                       torch.get_num_threads())
        return out

    def experts_blocks(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                       weights: torch.Tensor, gate_up_fmt: str, down_fmt: str, inter: int,
                       int8: bool = False) -> torch.Tensor:
        """The routed block-quantized experts of a few tokens, SiLU-gated, weighted and summed: fp32
        [T, H]. ``x`` fp32 [T, H]; ``rows`` [T, k] bank rows (-1: computed elsewhere); expert ``r``'s
        gate and up rows (2I of H elements) are the first bytes of ``gate_up[r]``, its down rows (H of
        I elements) the first bytes of ``down[r]`` (uint8 banks, one expert per row)."""
        return self._routed("experts_blocks", x, gate_up, down, rows, weights, gate_up_fmt, down_fmt, inter,
                            (int(int8),))

    def experts_gemm(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                     weights: torch.Tensor, gate_up_fmt: str, down_fmt: str, inter: int) -> torch.Tensor:
        """:meth:`experts_blocks` for many tokens (prefill) with fp32 activations: each routed expert's
        rows decoded a few at a time and multiplied in fp32 for all its tokens, the experts shared
        out whole between the threads. fp32 [T, H]."""
        return self._routed("experts_gemm", x, gate_up, down, rows, weights, gate_up_fmt, down_fmt, inter, ())

    def _routed(self, name: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                weights: torch.Tensor, gate_up_fmt: str, down_fmt: str, inter: int, extra: tuple) -> torch.Tensor:
        """The inputs of a routed-experts entry point (``name``) checked, then the call: both take the
        same arguments, ``extra`` after them."""
        t, hidden = x.shape
        if x.dtype != torch.float32 or gate_up.dtype != torch.uint8 or down.dtype != torch.uint8 \
                or gate_up.dim() != 2 or down.dim() != 2 or gate_up.stride(1) != 1 or down.stride(1) != 1 \
                or not (gate_up.is_cpu and down.is_cpu) or gate_up.shape[0] != down.shape[0] \
                or gate_up.shape[1] < 2 * inter * _row_bytes(gate_up_fmt, hidden) \
                or down.shape[1] < hidden * _row_bytes(down_fmt, inter) \
                or rows.shape[0] != t or weights.shape != rows.shape:
            raise ValueError(f"{name}: fp32 x [T, H], uint8 banks [rows, expert bytes] holding whole "
                             f"{gate_up_fmt}/{down_fmt} experts, rows and weights [T, k]")
        x = x.contiguous()
        ids = rows.to(torch.int64).contiguous()
        w = weights.to(torch.float32).contiguous()
        out = x.new_empty((t, hidden))
        rc = getattr(self._decode, name)(BLOCK_CODES[gate_up_fmt], BLOCK_CODES[down_fmt], x.data_ptr(), t, hidden,
                                         inter, gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(),
                                         down.stride(0), gate_up.shape[0], ids.data_ptr(), ids.shape[1],
                                         w.data_ptr(), out.data_ptr(), torch.get_num_threads(), *extra)
        if rc != 0:
            raise ValueError(f"{name}: a bank row out of [0, {gate_up.shape[0]})")
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


def _row_bytes(fmt: str, cols: int) -> int:
    return block_format(fmt).row_bytes(cols)


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
    pinned = os.environ.get("HEARTH_CPU_ISA", "").strip().lower()
    order = library_order(features, pinned)
    loaded = {isa: module for isa in order if (module := _decode_library(isa, present))}
    if not loaded:
        log.warning("hearth: no decode kernel library is built for these sources (%s); using PyTorch kernels",
                    ", ".join(order))
        return None
    if pinned in loaded:
        choice = KernelChoice(pinned, "pinned by HEARTH_CPU_ISA")
    else:
        choice = choose(loaded, cache_dir() / "kernels.json", cache_key(present, features))
    return NativeKernels(base, loaded[choice.isa], features, choice)


def _decode_library(isa: str, present: str | None) -> ModuleType | None:
    """The ``_native_<isa>`` module, or None (with a warning) where it is not built, does not load or
    was built from other sources than these."""
    name = f"_native_{isa}"
    try:
        decode = _module(name)
    except ImportError as exc:
        log.warning("hearth: the %s decode kernels do not load (%s)", name, exc)
        return None
    if decode is not None and present is not None and getattr(decode, "source_hash", str)() != present:
        # A build that failed for this library only (setup.py builds them as optional) leaves the
        # previous one in place: stale like a stale base library.
        log.warning("hearth: the %s kernels were built from other sources than these; trying the next", name)
        return None
    return decode


def decode_library(isa: str) -> NativeKernels | None:
    """The decode library of one instruction set (``avx2``, ``avxvnni``, ``avx512``, ``avx512vnni``)
    beside the one this process chose, to compare or test them side by side: None where native
    kernels do not run here, this CPU lacks its instructions, or it is not built for these sources."""
    ops = cpu_decode_ops()
    if ops is None or isa not in runnable_isas(ops.features):
        return None
    module = _decode_library(isa, source_hash(_HERE))
    return None if module is None else NativeKernels(ops._base, module, ops.features)


def runnable_isas(features: int) -> list[str]:
    """The decode libraries (by instruction set) a CPU with these feature bits runs, widest first."""
    return [isa for isa, needs in LIBRARIES if features & needs == needs]


def library_order(features: int, pinned: str = "") -> list[str]:
    """The libraries to try, in order: ``pinned`` (``HEARTH_CPU_ISA``, lower case) alone where this CPU runs it,
    else every runnable one, widest first."""
    runnable = runnable_isas(features)
    if pinned in runnable:
        return [pinned]
    if pinned:
        log.warning("hearth: HEARTH_CPU_ISA=%s is not one this CPU runs (%s); ignoring it", pinned,
                    ", ".join(runnable))
    return runnable


@functools.cache
def cpu_has_native_half_gemm() -> bool:
    """True where PyTorch's bf16/fp16 GEMM runs on hardware support (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
