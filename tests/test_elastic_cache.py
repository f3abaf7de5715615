"""Elastic VRAM on the virtual device: resizing the expert cache between steps keeps every running
request's tokens and logits equal to an unresized run, keeps the most recently used experts (their
weights intact in their new slots), and works with quantized experts and with prefill streaming."""

from __future__ import annotations

import pytest
import torch

from hearth.config import ConfigError
from hearth.engine import LLM
from hearth.engine.executor.memory_plan import tensor_bytes
from hearth.engine.experts.mechanism.vram_watch import watch_engine
from hearth.engine.experts.policy.cache import ExpertCacheTables, plan_resize
from hearth.engine.experts.policy.vram import VramPolicy, default_cache_bytes, elastic_budget
from tests.helpers import greedy, max_rel_error, run_resizing
from tests.test_gguf_hierarchy import q4_k_m  # noqa: F401 - the fixture
from tests.test_hierarchy import BATCH4, OVERRIDES, SPLIT_BANDWIDTHS

# Sizes applied before the given engine steps: shrink, shrink to nothing, grow, grow to all, shrink.
RESIZES = {3: "0.1", 6: "1slot", 9: "0slots", 12: "1.0", 16: "0.37", 20: "2slots"}


@pytest.fixture(scope="module")
def unresized(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=1 << 20)
    result = run_resizing(llm, BATCH4, 24, {})
    llm.close()
    return result


def test_plan_resize_keeps_the_most_recently_used() -> None:
    expert_of = torch.tensor([7, -1, 3, 9, 4, -1])
    last_used = torch.tensor([5, -1, 9, 1, 7, -1])
    old, new = plan_resize(expert_of, last_used, 2)
    assert old.tolist() == [2, 4] and new.tolist() == [0, 1]  # experts 3 and 4, used last, compacted
    old, new = plan_resize(expert_of, last_used, 10)
    assert old.tolist() == [0, 2, 3, 4] and new.tolist() == [0, 1, 2, 3]  # growing keeps every resident
    assert plan_resize(expert_of, last_used, 0)[0].numel() == 0


def test_table_resize_carries_the_clock_counters_and_q_table() -> None:
    qtable = torch.arange(9)
    tables = ExpertCacheTables(16, 4, qtable, max_fills=8)
    tables.step(torch.tensor([1, 2, 3, 4, 1]))
    tables.step(torch.tensor([2, 5]))
    same_qtable, stats, clock = tables.qtable, tables.stats.clone(), int(tables.clock[0])
    old, new = tables.resize(2)
    kept = tables.resident()
    assert set(kept) == {2, 5} and sorted(kept.values()) == [0, 1]  # used in the last step, compacted
    assert tables.expert_of.shape == (3,) and tables.num_candidates == 2
    assert tables.qtable is same_qtable and torch.equal(tables.stats, stats) and int(tables.clock[0]) == clock
    tables.resize(6)
    assert tables.resident() == kept and tables.num_candidates == 6
    plan = tables.step(torch.tensor([7, 2]))
    assert int(plan.count) == min(int(qtable[1]), 6)  # a miss fills into the new slots


def test_resizing_between_steps_keeps_running_requests_exact(checkpoint, unresized) -> None:
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=1 << 20)
    tokens, logits = run_resizing(llm, BATCH4, 24, RESIZES)
    ref_tokens, ref_logits = unresized
    assert tokens == ref_tokens
    assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-5
    stats = llm.engine.stats()["experts"]
    assert stats["slots"] == 2 and stats["fills"] > 0 and stats["cpu"] > 0
    with pytest.raises(ConfigError, match="expert_cache"):
        llm.engine.resize_expert_cache("lots")
    llm.close()


