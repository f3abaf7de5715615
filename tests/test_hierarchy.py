"""The expert hierarchy gives the plain engine's results at every cache size and split."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import LLM
from tests.helpers import PROMPTS, greedy, max_rel_error, record_logits

CAPACITIES = ["0slots", "1slot", "0.1", "0.37", "1.0"]
OVERRIDES = {"num_experts": 16, "num_experts_per_tok": 4}
# B_P 10 GB/s, B_H 25 GB/s: the table sends roughly 60 % of the misses to the CPU.
SPLIT_BANDWIDTHS = (10e9, 25e9)
BATCH4 = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301]]


def run(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorded = record_logits(llm)
    outs = llm.generate(prompts, greedy(steps))
    return [o.token_ids for o in outs], [torch.stack(recorded[o.request_id]) for o in outs]


@pytest.fixture(scope="module")
def plain(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="none")
    return {1: run(llm, PROMPTS[:1], 24), 4: run(llm, BATCH4, 24)}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("q_mode", ["zero", "all", "table"])
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_fp32_logits_equal_plain_engine(checkpoint, plain, capacity, q_mode, batch):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    # Every step on the decode path (prefill streaming has its own tests in test_prefill_stream.py).
    llm = LLM(path, expert_device="virtual", expert_cache=capacity, q_mode=q_mode,
              expert_bandwidths=SPLIT_BANDWIDTHS, stream_min_tokens=1 << 20)
    tokens, logits = run(llm, PROMPTS[:1] if batch == 1 else BATCH4, 24)
    ref_tokens, ref_logits = plain[batch]
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert max_rel_error(ours, ref) <= 1e-5
    stats = llm.engine.stats()["experts"]
    total_slots = 3 * OVERRIDES["num_experts"]
    expected_slots = {"0slots": 0, "1slot": 1, "0.1": 4, "0.37": 17, "1.0": total_slots}[capacity]
    assert stats["slots"] == expected_slots
    if expected_slots == 0 or q_mode == "zero":
        assert stats["fills"] == 0 and stats["cpu"] == stats["misses"]
    if q_mode == "all":
        assert stats["cpu"] <= stats["misses"] and (stats["cpu"] == 0 or expected_slots < 16)
    if q_mode == "table" and expected_slots >= 16:
        assert stats["fills"] > 0 and stats["cpu"] > 0  # the split really splits
    llm.engine.close()


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_cpu_workers_elsewhere_equal_plain_engine(checkpoint, plain, workers):
    """CPU share on a bound worker thread, or in a worker process attached to the shared pool."""
    import uuid

    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.1", expert_bandwidths=SPLIT_BANDWIDTHS,
              cpu_experts=workers, host_pool_name=f"test-workers-{uuid.uuid4().hex[:8]}",
              max_num_batched_tokens=256, prefill_chunk=64)
    tokens, logits = run(llm, BATCH4, 24)
    assert tokens == plain[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, plain[4][1], strict=True)) <= 1e-5
    assert llm.engine.stats()["experts"]["cpu"] > 0
    llm.close()


@pytest.fixture(scope="module")
def plain_bf16(checkpoint):
    refs = {}
    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        path, _ = checkpoint(family, dtype="bfloat16")
        llm = LLM(path, expert_device="none")
        for batch, prompts in ((1, PROMPTS[:1]), (4, BATCH4)):
            refs[family, batch] = [o.token_ids for o in llm.generate(prompts, greedy(32))]
    return refs


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("q_mode", ["zero", "all", "table"])
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_bf16_greedy_tokens_equal_plain_engine(checkpoint, plain_bf16, family, capacity, q_mode, batch):
    path, _ = checkpoint(family, dtype="bfloat16")
    llm = LLM(path, expert_device="virtual", expert_cache=capacity, q_mode=q_mode,
              expert_bandwidths=SPLIT_BANDWIDTHS)
    prompts = PROMPTS[:1] if batch == 1 else BATCH4
    assert [o.token_ids for o in llm.generate(prompts, greedy(32))] == plain_bf16[family, batch]
    llm.engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.py covers more)")
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_cuda_cache_equals_plain_engine(checkpoint, plain, capacity):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="cuda", expert_cache=capacity, expert_bandwidths=SPLIT_BANDWIDTHS)
    tokens, logits = run(llm, BATCH4, 24)
    assert tokens == plain[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, plain[4][1], strict=True)) <= 1e-5
    llm.engine.close()


def test_rate_limited_link_and_routing_record(checkpoint, tmp_path):
    import json

    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    record = tmp_path / "routing.jsonl"
    llm = LLM(path, expert_device="virtual", expert_cache="0.5", virtual_link_gbps=1.0, q_mode="all",
              record_routing=str(record))
    out = llm.generate(PROMPTS[1], greedy(6))[0]
    llm.engine.close()
    stats = llm.engine.stats()["experts"]
    assert stats["fills"] > 0 and stats["fill_bytes"] == stats["fills"] * llm.engine.pool.expert_bytes
    # A 1 GB/s link cannot move the filled bytes faster than that.
    assert stats["fill_seconds"] >= stats["fill_bytes"] / 1e9 * 0.95
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == len(out.token_ids)  # one prefill step, then one step per decoded token
    first = lines[0]
    assert sorted(first["layers"]) == ["0", "1", "2"]
    assert len(first["layers"]["0"]) == len(PROMPTS[1])  # one row of k ids per prompt token
    assert all(16 <= g < 32 for row in first["layers"]["1"] for g in row)  # global ids of layer 1


def test_tuned_fill_credit_keeps_results_exact(checkpoint, plain):
    """The credit tuner rewrites the q table between layer calls; a tuner that moves every few
    calls (on real timings) must leave the tokens and logits unchanged, and the table it leaves is
    the table of its credit."""
    from hearth.engine.experts.policy.qstar import build_qtable
    from hearth.engine.experts.policy.tuning import CreditTuner

    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", expert_bandwidths=SPLIT_BANDWIDTHS)
    backend = llm.engine.experts
    assert backend.tuner is not None and backend.credit == 0.0  # the default: tuned, from the per-step table
    backend.tuner = CreditTuner(epoch_calls=2, hold=1, probe=1, margin=0.0)
    credits = []
    original = backend._rebuild_qtable

    def rebuild() -> None:
        credits.append(backend.credit)
        original()

    backend._rebuild_qtable = rebuild
    tokens, logits = run(llm, BATCH4, 24)
    assert tokens == plain[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, plain[4][1], strict=True)) <= 1e-5
    assert len(set(credits)) >= 2, credits  # it really moved
    m_max = len(backend.qtable()) - 1
    assert backend.qtable() == build_qtable(backend.costs, m_max, credit=backend.credit).tolist()
    assert llm.engine.stats()["experts"]["fill_credit"] == backend.credit
    llm.engine.close()


def test_step_mode_is_the_untuned_per_step_table(checkpoint):
    from hearth.engine.experts.policy.qstar import build_qtable

    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", expert_bandwidths=SPLIT_BANDWIDTHS,
              q_mode="step")
    backend = llm.engine.experts
    llm.generate(PROMPTS[0], greedy(8))
    assert backend.tuner is None and backend.credit == 0.0
    assert backend.qtable() == build_qtable(backend.costs, len(backend.qtable()) - 1).tolist()
    llm.engine.close()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "lfm2_moe", "granitemoehybrid"])
def test_hybrid_models_through_the_hierarchy(checkpoint, family):
    """Hybrid (DeltaNet + attention) models: experts through the cache with a split, a batch of
    four with chunked prefill, against the plain engine (fp32)."""
    path, _ = checkpoint(family, **OVERRIDES)
    plain_tokens, plain_logits = run(LLM(path, expert_device="none"), BATCH4, 12)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", expert_bandwidths=SPLIT_BANDWIDTHS,
              prefill_chunk=8)
    tokens, logits = run(llm, BATCH4, 12)
    assert tokens == plain_tokens
    for ours, ref in zip(logits, plain_logits, strict=True):
        assert max_rel_error(ours, ref) <= 1e-4
    stats = llm.engine.stats()["experts"]
    assert stats["fills"] > 0 and stats["cpu"] > 0
    llm.engine.close()
