"""The device share's kernels of captured decode steps (engine/kernels/gpu/device_experts.py), run by
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


PAIR_SLOTS = [[0, 3, -1, 5], [2, -1, -1, -1], [-1, -1, -1, -1]]


def check(dtype_name: str, tokens: int = 3, hidden: int = 48, min_programs: int | None = None) -> None:
    """The comparison itself (run in a process with TRITON_INTERPRET=1): the first ``tokens`` rows
    of the pairs above; ``min_programs`` as the launch sizes its row blocks (None: the default)."""
    from hearth.engine.experts.compute import routed_partial_sum
    from hearth.engine.kernels.gpu import device_experts

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    inter, slots, t, k = 40, 6, tokens, 4
    gate_up = (torch.randn(slots, 2 * inter, hidden, generator=g) / 6).to(dtype)
    down = (torch.randn(slots, hidden, inter, generator=g) / 6).to(dtype)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    pair_slot = torch.tensor(PAIR_SLOTS[:t])
    weights = torch.rand(t, k, generator=g).to(dtype)
    sizing = {} if min_programs is None else {"min_programs": min_programs}
    ours = device_experts.slot_experts(x, gate_up, down, pair_slot, weights, device_experts.build_expert_kernels(),
                                       **sizing)
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
    if t > 2:
        assert torch.equal(ours[2], torch.zeros(hidden))  # every pair elsewhere: nothing
    print("ok", error)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_experts_equal_the_eager_sum(dtype) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", f"from tests.test_device_experts import check; check('{dtype}')"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize(("tokens", "hidden", "min_programs"), [(1, 44, None), (1, 44, 1), (3, 80, 1), (2, 72, 30)])
def test_row_blocks_of_every_size_equal_the_eager_sum(tokens, hidden, min_programs) -> None:
    """Batch 1 in 8-row blocks (the default there), and 32- and 16-row blocks, over rows that no
    block size divides."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    call = f"check('float32', {tokens}, {hidden}, {min_programs})"
    run = subprocess.run([sys.executable, "-c", f"from tests.test_device_experts import check; {call}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


class GridRecorder:
    """A stand-in for a jitted kernel: records the grids it is launched with."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_batch_1_launches_enough_programs_for_a_large_gpu(tokens) -> None:
    """Qwen3-30B-A3B's shapes (hidden 2048, expert FFN 768, top 8): each launch has about two programs
    per SM of a 132-SM GPU or more (the down projection at batch 1 had 64)."""
    from hearth.engine.kernels.gpu import device_experts

    hidden, inter, k = 2048, 768, 8
    up, down = GridRecorder(), GridRecorder()
    device_experts.slot_experts(torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta"),
                                torch.empty(4, 2 * inter, hidden, dtype=torch.bfloat16, device="meta"),
                                torch.empty(4, hidden, inter, dtype=torch.bfloat16, device="meta"),
                                torch.empty(tokens, k, dtype=torch.long, device="meta"),
                                torch.empty(tokens, k, dtype=torch.bfloat16, device="meta"), (up, down))
    (up_grid,), (down_grid,) = up.grids, down.grids
    assert up_grid[0] * up_grid[1] >= 256 and down_grid[0] * down_grid[1] >= 256, (up_grid, down_grid)
    assert down_grid[1] * device_experts.block_rows(tokens, hidden) >= hidden  # every row covered
