"""Continuous batching: requests joining at different steps get exactly their solo tokens."""

from __future__ import annotations

import pytest

from hearth.engine import LLM, SamplingParams
from tests.helpers import greedy

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 41, 70)]
JOIN_AT = [0, 2, 5, 9]  # engine step at which each request arrives


def run_staggered(llm: LLM, params: list[SamplingParams]) -> dict[int, list[int]]:
    engine, pending, done = llm.engine, list(range(len(PROMPTS))), {}
    ids: dict[str, int] = {}
    step = 0
    while pending or engine.has_unfinished():
        for i in [i for i in pending if JOIN_AT[i] <= step]:
            ids[engine.add_request(PROMPTS[i], params[i])] = i
            pending.remove(i)
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        step += 1
    return done


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"prefill_chunk": 8, "max_num_batched_tokens": 12},  # prefill chunks share steps with decodes
        {"kv_cache_tokens": 160, "block_size": 8},  # too few blocks: preemption and recompute
    ],
    ids=["default", "small-chunks", "preemption"],
)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_staggered_batch_equals_solo(checkpoint, family, options):
    path, _ = checkpoint(family)
    solo = [LLM(path).generate(p, greedy(24))[0].token_ids for p in PROMPTS]
    llm = LLM(path, **options)
    batched = run_staggered(llm, [greedy(24)] * len(PROMPTS))
    assert [batched[i] for i in range(len(PROMPTS))] == solo
    if "kv_cache_tokens" in options:
        stats = llm.engine.stats()  # every block is free again, or cached for reuse and evictable
        assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"]


def test_seeded_sampling_is_reproducible(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 1, 3)]
    first = run_staggered(llm, params)
    second = run_staggered(llm, params)
    assert first == second
    # A seeded request samples the same tokens alone as inside a batch.
    assert LLM(path).generate(PROMPTS[3], params[3])[0].token_ids == first[3]
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)
    assert LLM(path).generate(PROMPTS[3], other_seed)[0].token_ids != first[3]


def test_generate_orders_outputs_and_counts_tokens(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    outs = LLM(path).generate(PROMPTS, greedy(7))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" for o in outs)
    assert all(o.metrics.num_prompt_tokens == len(p) for o, p in zip(outs, PROMPTS, strict=True))
