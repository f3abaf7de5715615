"""The device expert cache: one LRU slot pool shared by every MoE layer, controlled on the device.

Tables (device tensors, each with one trailing *dummy* entry that masked scatters write to, so the
step never needs a data-dependent shape):

- ``slot_of[g]``       slot holding global expert id g, -1 when absent          [G + 1]
- ``expert_of[s]``     global id held by slot s, -1 when empty                   [S + 1]
- ``last_used[s]``     logical time of the step that last used slot s            [S + 1]

:func:`cache_step` runs one routing decision: dedupe, classify hits and misses, read
``q = qtable[m]``, pick the q least-recently-used slots not hit in this step (one top-K pass), and
update the tables. It uses fixed-shape tensor operations with valid counts only — no ``.item()``,
``.tolist()`` or ``nonzero`` — so it compiles with ``torch.compile(fullgraph=True)`` and can be
captured in a CUDA graph. The copies it plans are carried out by the device (``mechanism/device.py``).
"""

from __future__ import annotations

import torch

from hearth.engine.experts.contract import FillPlan
from hearth.engine.kernels.cpu import cpu_decode_ops

# Stats counters kept on the device (read only when asked for).
STAT_NAMES = ("steps", "hits", "misses", "fills", "cpu", "evictions")
_NEVER = torch.iinfo(torch.int64).max


