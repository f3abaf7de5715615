"""Recurrent-state checkpoints of hybrid models, hung on the prefix tree, under a byte budget.

A hybrid model's linear-attention state after a prefix cannot be rebuilt from KV pages: a request
may skip computing a cached prefix only up to a position where a copy of that state was kept. Copies
are taken at whole-block positions (so the KV of everything before them is in tree blocks) chosen
by a policy:

- ``prompt-end``: where each prompt ends (rounded down to a block), what a plain prefix cache keeps;
- ``periodic``: every ``interval`` tokens;
- ``anchors``: around semantic anchors (:mod:`hearth.engine.cache.anchors`: message, thinking and tool
  boundaries, which agent edits keep) plus the periodic ones as a fallback.

A checkpoint lives on the tree node whose edge ends at its position, and dies with that node when
the tree evicts it. Over the budget, the store evicts the checkpoint least likely to be restored:
periodic ones before anchors, and among anchors those whose *kind* (the anchor token and the side
of it) has the lowest survival rate so far — restores as the deepest usable checkpoint over
checkpoints created — least recently used first. Which boundaries a client's edits respect is
thus learnt from the traffic, not assumed: OpenClaw-style edits make "before a thinking block"
anchors survive, OpenCode-style ones "inside a tool result".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from hearth.engine.cache.prefix_tree import RadixNode
from hearth.engine.cache.state_slots import StateSnapshot

POLICIES = ("none", "prompt-end", "periodic", "anchors")


@dataclass(eq=False)
class StateCheckpoint:
    """The recurrent state after the first ``position`` tokens of a prefix."""

    position: int
    state: StateSnapshot
    nbytes: int
    kinds: frozenset[str]  # anchor kinds ("<token id>:before" / "<token id>:after"); empty: periodic
    last_use: int
    node: RadixNode | None = None

    @property
    def anchor(self) -> bool:
        return bool(self.kinds)


def checkpoint_positions(
    tokens: list[int], start: int, end: int, num_prompt: int, block_size: int, policy: str, interval: int,
    anchors: frozenset[int],
) -> dict[int, frozenset[str]]:
    """Positions in ``(start, end]`` to checkpoint while computing ``tokens[start:end]``, each
    mapped to its anchor kinds (empty for a periodic or prompt-end one). Every position is a
    multiple of ``block_size``: an anchor's is rounded down to its block."""
    if policy not in POLICIES:
        raise ValueError(f"unknown checkpoint policy '{policy}' (one of {', '.join(POLICIES)})")
    found: dict[int, frozenset[str]] = {}
    if policy == "prompt-end":
        p = num_prompt // block_size * block_size
        if start < p <= end:
            found[p] = frozenset()
    if policy in ("periodic", "anchors"):
        first = (start // interval + 1) * interval
        found.update(dict.fromkeys(range(first, end + 1, interval), frozenset()))
    if policy == "anchors":
        for i in range(start, end):
            if tokens[i] in anchors:
                for p, side in ((i, "before"), (i + 1, "after")):
                    p = p // block_size * block_size
                    if start < p <= end:
                        found[p] = found.get(p, frozenset()) | {f"{tokens[i]}:{side}"}
    return found


class CheckpointStore:
    """Checkpoints attached to radix nodes (one per node end), within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("checkpoint budget must be >= 0")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._live: set[StateCheckpoint] = set()
        self._clock = itertools.count(1)
        self.evictions = 0
        self.restores = 0
        self._created: dict[str, int] = {}  # anchor kind -> checkpoints of that kind created
        self._restored: dict[str, int] = {}  # anchor kind -> restores of a checkpoint of that kind

    @property
    def count(self) -> int:
        """Checkpoints held (a property, not ``len``: an empty store must not read as no store)."""
        return len(self._live)

    def add(self, node: RadixNode, position: int, state: StateSnapshot,
            kinds: frozenset[str] = frozenset()) -> StateCheckpoint | None:
        """Keep ``state`` as the checkpoint at the end of ``node`` (``position`` tokens deep), of
        the given anchor ``kinds`` (none: periodic). An existing checkpoint there is kept (and
        gains the kinds). Returns the checkpoint, or None when it does not fit the budget at all."""
        new_kinds = kinds
        existing: StateCheckpoint | None = node.checkpoint
        if existing is not None:
            new_kinds = kinds - existing.kinds
            existing.kinds |= kinds
            existing.last_use = next(self._clock)
        elif state.nbytes > self.budget_bytes:
            return None
        for kind in new_kinds:
            self._created[kind] = self._created.get(kind, 0) + 1
        if existing is not None:
            return existing
        ckpt = StateCheckpoint(position, state, state.nbytes, kinds, next(self._clock), node)
        node.checkpoint = ckpt
        self._live.add(ckpt)
        self.used_bytes += ckpt.nbytes
        self._evict_to_budget(keep=ckpt)
        return ckpt

    def deepest(self, node: RadixNode, limit: int) -> StateCheckpoint | None:
        """The deepest checkpoint at or above ``node`` whose position is at most ``limit``;
        touched for LRU."""
        while node is not None:
            ckpt: StateCheckpoint | None = node.checkpoint
            if ckpt is not None and ckpt.position <= limit:
                ckpt.last_use = next(self._clock)
                self.restores += 1
                for kind in ckpt.kinds:
                    self._restored[kind] = self._restored.get(kind, 0) + 1
                return ckpt
            node = node.parent
        return None

    def node_evicted(self, node: RadixNode) -> None:
        """The tree dropped ``node``: its checkpoint goes too."""
        if node.checkpoint is not None:
            self._drop(node.checkpoint)

    def checkpoints(self) -> Iterable[StateCheckpoint]:
        return iter(self._live)

    def _drop(self, ckpt: StateCheckpoint) -> None:
        self._live.discard(ckpt)
        self.used_bytes -= ckpt.nbytes
        if ckpt.node is not None and ckpt.node.checkpoint is ckpt:
            ckpt.node.checkpoint = None
        ckpt.node = None

    def survival(self, ckpt: StateCheckpoint) -> float:
        """How likely ``ckpt`` is to be restored, from its kinds' record: the best kind's
        (restores + 1) / (created + 2); -1 for a periodic checkpoint."""
        return self._kinds_survival(ckpt.kinds)

    def _kinds_survival(self, kinds: frozenset[str]) -> float:
        if not kinds:
            return -1.0
        return max((self._restored.get(k, 0) + 1) / (self._created.get(k, 0) + 2) for k in kinds)

    def worth_taking(self, positions: dict[int, frozenset[str]], nbytes: int) -> dict[int, frozenset[str]]:
        """The planned checkpoints (position -> kinds) that would outlive the eviction their own
        arrival causes: with the budget full, one rated below every kept checkpoint would be
        dropped at once, so its snapshot (a copy of the whole state) is not worth taking."""
        if nbytes > self.budget_bytes:
            return {}
        if self.used_bytes + nbytes <= self.budget_bytes or not self._live:
            return positions
        floor = min(self.survival(c) for c in self._live)
        return {p: kinds for p, kinds in positions.items() if self._kinds_survival(kinds) >= floor}

    def _evict_to_budget(self, keep: StateCheckpoint) -> None:
        while self.used_bytes > self.budget_bytes:
            victim = min((c for c in self._live if c is not keep), key=lambda c: (self.survival(c), c.last_use))
            self._drop(victim)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        anchors = sum(c.anchor for c in self._live)
        return {"checkpoints": self.count, "checkpoint_anchors": anchors, "checkpoint_bytes": self.used_bytes,
                "checkpoint_budget_bytes": self.budget_bytes, "checkpoint_evictions": self.evictions,
                "checkpoint_restores": self.restores}
