"""Prefill streamed through whole-layer buffers equals the plain engine, and the pipeline overlaps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hearth.engine import LLM
from hearth.engine.experts.mechanism.streamer import LayerStreamer
from hearth.engine.experts.policy.qstar import PathCost, SplitCosts
from hearth.engine.experts.policy.streaming import expected_distinct, stream_min_tokens
from tests.helpers import greedy, max_rel_error, record_logits

OVERRIDES = {"num_experts": 16, "num_experts_per_tok": 4, "max_position_embeddings": 8192}
LENGTHS = [1, 63, 64, 65, 1000, 4097]
# B_P 10 GB/s, B_H 25 GB/s: decode steps split their misses between the paths.
BANDWIDTHS = (10e9, 25e9)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 380, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, steps: int = 3) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt alone (so buffers are borrowed and returned between prompts, and later prompts
    find experts cached by earlier ones): tokens and the logits of every step."""
    recorded = record_logits(llm)
    results = []
    for i, length in enumerate(LENGTHS):
        out = llm.generate([prompt_of(length, i)], greedy(steps))[0]
        results.append((out.token_ids, torch.stack(recorded[out.request_id])))
    return results


@pytest.fixture(scope="module")
def plain(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="none", max_model_len=4200)
    results = run(llm)
    llm.engine.close()
    return results


