"""The fingerprint of the native kernels' sources, shared by the build (``setup.py``, which embeds it
in the modules) and the loader (which compares it with the sources beside the package). No imports
beyond the standard library: ``setup.py`` loads this file before anything is installed."""

from __future__ import annotations

import hashlib
from pathlib import Path


def kernel_sources(folder: Path) -> list[Path]:
    """The files a kernel build depends on."""
    return sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h"))


def source_hash(folder: Path) -> str | None:
    """A short hash of :func:`kernel_sources` (None when the folder holds none, as in some wheels)."""
    sources = kernel_sources(folder)
    if not sources:
        return None
    digest = hashlib.blake2b(digest_size=8)
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# Flags every kernel library is built with, and each library's source and instruction-set flags: one
# description for ``setup.py`` (pip installs) and ``tools/build_kernels.py`` (a source tree used in
# place, e.g. on a machine with no package index).
COMMON_FLAGS = ("-std=c++17", "-O3", "-g0", "-fopenmp", "-fvisibility=hidden")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-Wno-maybe-uninitialized")


def kernel_builds(machine: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(module name, source file, instruction-set flags) of each library for a machine
    (``platform.machine()``): the base library everywhere, the decode libraries on x86-64."""
    builds = [("_native_base", "base.cpp", ())]
    if machine.lower() in ("x86_64", "amd64"):
        builds += [("_native_avx2", "decode_avx2.cpp", _AVX2), ("_native_avx512", "decode_avx512.cpp", _AVX512),
                   ("_native_avxvnni", "decode_avxvnni.cpp", (*_AVX2, "-mavxvnni")),
                   ("_native_avx512vnni", "decode_avx512vnni.cpp", (*_AVX512, "-mavx512vnni"))]
    return builds
