"""Prefill at the link's limit: whole MoE layers streamed through two buffers (docs/design.md, prefill).

A long prefill chunk routes its tokens to nearly every expert of every layer, so it reads the
whole expert pool. Instead of missing expert by expert, :class:`LayerStreamer` borrows two
whole-layer buffers (``2 × E`` slots) from the cache's slot pool and copies all experts of the
next MoE layer into one buffer while the current layer computes from the other; they swap. A
buffer is refilled as soon as the compute that read it is queued (layer l done: layer l + 2 starts
copying behind l + 1), so copies start long before their layer's router runs and the link never
idles; the last layers of a chunk prefetch the first layers of the next chunk. Experts already in the
cache are used where they are and do not cross the link again. Every routed pair is computed on the
device from slots with the plain backend's fp32 arithmetic, so results equal the plain engine's.

Whether a step streams is decided per engine step from its token count: below
:func:`stream_min_tokens` (from measured costs) a small prefill takes the decode path, where only
missed experts move. When the slot pool cannot hold the buffers, the decode path serves every
step (on-demand loading of just the routed experts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hearth.engine.experts.mechanism.device import CopyHandle
from hearth.engine.experts.policy.cache import ExpertCacheTables
from hearth.engine.experts.pool import ExpertPool


@dataclass
class PrefillStats:
    """Cumulative timings of streamed layers, per MoE layer rank (seconds, bytes)."""

    num_layers: int
    layer_calls: list[int] = field(default_factory=list)
    copy_seconds: list[float] = field(default_factory=list)  # how long each layer's copy ran
    wait_seconds: list[float] = field(default_factory=list)  # compute waiting for the copy: the exposed part
    compute_seconds: list[float] = field(default_factory=list)
    copy_bytes: int = 0
    in_place: int = 0  # experts used where they already were in the cache
    streamed_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("layer_calls", "copy_seconds", "wait_seconds", "compute_seconds"):
            if not getattr(self, name):
                setattr(self, name, [0 if name == "layer_calls" else 0.0] * self.num_layers)

    def hidden_share(self) -> float:
        """Share of the copy time hidden behind compute (1.0: the link never stalled the layers)."""
        copy = sum(self.copy_seconds)
        return 1.0 - min(sum(self.wait_seconds) / copy, 1.0) if copy > 0 else 1.0

    def summary(self) -> dict[str, float]:
        return {"prefill_streamed_steps": self.streamed_steps, "prefill_layer_calls": sum(self.layer_calls),
                "prefill_copy_seconds": sum(self.copy_seconds), "prefill_wait_seconds": sum(self.wait_seconds),
                "prefill_compute_seconds": sum(self.compute_seconds), "prefill_copy_bytes": self.copy_bytes,
                "prefill_in_place": self.in_place, "prefill_hidden_share": self.hidden_share()}

    def per_layer(self) -> list[dict[str, float]]:
        return [{"layer": r, "calls": self.layer_calls[r], "copy_seconds": self.copy_seconds[r],
                 "wait_seconds": self.wait_seconds[r], "compute_seconds": self.compute_seconds[r]}
                for r in range(self.num_layers)]


class LayerStreamer:
    """Streams whole MoE layers through ``buffers`` (2, or 1 for the ablation) whole-layer buffers
    borrowed from the cache's slots. Drive it with :meth:`begin` per streamed step, :meth:`forward`
    per MoE layer call and :meth:`release` when a step does not stream."""

    def __init__(self, pool: ExpertPool, device, tables: ExpertCacheTables, buffers: int = 2,
                 stats: PrefillStats | None = None) -> None:
        """``stats``: counters to continue (a streamer set up again after the cache was resized)."""
        if buffers not in (1, 2):
            raise ValueError("buffers must be 1 or 2")
        self.pool, self.device, self.tables = pool, device, tables
        self.buffers = buffers
        self.num_experts = pool.num_experts
        self.num_layers = len(pool.moe_layer_ids)
        self._rank_of_layer = {layer: r for r, layer in enumerate(pool.moe_layer_ids)}
        self.stats = stats if stats is not None else PrefillStats(self.num_layers)
        self._slots: torch.Tensor | None = None  # [buffers * E] borrowed slots, None when not reserved
        # rank -> (slot map [E], copy handle, buffer, experts copied) of layers whose copy has started
        self._pending: dict[int, tuple[torch.Tensor, CopyHandle, int, list[int]]] = {}
        self._holds: dict[int, tuple[int, list[int]]] = {}  # buffer -> (rank, expert ids copied into it)
        self._more_after = False

    @staticmethod
    def fits(pool: ExpertPool, num_slots: int, buffers: int = 2) -> bool:
        return num_slots >= buffers * pool.num_experts

    @property
    def active(self) -> bool:
        return self._slots is not None

    def begin(self, more_prefill_after: bool) -> None:
        """Start a streamed step: borrow the buffers if needed and make sure the first MoE layers'
        copies are under way. ``more_prefill_after``: the next step will stream too, so the last
        layers prefetch the next step's first ones."""
        if self._slots is None:
            self._reserve()
        self._more_after = more_prefill_after
        self.stats.streamed_steps += 1
        for rank in range(min(self.buffers, self.num_layers)):
            if rank not in self._pending:
                self._start(rank)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, act,
                blocks=None) -> torch.Tensor:
        """One MoE layer of a streamed step: every routed pair computed on the device (fp32 sum)."""
        layer = int(expert_ids.reshape(-1)[0]) // self.num_experts
        rank = self._rank_of_layer[layer]
        if rank not in self._pending:
            self._start(rank)
        slot_map, handle, buffer, copied = self._pending.pop(rank)
        waited = handle.wait()
        self.stats.wait_seconds[rank] += waited
        self.stats.copy_seconds[rank] += handle.copy_seconds
        self._holds[buffer] = (rank, copied)
        t0 = time.perf_counter()
        local = expert_ids - (self.pool.moe_layer_ids[rank] * self.num_experts)
        pair_slot = slot_map[local.to(slot_map.device)]  # [T, k] slots: buffer or in place
        out = self.device.compute(x, pair_slot, weights, act, blocks)
        self.stats.compute_seconds[rank] += time.perf_counter() - t0
        self.stats.layer_calls[rank] += 1
        if self.buffers == 2:
            # This layer's buffer is free once its compute is queued: the layer after the next one
            # starts copying now, behind the next one's copy, so the link never idles.
            self._prefetch_after(rank)
        return out

    def _prefetch_after(self, rank: int) -> None:
        upcoming = list(range(rank + 1, self.num_layers))
        if self._more_after:
            upcoming += list(range(0, rank + 1))  # the next step's first layers
        for r in upcoming[: self.buffers]:
            if r not in self._pending:
                if self._free_buffer() is None:
                    return
                self._start(r)

    def _free_buffer(self) -> int | None:
        busy = {buffer for _, _, buffer, _ in self._pending.values()}
        return next((b for b in range(self.buffers) if b not in busy), None)

    def release(self) -> None:
        """Give the buffers back to the cache. The experts the last layers copied stay in their
        slots as cached entries; prefetched copies not yet used are waited for and dropped."""
        if self._slots is None:
            return
        for _, handle, buffer, _ in self._pending.values():
            handle.wait()
            self._holds.pop(buffer, None)
        self._pending.clear()
        t = self.tables
        for buffer, (rank, copied) in self._holds.items():
            if not copied:
                continue
            base = self.pool.moe_layer_ids[rank] * self.num_experts
            experts = torch.tensor(copied, dtype=torch.long, device=t.slot_of.device)
            slots = self._slots[buffer * self.num_experts + experts]
            t.slot_of[base + experts] = slots
            t.expert_of[slots] = base + experts
            t.last_used[slots] = t.clock.expand(len(copied))
        if self._holds:
            t.clock.add_(1)
        self._holds.clear()
        self._slots = None

    def _reserve(self) -> None:
        """Borrow the least recently used ``buffers × E`` slots, evicting what they hold."""
        t = self.tables
        need = self.buffers * self.num_experts
        order = torch.argsort(t.last_used[: t.num_slots], stable=True)[:need]  # empties (-1) first
        old = t.expert_of[order]
        evicted = old[old >= 0]
        t.slot_of[evicted] = -1
        t.expert_of[order] = -1
        t.last_used[order] = -1
        self._slots = order.to(torch.long)
        self._holds.clear()

    def _start(self, rank: int) -> None:
        """Plan layer ``rank``'s slot map and start copying its non-resident experts into a free
        buffer (when none is free, in an unexpected layer order, the prefetches are dropped)."""
        buffer = self._free_buffer()
        if buffer is None:
            for _, handle, _, _ in self._pending.values():
                handle.wait()
            self._pending.clear()
            buffer = 0
        self._holds.pop(buffer, None)  # being overwritten
        base = self.pool.moe_layer_ids[rank] * self.num_experts
        experts = torch.arange(self.num_experts, device=self.tables.slot_of.device)
        current = self.tables.slot_of[base + experts]
        buffer_slots = self._slots[buffer * self.num_experts:(buffer + 1) * self.num_experts].to(current.device)
        in_place = current >= 0
        slot_map = torch.where(in_place, current, buffer_slots)
        copied = experts[~in_place].tolist()
        if in_place.any():
            self.tables.last_used[current[in_place]] = int(self.tables.clock[0])
        self.stats.in_place += int(in_place.sum())
        rows = self.pool.row_table[[base + e for e in copied]].tolist() if copied else []
        handle = self.device.copy_async(rows, buffer_slots[copied].tolist() if copied else [])
        self.stats.copy_bytes += handle.nbytes
        self._pending[rank] = (slot_map, handle, buffer, copied)
