"""The q* policy against brute force, and its degenerate cases."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hearth.engine.experts.policy.qstar import PathCost, SplitCosts, best_q, build_qtable

GB = 1e9
# The reference machines of docs/design.md: (B_P, B_H) in GB/s.
MACHINES = {
    "rtx4060-laptop": (11.8, 47.5),
    "rtx4090": (25.1, 63.2),
    "rtx3090": (25.3, 56.7),
    "rtx-pro-6000": (51.5, 178.0),
    "rtx5090-server": (52.7, 77.3),
    "rtx5090-desktop": (49.0, 53.8),
}
EXPERT_BYTES = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B bf16 expert


def brute_force(s: int, b_p: float, b_h: float, fill_fixed: float, cpu_fixed: float, m: int) -> int:
    """Written independently of the module: try every q, keep the fastest, prefer more fills."""
    b_r = max(b_h - b_p, 0.0)

    def exposed(q: int) -> float:
        t_fill = 0.0 if q == 0 else fill_fixed + q * s / b_p
        if m == q:
            t_cpu = 0.0
        elif b_r == 0:
            t_cpu = math.inf
        else:
            t_cpu = cpu_fixed + (m - q) * s / b_r
        return max(t_fill, t_cpu)

    times = [exposed(q) for q in range(m + 1)]
    best = min(times)
    return max(q for q in range(m + 1) if times[q] == best)


GRID = [(bp, bh) for bp, bh in itertools.product([1.0, 11.8, 25.0, 49.0, 64.0], [8.0, 30.0, 53.8, 120.0])]


@pytest.mark.parametrize("b_p,b_h", GRID + list(MACHINES.values()))
@pytest.mark.parametrize("fixed", [(0.0, 0.0), (20e-6, 5e-6)])
def test_qtable_equals_brute_force(b_p, b_h, fixed):
    costs = SplitCosts(EXPERT_BYTES, PathCost(b_p * GB, fixed[0]), b_h * GB, cpu_fixed_s=fixed[1])
    table = build_qtable(costs, 64).tolist()
    expected = [brute_force(EXPERT_BYTES, b_p * GB, b_h * GB, fixed[0], fixed[1], m) for m in range(65)]
    assert table == expected


def test_rtx5090_desktop_fills_all_eight():
    b_p, b_h = MACHINES["rtx5090-desktop"]
    costs = SplitCosts(EXPERT_BYTES, PathCost(b_p * GB), b_h * GB)
    assert best_q(costs, 8) == 8
    # Rounding the closed form q ≈ m·B_P/B_H would send one expert to the CPU instead.
    assert round(8 * b_p / b_h) == 7


def test_laptop_splits_misses():
    b_p, b_h = MACHINES["rtx4060-laptop"]
    q = best_q(SplitCosts(EXPERT_BYTES, PathCost(b_p * GB), b_h * GB), 8)
    assert 0 < q < 8  # B_P/B_H = 0.25: about two fills, the rest on the CPU


def test_degenerate_cases():
    no_device = SplitCosts(EXPERT_BYTES, None, 50 * GB)
    assert build_qtable(no_device, 8).tolist() == [0] * 9
    no_workers = SplitCosts(EXPERT_BYTES, PathCost(10 * GB), None)
    assert build_qtable(no_workers, 8).tolist() == list(range(9))
    slow_host = SplitCosts(EXPERT_BYTES, PathCost(50 * GB), 40 * GB)  # B_H <= B_P
    assert build_qtable(slow_host, 8).tolist() == list(range(9))


@settings(max_examples=80, deadline=None)
@given(b_p=st.floats(1, 80), ratio=st.floats(0.5, 5.0), m=st.integers(0, 16))
def test_fill_credit_moves_q_monotonically_between_none_and_all(b_p, ratio, m):
    """More credit per fill never fills fewer; -inf fills none, +inf all, 0 is the per-step table."""
    costs = SplitCosts(EXPERT_BYTES, PathCost(b_p * GB), b_p * ratio * GB)
    ladder = [-math.inf, 0.0, 0.25, 0.5, 1.0, 4.0, math.inf]
    qs = [best_q(costs, m, credit) for credit in ladder]
    assert qs == sorted(qs)
    assert qs[0] == 0 and qs[-1] == m and qs[1] == best_q(costs, m)
