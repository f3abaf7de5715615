"""Prefix reuse through the radix tree never serves a stale KV page: randomized interleavings of
requests with shared, extended and edited prefixes against fresh computation."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from hearth.engine import SamplingParams
from hearth.engine.llm_engine import EngineConfig, LLMEngine
from tests.helpers import max_rel_error, record_logits


def _run(engine: LLMEngine, batches: list[list[list[int]]], steps: int) -> list[tuple[list[int], torch.Tensor]]:
    """Submit each batch together and run it to completion; tokens and per-step logits per prompt."""
    recorded = record_logits(SimpleNamespace(engine=engine))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    results = []
    for batch in batches:
        ids = [engine.add_request(p, params) for p in batch]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
        results += [(tokens[i], torch.stack(recorded[i])) for i in ids]
    return results


def _workload(seed: int) -> list[list[list[int]]]:
    """Batches of 1-3 prompts derived from a few bases by extension, truncation and edits."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 380) for _ in range(rng.randrange(40, 120))] for _ in range(5)]
    batches = []
    for _ in range(16):
        batch = []
        for _ in range(rng.randrange(1, 4)):
            p = list(rng.choice(bases))
            op = rng.choice(["same", "extend", "truncate", "edit"])
            if op == "extend":
                p += [rng.randrange(3, 380) for _ in range(rng.randrange(1, 40))]
            elif op == "truncate":
                p = p[: rng.randrange(1, len(p) + 1)]
            elif op == "edit":
                p[rng.randrange(len(p))] = rng.randrange(3, 380)
            batch.append(p)
        batches.append(batch)
    return batches


def test_prefix_reuse_equals_fresh_computation(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    batches = _workload(0)
    fresh = LLMEngine(path, EngineConfig(prefix_caching=False))
    expected = [r for batch in batches for r in _run(fresh, [[p] for p in batch], 4)]
    # A small KV cache (384 tokens = 24 blocks) so the tree must evict while requests pin blocks.
    cached = LLMEngine(path, EngineConfig(prefix_caching=True, kv_cache_tokens=384, block_size=16,
                                          prefill_chunk=32))
    tree = cached.scheduler.prefix
    evicted: list[int] = []
    evict = tree.evict

    def counting_evict(n: int) -> list[int]:
        freed = evict(n)
        evicted.extend(freed)
        return freed

    tree.evict = counting_evict
    got = _run(cached, batches, 4)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert max_rel_error(logits, ref_logits) <= 1e-4
    assert tree.num_blocks > 0 and evicted  # reuse happened under eviction
    assert cached.scheduler.allocator.num_free + tree.num_blocks == cached.scheduler.allocator.num_blocks


def test_cached_prompt_tokens_are_reported(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    engine = LLMEngine(path, EngineConfig(prefix_caching=True, block_size=16))
    prompt = list(range(3, 103))  # 100 tokens: 6 whole blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    metrics = []
    for _ in range(2):
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    metrics.append(out.metrics)
    assert metrics[0].num_cached_tokens == 0
    assert metrics[1].num_cached_tokens == 96  # the 6 whole blocks of the prompt
