"""Builds the native CPU kernels at install time (``pip install .`` and ``pip install -e .`` alike).

The project's metadata is in pyproject.toml; this file only adds the kernel libraries. They are
plain C++ behind a C ABI (loaded with ctypes), so they need no torch headers to build and no
particular torch version to run. Each library targets one instruction set; the runtime loads the
best one the CPU has (``hearth.engine.kernels.cpu``). Both are optional: without a compiler the
install still succeeds and the engine runs its torch paths (with one warning).
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = Path("engine") / "kernels" / "cpu"
# The fingerprint the runtime compares against the sources beside it (a stale editable build): one
# definition, loaded by path because nothing of the package is importable yet.
_spec = importlib.util.spec_from_file_location("hearth_kernel_sources", KERNELS / "sources.py")
_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sources)
SOURCES = _sources.kernel_sources(KERNELS)
SOURCE_HASH = _sources.source_hash(KERNELS)


def kernel(name: str, source: str, isa_flags: tuple[str, ...]) -> Extension:
    return Extension(
        f"hearth.engine.kernels.cpu.{name}",
        sources=[str(KERNELS / source)],
        depends=[str(p) for p in SOURCES],
        include_dirs=[str(KERNELS)],
        language="c++",
        extra_compile_args=[*_sources.COMMON_FLAGS, f'-DHEARTH_SOURCE_HASH="{SOURCE_HASH}"', *isa_flags],
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


extensions = [kernel(*build) for build in _sources.kernel_builds(platform.machine())]

setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
