"""Native CPU kernels, compiled on first use (x86-64 with AVX2; elsewhere the torch paths run).

Set ``HEARTH_CPU_KERNELS=0`` to disable them. Compilation needs a C++ compiler and ninja; when it
fails the engine logs a warning and falls back to plain PyTorch, which gives the same results
up to fp32 rounding order.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cache_step.cpp")]


def _supported() -> bool:
    if os.environ.get("HEARTH_CPU_KERNELS", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.lru_cache(maxsize=1)
def cpu_has_native_half_gemm() -> bool:
    """True where PyTorch's bf16/fp16 GEMM runs on hardware support (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


@functools.lru_cache(maxsize=1)
def cpu_decode_ops() -> ModuleType | None:
    """The compiled ``linear_decode`` / ``experts_decode`` module, or None where unavailable."""
    if not _supported():
        return None
    # A cached build loads in well under a second; only a first build is worth a notice.
    notice = threading.Timer(
        8.0, lambda: print("hearth: building native CPU kernels (first run only, about a minute)…", file=sys.stderr)
    )
    notice.start()
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="hearth_cpu_decode",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported toolchain …
        log.warning("hearth: native CPU kernels unavailable (%s); using PyTorch kernels", exc)
        return None
    finally:
        notice.cancel()