def test_resizing_with_prefill_streaming(checkpoint, unresized) -> None:
    """Streamed prefill chunks with resizes between them: the buffers' experts become cache entries,
    streaming stops while the cache cannot hold its buffers and resumes when it can."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="1.0", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=4, prefill_chunk=8)
    backend = llm.engine.experts
    assert backend.streamer is not None
    tokens, logits = run_resizing(llm, BATCH4, 24, {1: "0.1", 2: "1.0", 4: "0.75", 30: "0.1"})
    assert tokens == unresized[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, unresized[1], strict=True)) <= 1e-5
    assert backend.streamer is None  # 4 slots cannot hold 2 layers' buffers
    assert backend.resize(48)["slots"] == 48 and backend.streamer is not None
    assert backend.streamer.stats.streamed_steps >= 2
    llm.close()


def test_no_cache_to_resize(checkpoint) -> None:
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="none")
    with pytest.raises(ValueError, match="no expert cache"):
        llm.engine.resize_expert_cache("0.5")
    llm.close()


def test_resizing_quantized_experts(q4_k_m) -> None:  # noqa: F811 - the imported fixture
    """Slots holding Q4_K/Q6_K blocks move as they are; results stay those of the plain engine."""
    path, refs = q4_k_m
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=1 << 20)
    tokens, logits = run_resizing(llm, BATCH4, 16, {3: "0.1", 6: "1.0", 10: "0.25"})
    assert tokens == refs[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, refs[4][1], strict=True)) <= 1e-5
    llm.close()


def test_elastic_budget_follows_free_memory() -> None:
    gib, slot = 1 << 30, 1 << 20
    policy = VramPolicy(reserve=gib, ceiling=8 * gib, expert_bytes=slot, grow_step=gib // 2)
    assert elastic_budget(free=3 * gib, cache_bytes=8 * gib, policy=policy) is None  # at the ceiling, room to spare
    assert elastic_budget(free=gib // 4, cache_bytes=8 * gib, policy=policy) == 8 * gib - 3 * gib // 4  # a game came
    assert elastic_budget(free=0, cache_bytes=gib // 2, policy=policy) == 0  # never below nothing
    assert elastic_budget(free=gib + gib // 4, cache_bytes=4 * gib, policy=policy) is None  # too little to grow for
    assert elastic_budget(free=3 * gib, cache_bytes=4 * gib, policy=policy) == 6 * gib  # the game left
    assert elastic_budget(free=20 * gib, cache_bytes=4 * gib, policy=policy) == 8 * gib  # up to the ceiling only
    assert elastic_budget(free=gib - slot // 2, cache_bytes=4 * gib, policy=policy) == 4 * gib - slot  # whole slots
    assert elastic_budget(free=gib + 5, cache_bytes=0, policy=VramPolicy(gib, 8 * gib, 3)) == 3  # whole slots


def test_default_cache_size_within_a_vram_limit() -> None:
    gib = 1 << 30
    assert default_cache_bytes("cuda", 10 * gib, 40 * gib, None, 0) == 8 * gib  # 80 % of free memory
    assert default_cache_bytes("cuda", 10 * gib, 40 * gib, 8 * gib, 3 * gib) == 4 * gib  # 80 % of what the limit leaves
    assert default_cache_bytes("cuda", 2 * gib, 40 * gib, 8 * gib, 3 * gib) == int(1.6 * gib)  # the GPU has less
    assert default_cache_bytes("cuda", 10 * gib, 40 * gib, 2 * gib, 3 * gib) == 0  # dense and KV over the limit
    assert default_cache_bytes("virtual", 0, 40 * gib, None, 0) == 10 * gib  # a quarter of the pool
    assert default_cache_bytes("virtual", 0, 40 * gib, 13 * gib, gib) == int(9.6 * gib)  # the stand-in GPU's size


def test_vram_limit_sizes_the_engines_cache(checkpoint) -> None:
    """``vram_limit`` counts the executor's dense weights and KV cache, and the cache takes 80 % of
    the rest (the virtual device standing in for a GPU of that size)."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", q_mode="zero")
    engine = llm.engine
    model = engine.runner.model
    in_use = tensor_bytes([*model.parameters(), *model.buffers(), *engine.runner.kv.keys, *engine.runner.kv.values],
                          "cpu")
    expert = engine.pool.expert_bytes
    llm.close()
    llm = LLM(path, expert_device="virtual", q_mode="zero", vram_limit=in_use + 10 * expert)
    assert llm.engine.experts.tables.num_slots == 8
    llm.close()


