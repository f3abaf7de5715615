"""fp32 activations on the integer dot-product kernels in three int8 pieces (kernels/cpu/q8.h; the
default for the GGML formats' weights), in every decode library this CPU runs.

- Against the fp64 product of the dequantized weights, on heavy-tailed activations, centred and not:
  within 5e-6 of the largest output (measured 0.6-1.6e-6, Q8_0 2.0-2.3e-6; the fp32 kernels 0.9-1.6e-7).
- A token's result does not depend on the other tokens of the call (bit for bit).
- ``HEARTH_SPLIT_ACTIVATIONS=0`` puts the fp32 kernels back (read once per process: a subprocess).

Each library is a parameter (tests/kernel_builds.py): the ones this CPU cannot run are skipped by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hearth.engine.kernels.cpu import cpu_decode_ops
from tests.block_data import random_blocks
from tests.kernel_builds import kernel_builds

pytestmark = pytest.mark.skipif(cpu_decode_ops() is None, reason="no native kernels on this machine")
BUILDS = kernel_builds()

_K = 1024


def _heavy_tailed(m: int, seed: int, mean: float = 0.0) -> torch.Tensor:
    """Activations [m, K] whose magnitudes span several orders (the largest sets each block's scale),
    shifted by ``mean`` (the offset formats' sums per 32 then carry a large term)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, _K, generator=g) * torch.exp(torch.randn(m, _K, generator=g)) + mean


def _error(fmt: str, m: int, ops=None, mean: float = 0.0) -> float:
    """max |ours - fp64 reference| / max |reference| of linear_blocks on m tokens (``ops``: a decode
    library, by default the one this process loaded)."""
    ops = ops or cpu_decode_ops()
    w = torch.from_numpy(random_blocks(fmt, 80, _K, np.random.default_rng(7), extremes=False))
    x = _heavy_tailed(m, m, mean)
    ref = x.double() @ ops.dequantize_blocks(w, fmt, _K).double().T
    ours = ops.linear_blocks(x, w, fmt).double()
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4"])
def test_products_within_the_stated_error(fmt, ops):
    if os.environ.get("HEARTH_SPLIT_ACTIVATIONS", "1") == "0":
        pytest.skip("three-piece activations turned off in this process")
    for m in (1, 3, 8):
        assert 0 < _error(fmt, m, ops) < 5e-6
    for m in (1, 3):  # activations with a mean: the offsets' correction is large, and must cancel
        assert 0 < _error(fmt, m, ops, mean=2.0) < 5e-6


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4"])
def test_a_token_does_not_depend_on_the_others(fmt, ops):
    w = torch.from_numpy(random_blocks(fmt, 48, _K, np.random.default_rng(3), extremes=False))
    x = _heavy_tailed(5, 11)
    together = ops.linear_blocks(x, w, fmt)
    for i in range(5):
        assert torch.equal(ops.linear_blocks(x[i : i + 1], w, fmt)[0], together[i])


@pytest.mark.parametrize("ops", BUILDS)
def test_the_switch_keeps_the_fp32_kernels(ops):
    code = ("from tests.test_split_activations import _error; "
            "print(max(_error(f, m) for f in ('q4_k', 'q5_k', 'q6_k', 'q8_0', 'q4_0', 'mxfp4') for m in (1, 3)))")
    root = Path(__file__).resolve().parents[1]
    errors = {}
    for value in ("0", "1"):
        env = {**os.environ, "HEARTH_SPLIT_ACTIVATIONS": value, "HEARTH_CPU_ISA": ops.isa}
        run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        errors[value] = float(run.stdout.strip())
    assert errors["0"] < 3e-7 < errors["1"] < 5e-6


@pytest.mark.parametrize("ops", BUILDS)
def test_a_nan_stays_in_its_token(ops):
    """A NaN activation makes its own token's outputs NaN (as fp32 products would) and no other's."""
    w = torch.from_numpy(random_blocks("q4_k", 32, _K, np.random.default_rng(4)))
    x = _heavy_tailed(2, 5)
    x[0, 300] = float("nan")
    out = ops.linear_blocks(x, w, "q4_k")
    assert out[0].isnan().all() and out[1].isfinite().all()
