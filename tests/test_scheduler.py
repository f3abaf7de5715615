"""Scheduler and block allocator: pure bookkeeping, no model."""

from __future__ import annotations

import pytest

from hearth.engine.cache.kv_pages import BlockAllocator, OutOfBlocks
from hearth.engine.request import Request, Status
from hearth.engine.sampling import SamplingParams
from hearth.engine.scheduler import Scheduler, SchedulerConfig


def req(name: str, n: int) -> Request:
    return Request(name, list(range(n)), SamplingParams())


def finish_step(step) -> None:
    """Pretend the model ran: advance computed counts, emit a token when a prompt completes."""
    for r, n in step.items:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(0)


def test_allocator_counts_blocks():
    alloc = BlockAllocator(4, 16)
    assert alloc.blocks_needed(17, 0) == 2 and alloc.blocks_needed(32, 2) == 0
    blocks = alloc.allocate(3)
    assert alloc.num_free == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_free == 4


def test_prefill_is_chunked_and_decodes_share_steps():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, prefill_chunk=6), BlockAllocator(64, 4))
    a, b = req("a", 3), req("b", 20)
    sched.add(a)
    step = sched.schedule()
    assert [(r.request_id, n) for r, n in step.items] == [("a", 3)]
    finish_step(step)
    sched.add(b)
    step = sched.schedule()
    # a decodes one token while b's prompt starts with a chunk bounded by prefill_chunk.
    assert [(r.request_id, n) for r, n in step.items] == [("a", 1), ("b", 6)]
    finish_step(step)
    step = sched.schedule()
    assert [(r.request_id, n) for r, n in step.items] == [("a", 1), ("b", 6)]


def test_token_budget_and_max_seqs_are_respected():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), BlockAllocator(64, 4))
    for i in range(3):
        sched.add(req(f"r{i}", 5))
    step = sched.schedule()
    assert step.num_tokens <= 8 and len(sched.running) <= 2
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"] or len(step.items) == 2


def test_preemption_frees_blocks_and_requeues_newest():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, prefill_chunk=64), BlockAllocator(4, 4))
    a, b = req("a", 8), req("b", 8)
    sched.add(a)
    sched.add(b)
    finish_step(sched.schedule())
    assert sched.allocator.num_free == 0
    # Both now need a third block for their next token: the newest (b) is preempted.
    step = sched.schedule()
    assert step.preempted == [b] and b.status is Status.WAITING and b.num_computed == 0
    assert [r.request_id for r, _ in step.items] == ["a"]
    assert sched.waiting[0] is b


def test_finish_releases_blocks():
    sched = Scheduler(SchedulerConfig(), BlockAllocator(8, 4))
    a = req("a", 10)
    sched.add(a)
    sched.schedule()
    sched.finish(a, "abort")
    assert sched.allocator.num_free == 8 and not sched.has_unfinished()


def test_prompt_larger_than_cache_is_rejected():
    sched = Scheduler(SchedulerConfig(), BlockAllocator(2, 4))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        sched.add(req("a", 9))


def test_prefix_cache_reuses_pins_and_evicts_blocks():
    from hearth.engine.cache.prefix_tree import RadixCache

    alloc = BlockAllocator(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, prefill_chunk=64), alloc, RadixCache(4))
    first = req("a", 10)  # 2 whole blocks + 2 tokens
    sched.add(first)
    step = sched.schedule()
    finish_step(step)
    sched.cache_computed(first)
    assert first.num_tree_blocks == 2 and sched.prefix.num_blocks == 2
    second = req("b", 9)  # same first 9 tokens: reuses the 2 whole blocks, computes 1 token
    sched.add(second)
    step = sched.schedule()
    items = dict((r.request_id, n) for r, n in step.items)
    assert items["b"] == 1 and second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    sched.finish(first, "stop")
    sched.finish(second, "stop")
    assert alloc.num_free == 8 - 2  # the tree keeps the two shared blocks, unpinned
    big = req("c", 31)  # needs all 8 blocks: the tree's blocks are evicted for it
    big.prompt_ids = [100 + i for i in range(31)]
    sched.add(big)
    step = sched.schedule()
    assert [r.request_id for r, _ in step.items] == ["c"] and sched.prefix.num_blocks == 0
