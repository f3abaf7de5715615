"""Admission control: whether a new request may join the queue, from what waits ahead of it.

Pure functions over a frozen snapshot (:class:`Backlog`), so that the policy is tested without an
engine. A request is refused at once (429 / 529 with ``Retry-After``) when the queue is full by
count, when the prompt tokens waiting would pass a bound, or when its estimated wait to start is
longer than the server's limit: a client learns in milliseconds that it should retry, instead of
timing out after minutes in a queue it could not see. Admitted requests then wait in a
:class:`FairQueue`, which hands free slots to their tenants in turn."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backlog:
    """What is ahead of a new request."""

    slots: int  # requests the engine runs at once
    running: int  # requests producing tokens now
    waiting: int  # admitted requests that have not produced a token yet
    waiting_tokens: int  # their prompt tokens
    prefill_tok_s: float = 0.0  # measured prompt speed (0: not known yet)
    service_s: float = 0.0  # mean seconds a request holds a slot once it starts (0: not known yet)


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting: int  # requests waiting beyond the slots
    max_waiting_tokens: int | None = None  # prompt tokens waiting (None: no bound)
    max_wait_s: float | None = None  # estimated seconds to start (None: no bound)


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry_after_s: int


def estimated_wait(backlog: Backlog, prompt_tokens: int = 0) -> float:
    """Seconds until a new request starts producing tokens: the turns of the slots it waits for
    (each as long as a request's mean service time), then the prompts ahead of it and its own
    being computed."""
    b = backlog
    free = max(b.slots - b.running - b.waiting, 0)
    ahead = b.running + b.waiting + 1 - b.slots  # requests that need a slot to free first, itself included
    turns = math.ceil(ahead / max(b.slots, 1)) if free == 0 and ahead > 0 else 0
    prefill = (b.waiting_tokens + prompt_tokens) / b.prefill_tok_s if b.prefill_tok_s > 0 else 0.0
    return turns * b.service_s + prefill


def refusal(backlog: Backlog, prompt_tokens: int, limits: AdmissionLimits) -> Refusal | None:
    """Why a request of ``prompt_tokens`` cannot join the queue now (with the seconds after which a
    retry is likely to succeed), or None when it may."""
    b = backlog
    retry = max(1, min(60, math.ceil(b.service_s or 1.0)))
    if b.running + b.waiting >= b.slots + limits.max_waiting:
        return Refusal(f"{b.running + b.waiting} requests are in flight; the queue holds {limits.max_waiting} beyond "
                       f"the {b.slots} running", retry)
    # The bounds on tokens and wait leave the first request in line alone: it is next whatever the estimate.
    tokens = b.waiting_tokens + prompt_tokens
    if limits.max_waiting_tokens is not None and b.waiting and tokens > limits.max_waiting_tokens:
        return Refusal(f"{b.waiting_tokens} prompt tokens are waiting; the queue holds {limits.max_waiting_tokens}",
                       retry)
    wait = estimated_wait(b, prompt_tokens)
    if limits.max_wait_s is not None and b.waiting and wait > limits.max_wait_s:
        return Refusal(f"the estimated wait to start is {wait:.0f} s, over this server's {limits.max_wait_s:g} s",
                       max(1, min(60, math.ceil(wait - limits.max_wait_s))))
    return None


class FairQueue(Generic[T]):
    """Requests waiting for a slot, taken round-robin over their tenants (an API key, a session, a
    client address): one tenant's 64 requests wait behind each other, not in front of another
    tenant's one. Within a tenant, first come first served. Owned by one thread."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def push(self, tenant: str, item: T) -> None:
        self._queues.setdefault(tenant, deque()).append(item)

    def pop(self) -> T:
        """The next item: the first of the tenant whose turn it is (that tenant's turn then passes)."""
        tenant, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        del self._queues[tenant]
        if queue:
            self._queues[tenant] = queue  # to the back of the rotation
        return item

    def remove(self, match: Callable[[T], bool]) -> bool:
        """Drop the first item ``match`` accepts (a request aborted while it waits); whether one was."""
        for tenant, queue in self._queues.items():
            for item in queue:
                if match(item):
                    queue.remove(item)
                    if not queue:
                        del self._queues[tenant]
                    return True
        return False
