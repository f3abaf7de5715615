"""Replay routing traces through expert-cache policies at equal capacity and compare miss rates.

A trace becomes a sequence of MoE layer calls: a prompt is prefilled in chunks (one call per layer
per chunk, touching the union of the chunk's experts), and every generated token is one call per
layer. A call's misses are its distinct experts not resident when it starts; every miss is filled
(victims never come from the same call). Miss rates are over decode calls only (prefill still
moves the cache), as in the paper's tables.

Policies: ``global-lru`` (ours), ``per-layer-lru``, ``static-freq`` (hot experts of the first
prefill, fixed: KTransformers-style), ``llama.cpp`` (whole layers resident from the first, the
rest on CPU), ``lrfu`` (recency plus frequency), ``lfu`` and ``min`` (Belady's offline optimum).

    python -m bench.cache_replay bench/out/traces/*.jsonl.gz --capacity 0.11 0.37
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.traces import Trace, load

PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Call:
    """One MoE layer call: its time index, layer, distinct global expert ids, and phase."""

    time: int
    layer: int
    ids: tuple[int, ...]
    decode: bool


def layer_calls(trace: Trace, prefill_chunk: int = PREFILL_CHUNK) -> list[Call]:
    """The trace as the engine would issue it for one request at a time (batch of one)."""
    calls: list[Call] = []
    e = trace.num_experts
    n = 0
    while n < len(trace):
        if trace.decode[n]:
            rows, n = trace.experts[n : n + 1], n + 1
        else:  # a prompt chunk: up to prefill_chunk prompt tokens of the same segment
            end = n
            while (end < len(trace) and end - n < prefill_chunk and not trace.decode[end]
                   and trace.segment[end] == trace.segment[n]):
                end += 1
            rows, n = trace.experts[n:end], end
        decode = len(rows) == 1 and bool(trace.decode[n - 1])
        for layer in range(trace.num_layers):
            ids = tuple(sorted({int(x) + layer * e for x in rows[:, layer].reshape(-1)}))
            calls.append(Call(len(calls), layer, ids, decode))
    return calls


class Policy:
    """A cache of ``capacity`` expert slots. ``access`` returns the call's missed ids. The trace and
    its calls are there for the policies that plan from them (the LRUs need neither)."""

    name = "policy"

    def __init__(self, capacity: int, trace: Trace | None, calls: list[Call]) -> None:
        self.capacity = capacity

    def access(self, call: Call) -> list[int]:
        raise NotImplementedError


class _EvictingPolicy(Policy):
    """Shared miss/fill logic: hits are touched first, then each miss evicts a victim."""

    def __init__(self, capacity: int, trace: Trace | None, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.resident: set[int] = set()

    def access(self, call: Call) -> list[int]:
        misses = self.lookup(call)
        self.admit(misses, call)
        return misses

    def lookup(self, call: Call) -> list[int]:
        """Touch the call's hits; return its misses (nothing is filled yet)."""
        for g in call.ids:
            if g in self.resident:
                self.touch(g, call)
        return [g for g in call.ids if g not in self.resident]

    def admit(self, ids: list[int], call: Call) -> None:
        """Fill ``ids`` (misses of ``call``), evicting victims that ``call`` does not use."""
        current = set(call.ids)
        for g in ids:
            if self.capacity <= 0:
                break
            if len(self.resident) >= self.capacity:
                victim = self.victim(g, current)
                if victim is None:
                    return  # everything resident is in use by this call: computed off-cache
                self.resident.discard(victim)
                self.evicted(victim)
            self.resident.add(g)
            self.touch(g, call)

    def touch(self, g: int, call: Call) -> None:
        raise NotImplementedError

    def evicted(self, g: int) -> None:
        pass

    def victim(self, g: int, current: set[int]) -> int | None:
        raise NotImplementedError


class GlobalLRU(_EvictingPolicy):
    """hearth's policy: one least-recently-used order over all layers' experts."""

    name = "global-lru"

    def __init__(self, capacity: int, trace: Trace | None, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.order: OrderedDict[int, None] = OrderedDict()

    def touch(self, g: int, call: Call) -> None:
        self.order[g] = None
        self.order.move_to_end(g)

    def evicted(self, g: int) -> None:
        del self.order[g]

    def victim(self, g: int, current: set[int]) -> int | None:
        return next((v for v in self.order if v not in current), None)


class PerLayerLRU(Policy):
    """An LRU per layer, each with an equal share of the slots."""

    name = "per-layer-lru"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        share = [capacity // trace.num_layers + (1 if i < capacity % trace.num_layers else 0)
                 for i in range(trace.num_layers)]
        self.layers = [GlobalLRU(c, trace, calls) for c in share]

    def access(self, call: Call) -> list[int]:
        return self.layers[call.layer].access(call)


class _HeapPolicy(_EvictingPolicy):
    """Evicts the resident id with the smallest key; keys live in a heap with lazy deletion."""

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.key: dict[int, tuple] = {}
        self.heap: list[tuple] = []

    def set_key(self, g: int, key: tuple) -> None:
        self.key[g] = key
        heapq.heappush(self.heap, (key, g))

    def victim(self, g: int, current: set[int]) -> int | None:
        skipped, found = [], None
        while self.heap:
            key, v = heapq.heappop(self.heap)
            if v not in self.resident or self.key.get(v) != key:
                continue  # stale entry
            if v in current:
                skipped.append((key, v))
                continue
            found = v
            break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found


class LFU(_HeapPolicy):
    """Least frequently used (counts over the whole history), ties to the least recent."""

    name = "lfu"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.count: Counter[int] = Counter()

    def touch(self, g: int, call: Call) -> None:
        self.count[g] += 1
        self.set_key(g, (self.count[g], call.time))


class LRFU(_HeapPolicy):
    """Recency plus frequency (LRFU): score = sum over past uses of 2^(-decay * age); evict the
    lowest. Ordering by log2(score) + decay * last_use needs no update as time passes."""

    name = "lrfu"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call], decay: float = 0.02) -> None:
        super().__init__(capacity, trace, calls)
        self.decay = decay / trace.num_layers  # per layer call: `decay` per token
        self.score: dict[int, tuple[float, int]] = {}  # g -> (score at last use, last use)

    def touch(self, g: int, call: Call) -> None:
        old, last = self.score.get(g, (0.0, call.time))
        score = 1.0 + old * 2.0 ** (-self.decay * (call.time - last))
        self.score[g] = (score, call.time)
        self.set_key(g, (math.log2(score) + self.decay * call.time,))


