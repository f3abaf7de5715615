"""Continuous-batching scheduler: pure CPU bookkeeping over requests and KV blocks.

Each step gets a token budget. Running requests go first (a decode costs one token, an
unfinished prefill its next chunk), then waiting requests are admitted while blocks and budget
last, so new prompts are prefilled in the same steps in which others decode. When KV blocks run
out, the most recently admitted request is preempted: its blocks are freed and it is recomputed
later from its tokens (prompt + output so far), which yields the same tokens.

With a prefix cache (:class:`~hearth.engine.cache.prefix_tree.RadixCache`), a request admitted with nothing
computed starts from the longest cached whole-block prefix of its tokens (at least one token is
always left to compute, for the logits); after each step its newly computed full blocks join the
tree (:meth:`Scheduler.cache_computed`). Tree blocks no request pins are evicted, least recently
used first, before anyone is preempted.

Hybrid models (:class:`RecurrentConfig`) also hold a recurrent-state slot per running request. Their
prefix reuse stops at the deepest state checkpoint of the matched prefix (the state after the
prefix cannot be rebuilt from KV pages), and the state is restored from it; without one the
request starts from zeros at position 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hearth.config import SchedulerConfig
from hearth.engine.cache.kv_pages import BlockAllocator
from hearth.engine.cache.prefix_tree import RadixCache
from hearth.engine.cache.state_checkpoints import CheckpointStore
from hearth.engine.cache.state_slots import StateSnapshot
from hearth.engine.request import Request, Status


@dataclass
class RecurrentConfig:
    """Hybrid models: ``num_slots`` state slots, and the checkpoints prefix reuse restores from
    (None: no reuse)."""

    num_slots: int
    checkpoints: CheckpointStore | None = None


@dataclass
class ScheduledStep:
    """What one step computes: (request, number of new tokens to feed) pairs."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    """Decides which requests run in the next step and owns their KV blocks."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, prefix: RadixCache | None = None,
                 recurrent: RecurrentConfig | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix = prefix
        self.recurrent = recurrent
        self.checkpoints = recurrent.checkpoints if recurrent is not None and prefix is not None else None
        if self.checkpoints is not None:
            prefix.on_evict = self.checkpoints.node_evicted
        self._free_slots = list(range(recurrent.num_slots - 1, -1, -1)) if recurrent is not None else []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        limit = self.allocator.num_blocks * self.allocator.block_size
        if request.num_tokens + 1 > limit:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens does not fit the KV cache ({limit} tokens)"
            )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark a request finished (or aborted) and release its blocks."""
        request.status, request.finish_reason = Status.FINISHED, reason
        self._release_blocks(request)
        self._release_slot(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.step_tokens
        scheduled: list[Request] = []
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_pending, budget, self.config.prefill_chunk)
            if not self._reserve(req, n, step, scheduled):
                continue
            step.items.append((req, n))
            scheduled.append(req)
            budget -= n
        self._admit(step, budget)
        return step

    def _reserve(self, req: Request, n: int, step: ScheduledStep, scheduled: list[Request]) -> bool:
        """Allocate blocks for ``n`` more tokens, preempting the newest other requests if needed."""
        need = self.allocator.blocks_needed(req.num_computed + n, len(req.block_table))
        while not self._can_allocate(need):
            victim = next((r for r in reversed(self.running) if r is not req and r not in scheduled), None)
            if victim is None:
                self._preempt(req, step)
                return False
            self._preempt(victim, step)
        req.block_table += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        self._release_slot(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.recurrent is not None and not self._free_slots:
                break
            req = self.waiting[0]
            if req.num_computed == 0 and not req.block_table:
                self._reuse_prefix(req)
            n = min(req.num_pending, budget, self.config.prefill_chunk)
            need = self.allocator.blocks_needed(req.num_computed + n, len(req.block_table))
            if not self._can_allocate(need):
                self._release_blocks(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.block_table += self.allocator.allocate(need)
            req.status = Status.RUNNING
            if self.recurrent is not None:
                req.state_slot, req.state_ready = self._free_slots.pop(), False
            self.running.append(req)
            step.items.append((req, n))
            budget -= n

    def cache_computed(self, req: Request) -> None:
        """Hand the request's newly computed full blocks to the prefix tree (call after a step).
        Where the tree already held the same tokens, the request switches to the tree's block
        and frees its own copy."""
        if self.prefix is None:
            return
        full = min(req.num_computed // self.allocator.block_size, len(req.block_table))
        if full <= req.num_tree_blocks:
            return
        node, tree_blocks = self.prefix.insert(req.tokens[: full * self.allocator.block_size], req.block_table[:full])
        duplicates = [own for own, tree in zip(req.block_table[:full], tree_blocks, strict=True) if own != tree]
        self.allocator.free(duplicates)  # only the request's own blocks can differ from the tree's
        req.block_table[:full] = tree_blocks
        self.prefix.lock(node)
        if req.prefix_node is not None:
            self.prefix.unlock(req.prefix_node)
        req.prefix_node, req.num_tree_blocks = node, full

    def _reuse_prefix(self, req: Request) -> None:
        req.num_cached_tokens, req.state_source = 0, None
        if self.prefix is None:
            return
        found = self.prefix.match(req.tokens[: req.num_tokens - 1])  # leave a token to compute
        node, blocks = found.node, found.blocks
        if self.recurrent is not None:  # stop at the deepest state checkpoint
            ckpt = self.checkpoints.deepest(node, found.num_tokens) if self.checkpoints is not None else None
            if ckpt is None:
                return
            node, blocks = ckpt.node, blocks[: ckpt.position // self.allocator.block_size]
            req.state_source = ckpt.state
        if not blocks:
            return
        self.prefix.lock(node)
        req.prefix_node, req.num_tree_blocks = node, len(blocks)
        req.block_table = list(blocks)
        req.num_computed = req.num_cached_tokens = len(blocks) * self.allocator.block_size

    def add_checkpoint(self, req: Request, position: int, state: StateSnapshot, kinds: frozenset[str]) -> None:
        """Keep ``state``, the request's recurrent state after ``position`` tokens (a whole-block
        position within its tree blocks: call after :meth:`cache_computed`)."""
        if self.checkpoints is None or position > req.num_tree_blocks * self.allocator.block_size:
            return
        found = self.prefix.match(req.tokens[:position])  # splits an edge so that a node ends here
        if found.num_tokens == position:
            self.checkpoints.add(found.node, position, state, kinds)

    def _release_slot(self, req: Request) -> None:
        if req.state_slot >= 0:
            self._free_slots.append(req.state_slot)
        req.state_slot, req.state_source, req.state_ready = -1, None, False

    def _release_blocks(self, req: Request) -> None:
        """Free the request's own blocks and unpin its tree blocks (they stay cached)."""
        self.allocator.free(req.block_table[req.num_tree_blocks:])
        if req.prefix_node is not None:
            self.prefix.unlock(req.prefix_node)
        req.block_table, req.prefix_node, req.num_tree_blocks = [], None, 0

    def forget_prefixes(self) -> int:
        """Drop every cached prefix no request holds (their KV is no longer valid everywhere, e.g. a
        pipeline stage restarted empty); returns the blocks freed."""
        if self.prefix is None:
            return 0
        freed = self.prefix.evict(self.prefix.num_blocks)
        self.allocator.free(freed)
        return len(freed)

    def _can_allocate(self, need: int) -> bool:
        """Whether ``need`` blocks are free, after evicting unpinned tree blocks if necessary."""
        short = need - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self.allocator.free(self.prefix.evict(short))
        return self.allocator.can_allocate(need)
