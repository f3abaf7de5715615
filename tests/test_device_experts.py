"""The device share's kernels of captured decode steps (engine/kernels/device_experts.py), run by
Triton's interpreter on the CPU, against the eager routed_partial_sum on the same slots: fp32
within 1e-5, bf16 within its rounding; pairs marked -1 contribute nothing. (These kernels call
Triton's own jitted helpers, so the interpreter must be on before Triton is imported: each check
runs in a fresh interpreter process.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def check(dtype_name: str) -> None:
    """The comparison itself (run in a process with TRITON_INTERPRET=1)."""
    from hearth.engine.experts.compute import routed_partial_sum
    from hearth.engine.kernels import device_experts

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    hidden, inter, slots, t, k = 48, 40, 6, 3, 4
    gate_up = (torch.randn(slots, 2 * inter, hidden, generator=g) / 6).to(dtype)
    down = (torch.randn(slots, hidden, inter, generator=g) / 6).to(dtype)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    pair_slot = torch.tensor([[0, 3, -1, 5], [2, -1, -1, -1], [-1, -1, -1, -1]])
    weights = torch.rand(t, k, generator=g).to(dtype)
    ours = device_experts.slot_experts(x, gate_up, down, pair_slot, weights, device_experts.build_expert_kernels())
    # The eager arithmetic, each step rounded to the dtype where the engine rounds. Triton's
    # interpreter turns fp32 into bf16 by truncation (a GPU rounds to nearest), so the reference
    # rounds as the interpreter does: the check is of the kernels' rounding points and sums.
    def rnd(v: torch.Tensor) -> torch.Tensor:
        if dtype == torch.float32:
            return v
        return (v.float().view(torch.int32) & ~0xFFFF).view(torch.float32)

    ref = torch.zeros(t, hidden)
    for i in range(t):
        for j in range(k):
            s = int(pair_slot[i, j])
            if s >= 0:
                gu = gate_up[s].float() @ x[i].float()
                gate, up = rnd(gu[:inter]), rnd(gu[inter:])
                h = rnd(rnd(gate / (1 + torch.exp(-gate))) * up)
                ref[i] += rnd(rnd(down[s].float() @ h) * weights[i, j].float())
    if dtype == torch.float32:  # and the engine's own eager path (native kernels where they run)
        eager = torch.cat([routed_partial_sum(x[i:i + 1], gate_up, down, pair_slot[i:i + 1], weights[i:i + 1],
                                              F.silu) for i in range(t)])
        assert float((ours - eager).abs().max()) <= 1e-5 * float(eager.abs().max())
    tolerance = 1e-5 if dtype == torch.float32 else 5e-3  # bf16: the same roundings, fp32 summation order
    error = float((ours - ref).abs().max()) / float(ref.abs().max())
    assert error <= tolerance, error
    assert torch.equal(ours[2], torch.zeros(hidden))  # every pair elsewhere: nothing
    print("ok", error)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_experts_equal_the_eager_sum(dtype) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", f"from tests.test_device_experts import check; check('{dtype}')"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
