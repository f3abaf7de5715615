"""Continuous-batching scheduler: pure CPU bookkeeping over requests and KV blocks.

Each step gets a token budget. Running requests go first (a decode costs one token, an
unfinished prefill its next chunk), then waiting requests are admitted while blocks and budget
last, so new prompts are prefilled in the same steps in which others decode. When KV blocks run
out, the most recently admitted request is preempted: its blocks are freed and it is recomputed
later from its tokens (prompt + output so far), which yields the same tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockAllocator
from engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512
    max_model_len: int = 8192


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

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
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
        self.allocator.free(request.block_table)
        request.block_table = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
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
        while not self.allocator.can_allocate(need):
            victim = next((r for r in reversed(self.running) if r is not req and r not in scheduled), None)
            if victim is None:
                self._preempt(req, step)
                return False
            self._preempt(victim, step)
        req.block_table += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        self.allocator.free(req.block_table)
        req.block_table, req.num_computed = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_pending, budget, self.config.prefill_chunk)
            need = self.allocator.blocks_needed(req.num_computed + n, len(req.block_table))
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req.block_table += self.allocator.allocate(need)
            req.status = Status.RUNNING
            self.running.append(req)
            step.items.append((req, n))
            budget -= n
