"""Admission control as a pure policy: count, queued tokens, estimated wait, and Retry-After."""

from __future__ import annotations

from hearth.serving.admission import AdmissionLimits, Backlog, estimated_wait, refusal


def test_estimated_wait_counts_slot_turns_and_prefill():
    free = Backlog(slots=4, running=2, waiting=0, waiting_tokens=0, prefill_tok_s=1000.0, service_s=10.0)
    assert estimated_wait(free, 500) == 0.5  # a slot is free: only its own prompt
    full = Backlog(slots=4, running=4, waiting=0, waiting_tokens=0, prefill_tok_s=1000.0, service_s=10.0)
    assert estimated_wait(full, 500) == 10.5  # one turn of the slots, then its prompt
    queued = Backlog(slots=4, running=4, waiting=4, waiting_tokens=4000, prefill_tok_s=1000.0, service_s=10.0)
    assert estimated_wait(queued, 1000) == 2 * 10.0 + 5.0  # four ahead: a second turn; 5000 tokens to prefill
    unknown = Backlog(slots=4, running=4, waiting=4, waiting_tokens=4000)
    assert estimated_wait(unknown, 1000) == 0.0  # nothing measured yet: no estimate, no refusal on it


def test_refusals():
    limits = AdmissionLimits(max_waiting=8, max_waiting_tokens=10_000, max_wait_s=30.0)
    calm = Backlog(slots=4, running=4, waiting=2, waiting_tokens=2000, prefill_tok_s=1000.0, service_s=5.0)
    assert refusal(calm, 1000, limits) is None
    full = Backlog(slots=4, running=4, waiting=8, waiting_tokens=100, prefill_tok_s=1000.0, service_s=5.0)
    assert "queue holds 8" in refusal(full, 10, limits).reason
    heavy = Backlog(slots=4, running=4, waiting=2, waiting_tokens=9500, prefill_tok_s=1e6, service_s=5.0)
    assert "prompt tokens" in refusal(heavy, 1000, limits).reason
    slow = Backlog(slots=4, running=4, waiting=7, waiting_tokens=0, prefill_tok_s=1e6, service_s=20.0)
    refused = refusal(slow, 0, limits)
    assert "estimated wait" in refused.reason and refused.retry_after_s == 10  # 40 s against 30
    first = Backlog(slots=4, running=4, waiting=0, waiting_tokens=0, prefill_tok_s=10.0, service_s=600.0)
    assert refusal(first, 20_000, limits) is None  # the first in line is never refused on tokens or wait
    assert refusal(slow, 100, AdmissionLimits(max_waiting=8)) is None


def test_fair_queue_takes_tenants_in_turn():
    from hearth.serving.admission import FairQueue

    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push("a", f"a{i}")
    q.push("b", "b0")
    q.push("c", "c0")
    q.push("b", "b1")
    assert len(q) == 7
    assert q.remove(lambda item: item == "a2") and not q.remove(lambda item: item == "zz")
    order = [q.pop() for _ in range(len(q))]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a3"]
    assert not q


def test_tenants_are_keys_where_the_server_holds_several_then_sessions_then_addresses():
    from hearth.serving.session import request_tenant

    alice = {"authorization": "Bearer alpha-key", "x-session-id": "s1"}
    alice2 = {"x-api-key": "alpha-key", "x-session-id": "s2"}
    bob = {"authorization": "Bearer beta-key", "x-session-id": "s1"}
    keys = ("alpha-key", "beta-key")
    # several keys: one tenant per key, whatever sessions it opens; the key is not kept in clear
    assert request_tenant(alice, "10.0.0.1", keys) == request_tenant(alice2, "10.0.0.2", keys)
    assert request_tenant(alice, "10.0.0.1", keys) != request_tenant(bob, "10.0.0.1", keys)
    assert "alpha-key" not in request_tenant(alice, "10.0.0.1", keys)
    # one shared key (or none): sessions, else addresses
    for single in (("alpha-key",), ()):
        assert request_tenant(alice, "10.0.0.1", single) != request_tenant(alice2, "10.0.0.1", single)
        assert request_tenant(alice, "10.0.0.1", single) == request_tenant(bob, "10.0.0.9", single)
        assert request_tenant({}, "10.0.0.1", single) != request_tenant({}, "10.0.0.2", single)
