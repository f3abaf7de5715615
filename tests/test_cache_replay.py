"""Cache-policy replay: each policy against a plain reference or a property, MIN against search."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from bench.cache_replay import POLICIES, Call, layer_calls, miss_rate, replay
from bench.traces import Trace, synthetic


def _decode_trace(rows: list[list[int]], num_experts: int) -> Trace:
    """One layer, top-1, every token a decode step."""
    experts = np.array(rows, dtype=np.int16).reshape(len(rows), 1, -1)
    return Trace("t", num_experts, experts, np.ones(len(rows), dtype=bool), np.zeros(len(rows), dtype=np.int32))


def _reference_lru(calls: list[Call], capacity: int) -> float:
    """A list-based LRU: most recent at the end, victims from the front (never the current call)."""
    cache: list[int] = []
    misses = accesses = 0
    for call in calls:
        for g in call.ids:
            if g in cache:
                cache.remove(g)
                cache.append(g)
        for g in call.ids:
            if g in cache:
                continue
            if call.decode:
                misses += 1
            if len(cache) >= capacity:
                victim = next((v for v in cache if v not in call.ids), None)
                if victim is None:
                    continue  # the call alone overflows the cache: computed off-cache
                cache.remove(victim)
            cache.append(g)
        accesses += len(call.ids) if call.decode else 0
    return misses / accesses


def _optimal_misses(seq: list[int], capacity: int) -> int:
    """Fewest misses of any eviction choice (exhaustive search; tiny inputs only)."""

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        g = seq[i]
        if g in cache:
            return best(i + 1, cache)
        if len(cache) < capacity:
            return 1 + best(i + 1, cache | {g})
        return 1 + min(best(i + 1, (cache - {v}) | {g}) for v in cache)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(4))
def test_global_lru_matches_reference(seed):
    trace = synthetic(3, 8, 2, 120, 0.5, prompt=20, seed=seed)
    calls = layer_calls(trace)
    for capacity in (3, 5, 11):
        ours = miss_rate(POLICIES["global-lru"](capacity, trace, calls), calls)
        assert ours == pytest.approx(_reference_lru(calls, capacity))


@pytest.mark.parametrize("seed", range(6))
def test_belady_min_is_optimal(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(14)]
    trace = _decode_trace([[g] for g in seq], 5)
    calls = layer_calls(trace)
    for capacity in (2, 3):
        rate = miss_rate(POLICIES["min"](capacity, trace, calls), calls)
        assert round(rate * len(seq)) == _optimal_misses(seq, capacity)


@pytest.mark.parametrize("locality", [0.1, 0.7])
def test_min_is_a_lower_bound_for_every_policy(locality):
    trace = synthetic(4, 16, 2, 300, locality, prompt=50, seed=3)
    rows = replay(trace, [0.2, 0.5])
    for frac in (0.2, 0.5):
        rates = {r["policy"]: r["miss_rate"] for r in rows if r["capacity"] == frac}
        assert set(rates) == set(POLICIES)
        assert all(rate >= rates["min"] for rate in rates.values())


def test_full_capacity_has_no_decode_misses_after_prefill():
    trace = synthetic(3, 8, 2, 200, 0.0, prompt=100, seed=1)  # the prompt touches every expert
    calls = layer_calls(trace)
    for name in ("global-lru", "per-layer-lru", "lfu", "lrfu", "min", "static-freq", "llama.cpp"):
        assert miss_rate(POLICIES[name](24, trace, calls), calls) == 0.0, name


def test_static_frequency_keeps_the_prefill_hot_set():
    prefill = [[0], [0], [1], [0], [1], [2]]
    decode = [[0], [1], [2], [3]]
    trace = _decode_trace(prefill + decode, 4)
    trace.decode[: len(prefill)] = False
    calls = layer_calls(trace)
    assert miss_rate(POLICIES["static-freq"](2, trace, calls), calls) == pytest.approx(2 / 4)  # 2 and 3 miss


def test_llama_cpp_layers_are_whole():
    trace = synthetic(4, 8, 2, 100, 0.5, prompt=10, seed=0)
    calls = layer_calls(trace)
    policy = POLICIES["llama.cpp"](8 * 2 + 5, trace, calls)  # two whole layers; 5 slots unusable
    for call in calls:
        assert (policy.access(call) == []) == (call.layer < 2)


def test_per_layer_lru_splits_capacity():
    trace = synthetic(4, 8, 2, 50, 0.5, seed=0)
    policy = POLICIES["per-layer-lru"](10, trace, layer_calls(trace))
    assert [p.capacity for p in policy.layers] == [3, 3, 2, 2]


def test_layer_calls_chunk_prompts_and_step_decodes():
    trace = synthetic(2, 8, 2, 700, 0.5, prompt=600, seed=0)
    calls = layer_calls(trace, prefill_chunk=512)
    prefill = [c for c in calls if not c.decode]
    assert len(prefill) == 2 * 2  # chunks of 512 and 88 tokens, two layers each
    assert len(calls) - len(prefill) == 100 * 2
    assert all(len(c.ids) <= 2 for c in calls if c.decode)
    assert [c.time for c in calls] == list(range(len(calls)))
