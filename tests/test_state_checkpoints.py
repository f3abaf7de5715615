"""Recurrent-state checkpoints of hybrid models: where they are taken, how the budget evicts them,
and that restoring one gives exactly what a fresh full prefill gives (both hybrid families, one
request at a time and concurrently), also under eviction and with randomized edits."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from bench.agent_replay import build_session, turn_prompts
from hearth.engine import SamplingParams
from hearth.engine.cache.prefix_tree import RadixCache
from hearth.engine.cache.state_checkpoints import CheckpointStore, checkpoint_positions
from hearth.engine.cache.state_slots import RecurrentStatePool, StateSnapshot
from hearth.engine.llm_engine import EngineConfig, LLMEngine
from tests.checkpoints import HYBRID_FAMILIES
from tests.helpers import max_rel_error, record_logits
from tests.test_prefix_reuse import _workload

HYBRID = {"max_position_embeddings": 16384}


def _snapshot(nbytes: int) -> StateSnapshot:
    return StateSnapshot({0: (torch.zeros(0), torch.zeros(nbytes // 4))})


def test_checkpoint_positions_by_policy():
    tokens = [5] * 40 + [1] + [5] * 100  # one anchor token (id 1) at index 40
    anchors = frozenset({1})
    args = (tokens, 0, 140, 130, 16)
    none = frozenset()
    assert checkpoint_positions(*args, "none", 64, anchors) == {}
    assert checkpoint_positions(*args, "prompt-end", 64, anchors) == {128: none}
    assert checkpoint_positions(*args, "periodic", 64, anchors) == {64: none, 128: none}
    # Before and after the anchor (40, 41) round down to the block boundary 32: one checkpoint, two kinds.
    assert checkpoint_positions(*args, "anchors", 64, anchors) == {32: {"1:before", "1:after"}, 64: none,
                                                                   128: none}
    # Only positions inside the step's range (start, end].
    assert checkpoint_positions(tokens, 64, 100, 130, 16, "anchors", 64, anchors) == {}
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        checkpoint_positions(*args, "sometimes", 64, anchors)


def _tree_nodes(positions):
    tree = RadixCache(4)
    tokens = list(range(100))
    tree.insert(tokens[:40], list(range(10)))
    return tree, {p: tree.match(tokens[:p]).node for p in positions}


def test_store_evicts_periodic_first_then_least_recently_used():
    tree, nodes = _tree_nodes((8, 16, 24, 32))
    store = CheckpointStore(budget_bytes=3 * 400)
    a = frozenset({"7:before"})
    store.add(nodes[8], 8, _snapshot(400), a)
    store.add(nodes[16], 16, _snapshot(400))  # periodic
    store.add(nodes[24], 24, _snapshot(400), a)
    assert store.used_bytes == 1200 and store.count == 3
    store.add(nodes[32], 32, _snapshot(400), a)  # over budget: the periodic one goes
    assert nodes[16].checkpoint is None and store.used_bytes == 1200
    assert store.deepest(nodes[16], limit=100).position == 8  # the restore point falls back to 8
    store.add(nodes[16], 16, _snapshot(400), a)  # all of one kind: the least recently used (24) goes
    assert nodes[24].checkpoint is None and nodes[8].checkpoint is not None
    assert store.used_bytes <= store.budget_bytes
    assert store.add(nodes[24], 24, _snapshot(5000), a) is None  # bigger than the whole budget


def test_store_keeps_the_anchor_kinds_that_get_restored():
    """Kinds restored more often than others survive eviction, even when older."""
    tree, nodes = _tree_nodes((8, 16, 24, 32))
    store = CheckpointStore(budget_bytes=3 * 400)
    useful, other = frozenset({"5:before"}), frozenset({"9:after"})
    store.add(nodes[8], 8, _snapshot(400), useful)
    assert store.deepest(nodes[8], limit=8).position == 8  # a restore credits "5:before"
    store.add(nodes[16], 16, _snapshot(400), other)
    store.add(nodes[24], 24, _snapshot(400), other)
    store.add(nodes[32], 32, _snapshot(400), other)  # over budget: an "other" goes, not the older useful one
    assert nodes[8].checkpoint is not None and nodes[16].checkpoint is None
    assert store.survival(nodes[8].checkpoint) > store.survival(nodes[24].checkpoint) > -1
    assert store.stats()["checkpoint_restores"] == 1


def test_evicted_tree_node_takes_its_checkpoint_along():
    tree = RadixCache(4)
    store = CheckpointStore(budget_bytes=10_000)
    tree.on_evict = store.node_evicted
    node, _ = tree.insert(list(range(8)), [0, 1])
    store.add(node, 8, _snapshot(400))
    assert sorted(tree.evict(2)) == [0, 1]
    assert store.count == 0 and store.used_bytes == 0


def _run(engine: LLMEngine, batches: list[list[list[int]]], steps: int = 3):
    """Submit each batch together, run it to completion: (tokens, logits, cached tokens) per prompt."""
    recorded = record_logits(SimpleNamespace(engine=engine))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    results = []
    for batch in batches:
        ids = [engine.add_request(p, params) for p in batch]
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        results += [(final[i].token_ids, torch.stack(recorded[i]), final[i].metrics.num_cached_tokens) for i in ids]
    return results


def _assert_same(got, expected):
    for (tokens, logits, _), (ref_tokens, ref_logits, _) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert max_rel_error(logits, ref_logits) <= 1e-4


def _agent_prompts(path) -> list[list[int]]:
    """Turns 1-4 of a scripted agent session as OpenClaw and OpenCode resend them."""
    tok = LLMEngine(path, EngineConfig(max_num_seqs=1)).tokenizer
    history = build_session(0, 4, result_words=(20, 50))
    return [p for style in ("openclaw", "opencode") for p in turn_prompts(tok, history, style)]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_restored_state_equals_fresh_prefill_one_at_a_time(checkpoint, family):
    path, _ = checkpoint(family, chat_format="agent", **HYBRID)
    prompts = _agent_prompts(path)
    expected = _run(LLMEngine(path, EngineConfig(prefix_caching=False)), [[p] for p in prompts])
    for policy in ("periodic", "anchors"):
        cached = LLMEngine(path, EngineConfig(prefix_caching=True, checkpoints=policy, checkpoint_interval=32,
                                              prefill_chunk=128))
        got = _run(cached, [[p] for p in prompts])
        _assert_same(got, expected)
        reused = [c for _, _, c in got[1:]]
        assert all(c > 0 for c in reused), (policy, reused)  # every later turn restored a checkpoint
        assert cached.stats()["checkpoints"] > 0


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_restored_state_equals_fresh_prefill_concurrently(checkpoint, family):
    """Requests sharing prefixes run in the same steps: some restore, some write checkpoints
    others then restore, decode steps interleave with prefill chunks."""
    path, _ = checkpoint(family, chat_format="agent", **HYBRID)
    prompts = _agent_prompts(path)
    first, rest = prompts[:2], prompts[2:]
    batches = [first, rest[:3], rest[3:]]
    expected = _run(LLMEngine(path, EngineConfig(prefix_caching=False)), [[p] for batch in batches for p in batch])
    cached = LLMEngine(path, EngineConfig(prefix_caching=True, checkpoints="anchors", checkpoint_interval=32,
                                          prefill_chunk=64, max_num_batched_tokens=160))
    got = _run(cached, batches)
    _assert_same(got, expected)
    assert sum(c > 0 for _, _, c in got[2:]) >= 3


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_randomized_edits_under_eviction_never_restore_a_stale_state(checkpoint, family):
    """Interleaved batches of shared, extended, truncated and edited prompts, with a KV cache and a
    checkpoint budget small enough that both evict, against fresh computation."""
    path, _ = checkpoint(family, **HYBRID)
    batches = _workload(1)
    expected = _run(LLMEngine(path, EngineConfig(prefix_caching=False)), [[p] for batch in batches for p in batch], 4)
    engine = LLMEngine(path, EngineConfig(prefix_caching=True, checkpoints="periodic", checkpoint_interval=16,
                                          kv_cache_tokens=384, prefill_chunk=32,
                                          checkpoint_bytes=6 * RecurrentStatePool.bytes_per_sequence(
                                              LLMEngine(path, EngineConfig(max_num_seqs=1)).model_config)))
    got = _run(engine, batches, 4)
    _assert_same(got, expected)
    stats = engine.stats()
    assert stats["checkpoint_evictions"] > 0 and sum(c > 0 for _, _, c in got) > 0
    assert stats["checkpoint_bytes"] <= stats["checkpoint_budget_bytes"]


def test_checkpoint_memory_stays_within_budget_over_a_long_session(checkpoint):
    """Twelve agent turns, with a budget of four checkpoints: the store never holds more, evicts as
    it goes, keeps restoring, and every turn's logits still equal a fresh prefill's."""
    path, _ = checkpoint("qwen3_5_moe", chat_format="agent", **HYBRID)
    tok = LLMEngine(path, EngineConfig(max_num_seqs=1)).tokenizer
    prompts = turn_prompts(tok, build_session(3, 12, result_words=(20, 60)), "openclaw")
    per = RecurrentStatePool.bytes_per_sequence(LLMEngine(path, EngineConfig(max_num_seqs=1)).model_config)
    engine = LLMEngine(path, EngineConfig(prefix_caching=True, checkpoints="anchors", checkpoint_bytes=4 * per,
                                          prefill_chunk=256))
    store = engine.scheduler.checkpoints
    peak = []
    add = store.add

    def watched_add(*args, **kwargs):
        result = add(*args, **kwargs)
        peak.append(store.used_bytes)
        assert store.used_bytes <= store.budget_bytes and store.count <= 4
        return result

    store.add = watched_add
    got = _run(engine, [[p] for p in prompts], 2)
    expected = _run(LLMEngine(path, EngineConfig(prefix_caching=False)), [[p] for p in prompts], 2)
    _assert_same(got, expected)
    assert max(peak) == 4 * per and store.evictions > 0
    assert sum(c > 0 for _, _, c in got[1:]) >= len(prompts) // 2


def test_hybrid_without_prefix_caching_recomputes_and_reports_no_checkpoints(checkpoint):
    path, _ = checkpoint("qwen3_next", **HYBRID)
    engine = LLMEngine(path, EngineConfig(prefix_caching=False))
    prompt = [random.Random(0).randrange(3, 380) for _ in range(100)]
    got = _run(engine, [[prompt], [prompt]])
    assert [c for _, _, c in got] == [0, 0]
    assert "checkpoints" not in engine.stats()
    with pytest.raises(ValueError, match="checkpoint_interval"):
        LLMEngine(path, EngineConfig(prefix_caching=True, checkpoint_interval=20))


def test_snapshots_that_would_be_evicted_at_once_are_not_taken():
    tree, nodes = _tree_nodes((8, 16, 24, 32))
    store = CheckpointStore(budget_bytes=2 * 400)
    planned = {40: frozenset(), 44: frozenset({"3:after"})}
    assert store.worth_taking(planned, 400) == planned  # room left: everything
    store.add(nodes[8], 8, _snapshot(400), frozenset({"3:after"}))
    store.add(nodes[16], 16, _snapshot(400), frozenset({"3:after"}))
    # Full of anchors: a periodic snapshot would be the first to go, an anchor of the same kind not.
    assert store.worth_taking(planned, 400) == {44: frozenset({"3:after"})}
    assert store.worth_taking(planned, 5000) == {}  # bigger than the budget


def _openai_messages(history: list[dict]) -> list[dict]:
    """A scripted session in the OpenAI wire format (call ids, JSON-string arguments)."""
    import json

    out = []
    for i, m in enumerate(history):
        m = {k: v for k, v in m.items() if k != "reasoning_content"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        if m["role"] == "tool":
            m["tool_call_id"] = f"call_{i - 1}"
        out.append(m)
    return out


def test_server_reports_restored_prompt_tokens_as_cached(checkpoint):
    """Over HTTP: a hybrid model behind the OpenAI and Anthropic APIs; the second request of an
    agent session (an edited, longer history) restores a checkpoint and says so in its usage."""
    import requests

    from tests.serving_helpers import running_server

    path, _ = checkpoint("qwen3_next", chat_format="agent", **HYBRID)
    history = _openai_messages(build_session(5, 3, result_words=(20, 40)))
    first, second = history[:4], history[:6]
    options = {"prefix_caching": True, "checkpoints": "anchors", "max_model_len": 4096}
    with running_server(path, options, scripted=False) as srv:
        usage = []
        for messages in (first, second):
            r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert 0 < usage[1]["prompt_tokens_details"]["cached_tokens"] < usage[1]["prompt_tokens"]
        r = requests.post(srv.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Task: " + "x " * 40}]})
        r2 = requests.post(srv.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Task: " + "x " * 40},
                                                          {"role": "assistant", "content": "ok"},
                                                          {"role": "user", "content": "again"}]})
        assert r.status_code == 200 and r2.status_code == 200, r.text + r2.text
        assert r2.json()["usage"]["cache_read_input_tokens"] > 0