@pytest.mark.parametrize("chunk", [64, 512])
@pytest.mark.parametrize("mode", ["double", "single", "fallback"])
def test_streamed_prefill_equals_plain_engine(checkpoint, plain, chunk, mode):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    # 3 MoE layers x 16 experts = 48; two buffers need 32 slots, one needs 16.
    cache = {"double": "40slots", "single": "40slots", "fallback": "20slots"}[mode]
    llm = LLM(path, expert_device="virtual", expert_cache=cache, expert_bandwidths=BANDWIDTHS, prefill_chunk=chunk,
              max_model_len=4200, double_buffer=mode != "single", stream_min_tokens=32)
    got = run(llm)
    stats = llm.engine.stats()["experts"]
    per_layer = llm.engine.stats().get("prefill_layers")
    llm.engine.close()
    for (tokens, logits), (ref_tokens, ref_logits), length in zip(got, plain, LENGTHS, strict=True):
        assert tokens == ref_tokens, length
        assert max_rel_error(logits, ref_logits) <= 1e-5, length
    if mode == "fallback":
        assert "prefill_streamed_steps" not in stats  # 20 slots cannot hold two layers: the decode path
    else:
        assert stats["prefill_buffers"] == (2 if mode == "double" else 1)
        # Every chunk of >= 32 tokens streamed: 63..4097-token prompts, in chunks.
        chunks = sum(-(-n // chunk) - (1 if n % chunk and n % chunk < 32 else 0) for n in LENGTHS if n >= 32)
        assert stats["prefill_streamed_steps"] == chunks
        assert stats["prefill_layer_calls"] == 3 * chunks
        assert stats["prefill_in_place"] > 0  # later prompts found experts the earlier ones left cached
        assert [layer["calls"] for layer in per_layer] == [chunks] * 3
        assert all(layer["copy_seconds"] > 0 and layer["compute_seconds"] > 0 for layer in per_layer)
        assert 0.0 <= stats["prefill_hidden_share"] <= 1.0


class _Recorder:
    """Wraps a device: logs the order of copies and computes (layer of each copy by its slots)."""

    def __init__(self, device, streamer: LayerStreamer) -> None:
        self.device, self.streamer, self.events = device, streamer, []

    def copy_async(self, rows, slots):
        self.events.append(("copy", rows[0] // 16 if rows else None))
        return self.device.copy_async(rows, slots)

    def compute(self, x, pair_slot, weights, act, blocks=None):
        self.events.append(("compute", None))
        return self.device.compute(x, pair_slot, weights, act, blocks)

    def __getattr__(self, name):
        return getattr(self.device, name)


@pytest.mark.parametrize("buffers", [2, 1])
def test_next_layer_copy_starts_before_this_layer_computes(checkpoint, buffers):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="48slots", expert_bandwidths=BANDWIDTHS, prefill_chunk=64,
              double_buffer=buffers == 2, stream_min_tokens=32)
    streamer = llm.engine.experts.streamer
    streamer.device = _Recorder(streamer.device, streamer)
    llm.generate([prompt_of(192, 7)], greedy(1))  # three chunks of 64
    llm.engine.close()
    events = streamer.device.events
    computes = [i for i, e in enumerate(events) if e[0] == "compute"]
    assert len(computes) == 9  # 3 chunks x 3 MoE layers
    copies = [i for i, e in enumerate(events) if e[0] == "copy"]
    if buffers == 2:
        # Before compute j runs, the copy for layer j + 1 (across chunk boundaries too) has started.
        for j, at in enumerate(computes[:-1]):
            assert sum(c < at for c in copies) >= j + 2, events
    else:
        # One buffer: a layer's copy starts only after the previous layer has computed.
        for j, at in enumerate(computes):
            assert sum(c < at for c in copies) == j + 1, events


def test_buffers_come_from_the_cache_and_go_back_as_cached_experts(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="40slots", expert_bandwidths=BANDWIDTHS, prefill_chunk=64,
              stream_min_tokens=32)
    backend = llm.engine.experts
    llm.generate([prompt_of(130, 3)], greedy(4))
    tables = backend.tables
    resident = tables.resident()
    assert len(resident) == len(set(resident.values()))  # one slot per expert
    for g, slot in resident.items():
        assert int(tables.slot_of[g]) == slot and int(tables.expert_of[slot]) == g
    assert not backend.streamer.active  # decode steps gave the buffers back
    # The last two streamed layers' experts stayed cached (the decode steps may have evicted a few).
    assert len(resident) >= 16
    llm.engine.close()


def test_stream_threshold_follows_measured_costs():
    size = 3 * 2048 * 768 * 2
    fast = SplitCosts(size, PathCost(25e9), 60e9, cpu_pair_s=2e-4, device_pair_s=1e-6)
    slow = SplitCosts(size, PathCost(0.5e9), 60e9, cpu_pair_s=2e-4, device_pair_s=1e-6)
    t_fast = stream_min_tokens(fast, 128, 8, 0.0, 4096)
    t_slow = stream_min_tokens(slow, 128, 8, 0.0, 4096)
    assert 1 < t_fast < t_slow <= 4097  # a slower link needs a bigger step before streaming pays
    assert stream_min_tokens(fast, 128, 8, 1.0, 4096) == 1  # everything resident: nothing to move
    no_link = SplitCosts(size, None, 60e9)
    assert stream_min_tokens(no_link, 128, 8, 0.0, 4096) == 4097
    assert expected_distinct(128, 8, 1) == pytest.approx(8)
    assert expected_distinct(128, 8, 4096) == pytest.approx(128)


def test_threshold_from_costs_follows_the_monitor(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="40slots", expert_bandwidths=BANDWIDTHS)
    backend = llm.engine.experts
    assert backend.streamer is not None and backend.stream_threshold is not None
    assert backend.stream_min_tokens == backend.stream_threshold(backend.costs)
    # Fixed per-pair costs: the measured ones vary by machine, and on a loaded one streaming may never pay.
    backend.costs = replace(backend.costs, cpu_pair_s=2e-4, device_pair_s=1e-6)
    backend.set_bandwidths(*BANDWIDTHS)
    before = backend.stream_min_tokens
    assert before <= 4096
    backend.set_bandwidths(1e6, BANDWIDTHS[1])  # a link 10 000x slower: streaming whole layers stops paying
    assert backend.stream_min_tokens > before
    assert not backend.begin_step(min(backend.stream_min_tokens - 1, 4096), 0)
    llm.engine.close()