class BeladyMIN(_HeapPolicy):
    """The offline optimum: evict the resident id whose next use is furthest in the future."""

    name = "min"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.next_use: dict[tuple[int, int], int] = {}  # (call time, id) -> next call time using id
        upcoming: dict[int, int] = {}
        for call in reversed(calls):
            for g in call.ids:
                self.next_use[(call.time, g)] = upcoming.get(g, 1 << 60)
                upcoming[g] = call.time

    def touch(self, g: int, call: Call) -> None:
        self.set_key(g, (-self.next_use[(call.time, g)],))


class StaticFrequency(Policy):
    """KTransformers-style hot experts: the ``capacity`` most used in the first prompt stay resident."""

    name = "static-freq"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        first = (trace.segment == trace.segment[0]) & ~trace.decode
        rows = trace.experts[first] if first.any() else trace.experts
        counts: Counter[int] = Counter()
        for layer in range(trace.num_layers):
            counts.update((rows[:, layer].reshape(-1).astype(np.int64) + layer * trace.num_experts).tolist())
        self.resident = {g for g, _ in counts.most_common(capacity)}

    def access(self, call: Call) -> list[int]:
        return [g for g in call.ids if g not in self.resident]


class LlamaCppLayers(Policy):
    """llama.cpp's granularity: a layer's experts are one tensor, so whole layers are resident
    (from the first layer on) and the rest run on the CPU; slots left over are unused."""

    name = "llama.cpp"

    def __init__(self, capacity: int, trace: Trace, calls: list[Call]) -> None:
        super().__init__(capacity, trace, calls)
        self.resident_layers = capacity // trace.num_experts

    def access(self, call: Call) -> list[int]:
        return [] if call.layer < self.resident_layers else list(call.ids)


POLICIES: dict[str, Callable[..., Policy]] = {p.name: p for p in (
    GlobalLRU, PerLayerLRU, StaticFrequency, LlamaCppLayers, LRFU, LFU, BeladyMIN)}


def miss_rate(policy: Policy, calls: list[Call]) -> float:
    """Decode misses / decode accesses (distinct experts per call)."""
    misses = accesses = 0
    for call in calls:
        missed = policy.access(call)
        if call.decode:
            misses += len(missed)
            accesses += len(call.ids)
    return misses / max(accesses, 1)


def replay(trace: Trace, fractions: list[float], policies: list[str] | None = None) -> list[dict]:
    """Miss rate of every policy at every capacity (a fraction of all experts), with the ratio to MIN."""
    calls = layer_calls(trace)
    total = trace.num_layers * trace.num_experts
    rows = []
    for frac in fractions:
        capacity = max(1, round(frac * total))
        rates = {name: miss_rate(POLICIES[name](capacity, trace, calls), calls)
                 for name in (policies or list(POLICIES))}
        best = rates.get("min") or miss_rate(BeladyMIN(capacity, trace, calls), calls)
        for name, rate in rates.items():
            rows.append({"trace": trace.name, "capacity": frac, "slots": capacity, "policy": name,
                         "miss_rate": round(rate, 4), "vs_min": round(rate / best, 3) if best else None})
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per capacity: traces as rows, policies as columns (miss rate, ratio to MIN)."""
    out = []
    for frac in sorted({r["capacity"] for r in rows}):
        sub = [r for r in rows if r["capacity"] == frac]
        names = list(dict.fromkeys(r["policy"] for r in sub))
        out += [f"**Capacity {frac:.0%} of all experts** (decode miss rate; × MIN in brackets)", "",
                "| trace | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for trace in dict.fromkeys(r["trace"] for r in sub):
            cells = {r["policy"]: r for r in sub if r["trace"] == trace}
            out.append(f"| {trace} | " + " | ".join(
                f"{cells[n]['miss_rate']:.1%} ({cells[n]['vs_min']:.2f})" if cells[n]["vs_min"] else
                f"{cells[n]['miss_rate']:.1%}" for n in names) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--capacity", type=float, nargs="+", default=[0.11, 0.37])
    p.add_argument("--policy", nargs="+", choices=list(POLICIES))
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    rows = [r for path in args.traces for r in replay(load(path), args.capacity, args.policy)]
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
