"""Builds the native CPU kernels at install time (``pip install .`` and ``pip install -e .`` alike).

The project's metadata is in pyproject.toml; this file only adds the kernel libraries. They are
plain C++ behind a C ABI (loaded with ctypes), so they need no torch headers to build and no
particular torch version to run. Each library targets one instruction set; the runtime loads the
best one the CPU has (``hearth.engine.kernels``). Both are optional: without a compiler the
install still succeeds and the engine runs its torch paths (with one warning).
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = Path("engine") / "kernels"
SOURCES = sorted(KERNELS.glob("*.cpp")) + sorted(KERNELS.glob("*.h"))


def source_hash() -> str:
    """What the runtime compares against the sources beside it (a stale editable build)."""
    digest = hashlib.blake2b(digest_size=8)
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def kernel(name: str, source: str, isa_flags: list[str]) -> Extension:
    return Extension(
        f"hearth.engine.kernels.{name}",
        sources=[str(KERNELS / source)],
        depends=[str(p) for p in SOURCES],
        include_dirs=[str(KERNELS)],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0", "-fopenmp", "-fvisibility=hidden",
                            f'-DHEARTH_SOURCE_HASH="{source_hash()}"', *isa_flags],
        extra_link_args=["-fopenmp"],
        optional=True,  # no compiler, or an unsupported one: install anyway, run the torch paths
    )


class BuildKernels(build_ext):
    """build_ext that says, in one line, what it built or why it could not."""

    def run(self) -> None:
        super().run()
        built = [ext.name.rsplit(".", 1)[1] for ext in self.extensions
                 if Path(self.get_ext_fullpath(ext.name)).exists()]
        print(f"hearth: native CPU kernels built: {', '.join(built) or 'none (the torch paths will run)'}")


extensions = [kernel("_native_base", "base.cpp", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    extensions.append(kernel("_native_avx2", "decode_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"]))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
