"""The cache-control step: LRU sequence against a simple reference simulator, and compilability."""

from __future__ import annotations

import random

import pytest
import torch

from hearth.engine.experts.policy.cache import ExpertCacheTables, cache_step
from hearth.engine.kernels.cpu import cpu_decode_ops


class ReferenceLRU:
    """A deliberately plain LRU with the policy's rules: dedupe; fill the q = min(qtable[m], free
    victims) smallest missing ids; victims are the least recently used slots not hit this step,
    empty slots first, ties by slot number."""

    def __init__(self, num_slots: int, qtable: list[int]) -> None:
        self.slots: list[int | None] = [None] * num_slots
        self.last: list[int] = [-1] * num_slots
        self.qtable = qtable
        self.time = 0

    def step(self, ids: list[int]) -> tuple[list[int], list[int], list[tuple[int, int | None]]]:
        unique = sorted(set(ids))
        held = {g: s for s, g in enumerate(self.slots) if g is not None}
        hits = [g for g in unique if g in held]
        misses = [g for g in unique if g not in held]
        hit_slots = {held[g] for g in hits}
        victims = sorted((s for s in range(len(self.slots)) if s not in hit_slots),
                         key=lambda s: (self.last[s], s))
        q = min(self.qtable[min(len(misses), len(self.qtable) - 1)], len(victims))
        events = []
        for g, s in zip(misses[:q], victims[:q], strict=True):
            events.append((g, self.slots[s]))  # (filled id, evicted id or None)
            self.slots[s] = g
            self.last[s] = self.time
        for s in hit_slots:
            self.last[s] = self.time
        self.time += 1
        return hits, misses, events


def routed_trace(steps: int, num_layers: int, experts: int, k: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    trace = []
    for _ in range(steps):
        for layer in range(num_layers):
            # Some locality: a favoured band of experts per layer plus random picks.
            ids = []
            for _ in range(tokens):
                favoured = [rng.randrange(experts // 2) if rng.random() < 0.7 else rng.randrange(experts)
                            for _ in range(k)]
                ids += [layer * experts + e for e in favoured]
            trace.append(ids)
    return trace


def step_impls():
    """The fixed-shape tensor step (what a GPU runs) and the native host-table step."""
    impls = [pytest.param(cache_step, id="tensor-ops")]
    ops = cpu_decode_ops()
    impls.append(pytest.param(ops.cache_step_host if ops else None, id="native",
                              marks=pytest.mark.skipif(ops is None, reason="native kernels unavailable")))
    return impls


@pytest.mark.parametrize("impl", step_impls())
@pytest.mark.parametrize("num_slots", [1, 5, 24, 64])
@pytest.mark.parametrize("qmode", ["all", "table"])
def test_lru_sequence_matches_reference(num_slots, qmode, impl):
    layers, experts, k = 4, 16, 4
    qtable = list(range(experts + 1)) if qmode == "all" else [min(m, max(m - 1, m // 2)) for m in range(experts + 1)]
    tables = ExpertCacheTables(layers * experts, num_slots, torch.tensor(qtable), max_fills=experts)
    ref = ReferenceLRU(num_slots, qtable)
    for ids in routed_trace(30, layers, experts, k, tokens=2, seed=num_slots):
        before = tables.resident()
        plan = tables.step(torch.tensor(ids), step_fn=impl)
        after = tables.resident()
        hits, misses, events = ref.step(ids)
        count = int(plan.count)
        fills = list(zip(plan.src[:count].tolist(), plan.dst[:count].tolist(), strict=True))
        filled = [g for g, _ in fills]
        assert filled == [g for g, _ in events]
        expected_evicted = [old for _, old in events]
        actual_evicted = [next((e for e, s in before.items() if s == slot), None) for _, slot in fills]
        assert actual_evicted == expected_evicted
        assert after == {g: s for s, g in enumerate(ref.slots) if g is not None}
        # Every routed pair is served by its slot when resident, else by the CPU.
        assert plan.pair_slot.tolist() == [after.get(g, -1) for g in ids]
    stats = tables.read_stats()
    assert stats["hits"] + stats["misses"] == sum(len(set(ids)) for ids in routed_trace(30, layers, experts, k, 2,
                                                                                        num_slots))


def test_zero_slot_cache_sends_everything_to_cpu():
    tables = ExpertCacheTables(32, 0, torch.arange(17), max_fills=16)
    plan = tables.step(torch.tensor([3, 3, 5]))
    assert plan.pair_slot.tolist() == [-1, -1, -1] and int(plan.count) == 0
    assert tables.read_stats()["misses"] == 2


def test_qtable_swaps_in_place():
    tables = ExpertCacheTables(32, 4, torch.arange(17), max_fills=16)
    ref = tables.qtable
    tables.set_qtable(torch.zeros(17, dtype=torch.long))
    assert tables.qtable is ref and int(tables.step(torch.tensor([1, 2])).count) == 0


def test_cache_step_compiles_fullgraph():
    compiled = torch.compile(cache_step, fullgraph=True, dynamic=False)
    eager_tables = ExpertCacheTables(64, 6, torch.arange(17), max_fills=16)
    compiled_tables = ExpertCacheTables(64, 6, torch.arange(17), max_fills=16)
    for ids in routed_trace(4, 4, 16, 4, tokens=1, seed=0):
        ids_t = torch.tensor(ids)
        a = eager_tables.step(ids_t)
        b = compiled_tables.step(ids_t, step_fn=compiled)
        assert torch.equal(a.pair_slot, b.pair_slot) and torch.equal(a.src, b.src) and int(a.count) == int(b.count)
    assert torch.equal(eager_tables.slot_of, compiled_tables.slot_of)
    assert torch.equal(eager_tables.last_used, compiled_tables.last_used)
