"""The step-time model reproduces the direction of the design's claims (DESIGN.md 2.3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cache_replay import layer_calls
from bench.simulate import DESIGN_MACHINES, Machine, choose_q, costs_of, decode_seconds, simulate
from bench.traces import synthetic
from engine.hierarchy.qstar import step_seconds

EXPERT = 3 * 2048 * 768 * 2
GB = 1e9


@pytest.fixture(scope="module")
def traces():
    """Real-shaped routing (128 experts, top-8) with low and high locality; 24 layers keep it quick."""
    return [synthetic(24, 128, 8, 260, loc, prompt=60, seed=5) for loc in (0.2, 0.7)]


@settings(max_examples=60, deadline=None)
@given(b_p=st.floats(1, 80), ratio=st.floats(1.0, 5.0), m=st.integers(0, 16))
def test_exact_split_is_never_slower_per_step(b_p, ratio, m):
    machine = Machine("x", b_p * GB, b_p * ratio * GB)
    costs = costs_of(machine, EXPERT)
    exact = step_seconds(costs, m, choose_q("exact-q*", machine, costs, m))
    for policy in ("fill-only", "naive-q*"):
        assert exact <= step_seconds(costs, m, choose_q(policy, machine, costs, m)) + 1e-12
    assert exact <= min(step_seconds(costs, m, q) for q in range(m + 1)) + 1e-12


@pytest.mark.parametrize("capacity", [0.11, 0.37])
def test_exact_q_beats_both_single_paths_at_low_locality(traces, capacity):
    """The paper's claim, where it holds in this model: moderate locality. (With strong locality
    and a large, warm cache, filling every miss can win: the table is per-step optimal and does
    not value a fill's later hits; docs/benchmarks.md shows where.)"""
    for trace in traces[:1]:
        rows = simulate(trace, list(DESIGN_MACHINES), capacity, EXPERT)
        for machine in DESIGN_MACHINES:
            tok = {r["policy"]: r["tok_s"] for r in rows if r["machine"] == machine.name}
            assert tok["exact-q*"] >= max(tok["fill-only"], tok["cpu-only"]) * 0.999, (machine.name, tok)


def test_naive_rounding_loses_on_the_5090_desktop(traces):
    desktop = next(m for m in DESIGN_MACHINES if m.name == "RTX 5090 desktop")
    losses = []
    for trace in traces:
        calls = layer_calls(trace)
        slots = round(0.11 * trace.num_layers * trace.num_experts)
        exact = decode_seconds(calls, desktop, "exact-q*", slots, EXPERT)
        naive = decode_seconds(calls, desktop, "naive-q*", slots, EXPERT)
        fill = decode_seconds(calls, desktop, "fill-only", slots, EXPERT)
        assert naive > exact  # B_R is 4.8 GB/s: one expert on the CPU costs more than filling all
        assert exact == pytest.approx(fill)  # so the exact table fills everything
        losses.append(1 - exact / naive)
    assert max(losses) > 0.10  # many misses per layer (low locality): the loss is large


def test_more_cache_is_faster_with_locality(traces):
    machine = DESIGN_MACHINES[1]
    small, large = (simulate(traces[1], [machine], c, EXPERT) for c in (0.11, 0.37))
    assert {r["policy"]: r["tok_s"] for r in large}["exact-q*"] > {r["policy"]: r["tok_s"] for r in small}["exact-q*"]


def test_cpu_only_machine_has_only_the_cpu_path(traces):
    rows = simulate(traces[0], [Machine("cpu box", None, 20 * GB)], 0.37, EXPERT)
    assert [r["policy"] for r in rows] == ["cpu-only"]
    per_token = 24 * 8 * EXPERT / (20 * GB)
    assert rows[0]["tok_s"] == pytest.approx(1 / per_token, rel=1e-3)
