"""Recurrent-state checkpoints of hybrid models, hung on the prefix tree, under a byte budget.

A hybrid model's linear-attention state after a prefix cannot be rebuilt from KV pages: a request
may skip computing a cached prefix only up to a position where a copy of that state was kept. Copies
are taken at whole-block positions (so the KV of everything before them is in tree blocks) chosen
by a policy:

- ``prompt-end``: where each prompt ends (rounded down to a block), what a plain prefix cache keeps;
- ``periodic``: every ``interval`` tokens;
- ``anchors``: around semantic anchors (:mod:`engine.anchors`: message, thinking and tool
  boundaries, which agent edits keep) plus the periodic ones as a fallback.

A checkpoint lives on the tree node whose edge ends at its position, and dies with that node when
the tree evicts it. Over the budget, checkpoints are evicted periodic ones first, then anchors, the
least recently used (created or restored) first within each kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from engine.prefix_cache import RadixNode
from engine.state_pool import StateSnapshot

POLICIES = ("none", "prompt-end", "periodic", "anchors")


@dataclass(eq=False)
class StateCheckpoint:
    """The recurrent state after the first ``position`` tokens of a prefix."""

    position: int
    state: StateSnapshot
    nbytes: int
    anchor: bool
    last_use: int
    node: RadixNode | None = None


def checkpoint_positions(
    tokens: list[int], start: int, end: int, num_prompt: int, block_size: int, policy: str, interval: int,
    anchors: frozenset[int],
) -> dict[int, bool]:
    """Positions in ``(start, end]`` to checkpoint while computing ``tokens[start:end]``, each
    mapped to whether it is an anchor. Every position is a multiple of ``block_size``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown checkpoint policy '{policy}' (one of {', '.join(POLICIES)})")
    found: dict[int, bool] = {}
    if policy == "prompt-end":
        p = num_prompt // block_size * block_size
        if start < p <= end:
            found[p] = False
    if policy in ("periodic", "anchors"):
        first = (start // interval + 1) * interval
        found.update(dict.fromkeys(range(first, end + 1, interval), False))
    if policy == "anchors":
        for i in range(start, end):
            if tokens[i] in anchors:
                for p in (i // block_size * block_size, (i + 1) // block_size * block_size):
                    if start < p <= end:
                        found[p] = True
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

    def __len__(self) -> int:
        return len(self._live)

    def add(self, node: RadixNode, position: int, state: StateSnapshot, anchor: bool) -> StateCheckpoint | None:
        """Keep ``state`` as the checkpoint at the end of ``node`` (``position`` tokens deep). An
        existing checkpoint there is kept (and becomes an anchor if this one is). Returns the
        checkpoint, or None when it does not fit the budget at all."""
        existing: StateCheckpoint | None = node.checkpoint
        if existing is not None:
            existing.anchor |= anchor
            existing.last_use = next(self._clock)
            return existing
        nbytes = state.nbytes
        if nbytes > self.budget_bytes:
            return None
        ckpt = StateCheckpoint(position, state, nbytes, anchor, next(self._clock), node)
        node.checkpoint = ckpt
        self._live.add(ckpt)
        self.used_bytes += nbytes
        self._evict_to_budget(keep=ckpt)
        return ckpt

    def deepest(self, node: RadixNode, limit: int) -> StateCheckpoint | None:
        """The deepest checkpoint at or above ``node`` whose position is at most ``limit``;
        touched for LRU."""
        while node is not None:
            ckpt: StateCheckpoint | None = node.checkpoint
            if ckpt is not None and ckpt.position <= limit:
                ckpt.last_use = next(self._clock)
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

    def _evict_to_budget(self, keep: StateCheckpoint) -> None:
        while self.used_bytes > self.budget_bytes:
            victim = min((c for c in self._live if c is not keep), key=lambda c: (c.anchor, c.last_use))
            self._drop(victim)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        anchors = sum(c.anchor for c in self._live)
        return {"checkpoints": len(self._live), "checkpoint_anchors": anchors, "checkpoint_bytes": self.used_bytes,
                "checkpoint_budget_bytes": self.budget_bytes, "checkpoint_evictions": self.evictions}