def cache_step(
    ids: torch.Tensor,  # [N] int64 global ids routed in this step (duplicates allowed)
    slot_of: torch.Tensor,  # [G + 1]
    expert_of: torch.Tensor,  # [S + 1]
    last_used: torch.Tensor,  # [S + 1]
    clock: torch.Tensor,  # [1] logical time
    qtable: torch.Tensor,  # [m_max + 1]
    stats: torch.Tensor,  # [len(STAT_NAMES)]
    num_candidates: int,  # K: the most fills one step can make, <= S
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cache-control step, in place on the tables; returns (pair_slot, src, dst, count)."""
    n = ids.shape[0]
    g_dummy, s_dummy = slot_of.shape[0] - 1, expert_of.shape[0] - 1
    num_slots = s_dummy
    sorted_ids = torch.sort(ids).values
    first = torch.ones(n, dtype=torch.bool, device=ids.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    cur = slot_of[sorted_ids]
    hit = first & (cur >= 0)
    miss = first & (cur < 0)
    num_hits, m = hit.sum(), miss.sum()
    q_want = qtable.gather(0, m.clamp(max=qtable.shape[0] - 1).view(1))[0]  # a tensor index: no host read
    # Victims: least recently used slots that this step does not hit; ties (e.g. empty slots) by slot.
    hit_slot = torch.where(hit, cur, s_dummy)
    was_hit = torch.zeros(num_slots + 1, dtype=torch.bool, device=ids.device).scatter(0, hit_slot, True)
    slot_index = torch.arange(num_slots, device=ids.device)
    key = torch.where(was_hit[:num_slots], _NEVER, last_used[:num_slots] * num_slots + slot_index)
    candidates = torch.topk(key, num_candidates, largest=False, sorted=True).indices  # [K]
    # Bounded by Python ints (scalar operands): a tensor made from a host value would be a host->device
    # copy, which a CUDA graph capture of this step forbids.
    q = torch.minimum(q_want, num_slots - num_hits).clamp(max=num_candidates)
    rank = torch.cumsum(miss.long(), 0) - 1
    fill = miss & (rank < q)
    dst_slot = torch.where(fill, candidates[rank.clamp(0, num_candidates - 1)], s_dummy)
    # Evict what the chosen slots held, then install the fills.
    old = expert_of[dst_slot]
    evict = fill & (old >= 0)
    slot_of.scatter_(0, torch.where(evict, old, g_dummy), torch.full_like(old, -1))
    slot_of.scatter_(0, torch.where(fill, sorted_ids, g_dummy), dst_slot)
    # Masked writes land in the dummy entries: reset them with device fills (``t[i] = -1`` would make a
    # tensor of the host value first).
    slot_of[g_dummy:].fill_(-1)
    expert_of.scatter_(0, dst_slot, sorted_ids)
    expert_of[s_dummy:].fill_(-1)
    now = clock.expand(n)
    last_used.scatter_(0, hit_slot, now)
    last_used.scatter_(0, dst_slot, now)
    last_used[s_dummy:].fill_(-1)
    clock.add_(1)
    # The fill plan, compacted to its first q entries.
    plan_pos = torch.where(fill, rank, num_candidates)
    src = torch.full((num_candidates + 1,), -1, dtype=torch.long, device=ids.device)
    src.scatter_(0, plan_pos, sorted_ids)
    dst = torch.full((num_candidates + 1,), -1, dtype=torch.long, device=ids.device)
    dst.scatter_(0, plan_pos, dst_slot)
    stats.add_(torch.stack([torch.ones_like(m), num_hits, m, q, m - q, evict.sum()]))
    pair_slot = slot_of[ids]
    return pair_slot, src[:num_candidates], dst[:num_candidates], q


def plan_resize(expert_of: torch.Tensor, last_used: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which cached experts a cache resized to ``num_slots`` slots keeps, and where they go.

    ``expert_of`` and ``last_used`` [S] are the current tables without their dummy entries. The
    ``num_slots`` most recently used residents are kept (all of them when they fit); returns their
    (old slots, new slots), both [n] and ascending. New slot i <= old slot i, so the weights can be
    compacted in place, front to back. Dropping the others loses nothing: the host pool holds every
    expert."""
    resident = torch.nonzero(expert_of >= 0).flatten()  # [R] slots, ascending
    if resident.numel() > num_slots:
        newest = torch.argsort(last_used[resident], descending=True, stable=True)[:num_slots]
        resident = torch.sort(resident[newest]).values
    return resident, torch.arange(resident.numel(), dtype=torch.long, device=expert_of.device)


class ExpertCacheTables:
    """The device tables of a cache with ``num_slots`` slots over ``num_global_ids`` expert ids."""

    def __init__(self, num_global_ids: int, num_slots: int, qtable: torch.Tensor, max_fills: int,
                 device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.slot_of = torch.full((num_global_ids + 1,), -1, dtype=torch.long, device=device)
        self.expert_of = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        self.last_used = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        self.clock = torch.zeros(1, dtype=torch.long, device=device)
        self.stats = torch.zeros(len(STAT_NAMES), dtype=torch.long, device=device)
        self.qtable = qtable.to(device)
        self.max_fills = max_fills
        self.num_candidates = min(max_fills, num_slots)
        # The control step's implementation when not the default (e.g. cache_step compiled, or a
        # captured graph's): called like cache_step.
        self.step_fn = None

    def set_qtable(self, qtable: torch.Tensor) -> None:
        """Replace the table in place (a captured graph keeps reading the same tensor)."""
        if qtable.shape != self.qtable.shape:
            raise ValueError(f"qtable must have shape {tuple(self.qtable.shape)}")
        self.qtable.copy_(qtable)

    def step(self, ids: torch.Tensor, step_fn=None) -> FillPlan:
        """Run the control step for the routed global ids ``ids`` [N]. Host-memory tables use the
        native version of the same step when it is built (one call instead of ~50 small ops)."""
        if self.num_slots == 0 or self.num_candidates == 0:
            return self._step_without_slots(ids)
        step_fn = step_fn or self.step_fn
        if step_fn is None:
            ops = cpu_decode_ops() if self.device.type == "cpu" else None
            step_fn = ops.cache_step_host if ops is not None else cache_step
        pair_slot, src, dst, count = step_fn(
            ids, self.slot_of, self.expert_of, self.last_used, self.clock, self.qtable, self.stats,
            self.num_candidates,
        )
        return FillPlan(pair_slot, src, dst, count)

    def _step_without_slots(self, ids: torch.Tensor) -> FillPlan:
        """Every routed id a miss computed elsewhere; counted with tensor operations only (no host
        read), so a fixed-shape step uses it too."""
        ids_sorted = torch.sort(ids).values
        m = (ids_sorted[1:] != ids_sorted[:-1]).sum() + 1  # distinct ids
        zero = torch.zeros_like(m)
        self.stats.add_(torch.stack([torch.ones_like(m), zero, m, zero, m, zero]))
        empty = torch.full((0,), -1, dtype=torch.long, device=self.device)
        return FillPlan(torch.full_like(ids, -1), empty, empty, zero)

    def plan_resize(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(old slots, new slots) of the experts a resize to ``num_slots`` keeps (:func:`plan_resize`)."""
        return plan_resize(self.expert_of[: self.num_slots], self.last_used[: self.num_slots], num_slots)

    def resize(self, num_slots: int, plan: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Resize to ``num_slots`` slots, keeping the most recently used experts that fit (``plan``,
        from :meth:`plan_resize`, or made now); returns (old slots, new slots) of the kept experts.
        The clock, the counters and the q table (the same tensor) carry over."""
        old_slots, new_slots = plan if plan is not None else self.plan_resize(num_slots)
        kept = self.expert_of[old_slots]
        used = self.last_used[old_slots]
        self.slot_of.fill_(-1)
        self.slot_of[kept] = new_slots
        self.expert_of = torch.full((num_slots + 1,), -1, dtype=torch.long, device=self.device)
        self.expert_of[new_slots] = kept
        self.last_used = torch.full((num_slots + 1,), -1, dtype=torch.long, device=self.device)
        self.last_used[new_slots] = used
        self.num_slots = num_slots
        self.num_candidates = min(self.max_fills, num_slots)
        return old_slots, new_slots

    def read_stats(self) -> dict[str, int]:
        return dict(zip(STAT_NAMES, self.stats.tolist(), strict=True))

    def resident(self) -> dict[int, int]:
        """{global id: slot} of what the cache holds (host copy, for tests and inspection)."""
        return {g: s for s, g in enumerate(self.expert_of[:-1].tolist()) if g >= 0}
