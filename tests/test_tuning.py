"""The fill-credit tuner: a hill climber over the credit ladder, judged by measured seconds."""

from __future__ import annotations

import math

import pytest

from hearth.engine.experts.policy.tuning import CREDIT_LADDER, CreditTuner

EPOCH = 8
HOME = CREDIT_LADDER.index(0.0)


def drive(tuner: CreditTuner, cost_of_rung, calls: int) -> list[int]:
    """Feed ``calls`` single-call observations whose cost depends on the current rung only; the
    rung of every call."""
    seen = []
    for _ in range(calls):
        seen.append(tuner.index)
        tuner.observe(cost_of_rung[tuner.index])
    return seen


def test_climbs_to_the_fastest_rung():
    costs = [5.0, 1.0, 0.9, 0.8, 0.85, 1.2]
    tuner = CreditTuner(epoch_calls=EPOCH)
    seen = drive(tuner, costs, 4000)
    assert tuner.credit == 0.5
    assert seen[-2000:].count(3) / 2000 > 0.9  # and stays there, probing only now and then


def test_stays_home_when_neighbours_are_worse_and_probes_ever_more_rarely():
    costs = [3.0, 1.0, 1.1, 1.2, 1.3, 1.4]
    tuner = CreditTuner(epoch_calls=EPOCH)
    seen = drive(tuner, costs, 8000)
    assert tuner.credit == 0.0 and tuner.moves == 0
    away_early = sum(i != HOME for i in seen[:2000])
    away_late = sum(i != HOME for i in seen[-2000:])
    assert away_late < away_early  # backoff
    assert sum(i != HOME for i in seen) / len(seen) < 0.05


def test_looks_past_a_plateau():
    costs = [4.0, 1.0, 1.0, 0.7, 1.0, 1.0]  # credits 0 and 0.25 give the same table
    tuner = CreditTuner(epoch_calls=EPOCH)
    drive(tuner, costs, 2000)
    assert tuner.credit == 0.5


def test_a_slow_probe_towards_fewer_fills_ends_after_a_quarter_epoch():
    costs = [10.0, 1.0, 1.5, 2.0, 2.5, 3.0]
    tuner = CreditTuner(epoch_calls=EPOCH)
    seen = drive(tuner, costs, 3000)
    runs, current = [], 0
    for i in seen:
        if i == 0:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    assert runs and max(runs) <= EPOCH // 4


def test_a_probe_towards_more_fills_runs_its_full_length():
    costs = [10.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    tuner = CreditTuner(epoch_calls=EPOCH, probe=2)
    seen = drive(tuner, costs, 200)
    first = seen.index(HOME + 1)
    assert seen[first:first + 2 * EPOCH] == [HOME + 1] * (2 * EPOCH)


def test_changes_are_reported_and_fill_all_is_reachable():
    costs = [9.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    tuner = CreditTuner(epoch_calls=EPOCH)
    changes = 0
    for _ in range(6000):
        before = tuner.credit
        changed = tuner.observe(costs[tuner.index])
        assert changed == (tuner.credit != before)
        changes += changed
    assert tuner.credit == math.inf and changes >= 4


def test_rejects_an_empty_epoch():
    with pytest.raises(ValueError, match="epoch_calls"):
        CreditTuner(epoch_calls=0)
