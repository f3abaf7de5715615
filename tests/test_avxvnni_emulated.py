"""The AVX-VNNI library's kernels on a CPU without AVX-VNNI: ``decode_avxvnni.cpp`` built with the
EVEX form of the same instruction (``vpdpbusd`` on 256 bits from AVX-512 VNNI + VL, which computes the
same int32 lanes as AVX-VNNI's VEX form), so that its code path (q8_256.h with ``HEARTH_Q8_VNNI256``)
is checked against the gguf package's dequantizer where the real instruction is missing. Slow: it
compiles a library (about a minute on 2 cores). Skipped without AVX-512 VNNI or a compiler."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hearth.engine.kernels import cpu as kernels
from hearth.engine.kernels.cpu.sources import COMMON_FLAGS, source_hash
from hearth.engine.quant.registry import FORMATS
from tests.block_data import random_blocks

KERNELS = Path(kernels.__file__).resolve().parent
_ops = kernels.cpu_decode_ops()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_ops is None or not _ops.features & kernels.FEATURE_AVX512_VNNI,
                       reason="needs AVX-512 VNNI to stand in for AVX-VNNI"),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler"),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> kernels.NativeKernels:
    out = tmp_path_factory.mktemp("avxvnni") / f"_native_avxvnni{sysconfig.get_config_var('EXT_SUFFIX')}"
    flags = [*COMMON_FLAGS, f'-DHEARTH_SOURCE_HASH="{source_hash(KERNELS)}"', "-mavx2", "-mfma", "-mf16c",
             "-mavx512vnni", "-mavx512vl", "-D__AVXVNNI__", "-D_mm256_dpbusd_avx_epi32=_mm256_dpbusd_epi32"]
    cmd = ["c++", *flags, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
           str(KERNELS / "decode_avxvnni.cpp"), "-o", str(out)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("hearth.engine.kernels.cpu._native_avxvnni", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return kernels.NativeKernels(_ops._base, module, _ops.features)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4"])
def test_both_modes_match_the_gguf_dequantizer(emulated, fmt):
    assert emulated.q8_kernel == "avx-vnni"
    k, n = 1024, 48
    w = torch.from_numpy(random_blocks(fmt, n, k, np.random.default_rng(5), extremes=False))
    qtype = gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type)
    ref_w = torch.from_numpy(gguf.quants.dequantize(w.numpy(), qtype).astype(np.float64))
    for m in (1, 3, 8, 11):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g))  # heavy-tailed
        ref = x.double() @ ref_w.T
        assert 0 < float((emulated.linear_blocks(x, w, fmt).double() - ref).abs().max() / ref.abs().max()) < 5e-6
        q = torch.randint(-127, 128, (m, k), generator=g).float()
        q[:, ::256] = 127.0  # activations int8 holds exactly
        xe = q * 2.0**-5
        ref8 = xe.double() @ ref_w.T
        got8 = emulated.linear_blocks(xe, w, fmt, int8=True).double()
        assert float((got8 - ref8).abs().max() / ref8.abs().max()) < 1e-5