def test_vram_watcher_resizes_the_engine(checkpoint) -> None:
    """The watcher over a real engine (the virtual device; a scripted reading stands in for NVML):
    free memory falls, the cache shrinks; it comes back, the cache grows to its starting size."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="1.0", q_mode="zero", vram_reserve=0)
    engine = llm.engine
    slot = engine.experts.pool.expert_bytes
    free = [10 * slot]
    watcher = watch_engine(engine, lambda n: engine.resize_expert_cache(f"{n}b"), read_free=lambda: free[0],
                           interval_s=3600)  # checked by hand below
    assert watcher.check() is None and engine.experts.tables.num_slots == 48
    free[0] = -20 * slot  # another program took 20 slots' worth beyond what was free
    assert watcher.check() == 28 * slot and engine.experts.tables.num_slots == 28
    free[0] = 30 * slot
    assert watcher.check() == 48 * slot and engine.experts.tables.num_slots == 48
    engine.resize_expert_cache("20slots")  # an operator's size (the admin route also sets the ceiling)
    watcher.set_ceiling(20 * slot)
    free[0] = 60 * slot
    assert watcher.check() is None and engine.experts.tables.num_slots == 20  # not grown back over it
    watcher.stop()
    assert watch_engine(engine, print) is None  # the virtual device has no NVML reading
    assert watch_engine(LLM(path, expert_device="none").engine, print, read_free=lambda: 0) is None
    llm.close()


def test_resizing_under_compiled_static_steps(checkpoint, unresized) -> None:
    """Fixed-shape decode steps compiled whole (engine/executor/fixed_shape.py): a resize drops the compiled
    steps, which compile again over the new arena and tables; tokens and logits as unresized."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=1 << 20, static_decode="compile")
    static = llm.engine.runner.static
    static.backend = "aot_eager"
    tokens, logits = run_resizing(llm, BATCH4, 24, {6: "0.1", 12: "1.0", 18: "0slots"})
    assert tokens == unresized[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, unresized[1], strict=True)) <= 1e-5
    assert static.recompiles == 3 and static.compiled_buckets and static.steps >= 20
    llm.close()
    torch._dynamo.reset()


def test_a_failed_device_resize_leaves_a_consistent_cache(checkpoint, unresized) -> None:
    """The device resizes first: when it fails with its arena intact the tables are untouched; when
    it had to give its arena up, the cache is empty (0 slots) and says so; decoding goes on exactly."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=1 << 20)
    backend = llm.engine.experts
    real = backend.device.resize

    def refuses(*args):
        raise MemoryError("no room")

    def gives_up(*args):
        real(0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
        raise MemoryError("no room; it now has none")

    llm.generate(BATCH4[:1], greedy(4))
    held = backend.tables.resident()
    backend.device.resize = refuses
    with pytest.raises(MemoryError):
        llm.engine.resize_expert_cache("1.0")
    assert backend.tables.resident() == held and backend.tables.num_slots == backend.device.num_slots == 17
    backend.device.resize = gives_up
    with pytest.raises(MemoryError):
        llm.engine.resize_expert_cache("1.0")
    assert backend.tables.num_slots == backend.device.num_slots == 0 and backend.tables.resident() == {}
    backend.device.resize = real
    tokens, logits = run_resizing(llm, BATCH4, 24, {5: "0.37"})
    assert tokens == unresized[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, unresized[1], strict=True)) <= 1e-5
    llm.close()
