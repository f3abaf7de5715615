"""Every native decode library as a test parameter: the ones this CPU runs, and the others skipped
with the reason named (``pytest -rs`` lists them), so a CI machine of any kind tests all it can."""

from __future__ import annotations

import pytest

from hearth.engine.kernels import cpu as kernels

_NEEDS = {"avx512vnni": "AVX-512 VNNI", "avx512": "AVX-512", "avxvnni": "AVX-VNNI", "avx2": "AVX2"}


def kernel_builds() -> list:
    """pytest params (id: the instruction set) of every decode library, each a NativeKernels or skipped."""
    base = kernels.cpu_decode_ops()
    runnable = kernels.runnable_isas(base.features) if base is not None else []
    params = []
    for isa, _ in kernels.LIBRARIES:
        ops = kernels.decode_library(isa)
        reason = (f"this CPU has no {_NEEDS[isa]}" if base is not None and isa not in runnable
                  else "native kernels not available here" if base is None else f"_native_{isa} is not built")
        marks = [] if ops is not None else [pytest.mark.skip(reason=f"{isa} kernels: {reason}")]
        params.append(pytest.param(ops, id=isa, marks=marks))
    return params
