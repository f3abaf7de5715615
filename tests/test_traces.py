"""Routing traces: file format, statistics, and recording checked against transformers' router."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.traces import (
    Trace,
    load,
    record_held_out,
    reuse_probability,
    save,
    summary,
    synthetic,
    uniform,
    usage_entropy,
)
from tests.helpers import reference


def test_save_load_round_trip(tmp_path):
    trace = synthetic(3, 16, 2, 50, 0.5, prompt=10)
    for name in ("t.jsonl", "t.jsonl.gz"):
        save(trace, tmp_path / name)
        back = load(tmp_path / name)
        assert back.name == trace.name and back.num_experts == 16
        assert np.array_equal(back.experts, trace.experts) and np.array_equal(back.decode, trace.decode)
        assert np.array_equal(back.segment, trace.segment)


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="not a hearth-routing-trace"):
        load(tmp_path / "x.jsonl")


def test_uniform_routing_statistics():
    trace = uniform(2, 32, 4, 3000, seed=1)
    assert abs(reuse_probability(trace) - 4 / 32) < 0.01
    assert min(usage_entropy(trace)) > 0.99


def test_constant_routing_statistics():
    experts = np.tile(np.array([[[1, 2]], [[1, 2]]], dtype=np.int16), (50, 1, 1)).reshape(100, 1, 2)
    trace = Trace("const", 8, experts, np.ones(100, dtype=bool), np.zeros(100, dtype=np.int32))
    assert reuse_probability(trace) == 1.0
    assert usage_entropy(trace)[0] == pytest.approx(math.log(2) / math.log(8))


def test_reuse_ignores_segment_boundaries():
    experts = np.array([[[0]], [[0]], [[1]], [[1]]], dtype=np.int16)
    trace = Trace("seg", 4, experts, np.ones(4, dtype=bool), np.array([0, 0, 1, 1], dtype=np.int32))
    assert reuse_probability(trace) == 1.0  # the 0 -> 1 change is across a boundary


def test_synthetic_locality_is_tunable():
    reuse = [reuse_probability(synthetic(2, 32, 4, 800, loc, seed=2)) for loc in (0.0, 0.4, 0.8)]
    assert reuse[0] < reuse[1] < reuse[2]
    assert abs(reuse[2] - 0.8) < 0.06
    with pytest.raises(ValueError):
        synthetic(2, 4, 8, 10, 0.5)


def test_recorded_trace_matches_transformers_router(checkpoint):
    """Every token's recorded experts equal the top-k of transformers' own router logits."""
    path, _ = checkpoint("qwen3_moe")
    trace = record_held_out(path, "tiny", segments=2, length=120, prompt=40)
    assert len(trace) == 240 and int(trace.decode.sum()) == 160
    hf = reference(path)
    from bench.traces import _held_out_texts
    from hearth.engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    texts = [t for t in _held_out_texts() if len(t) > 6 * 120][:2]
    for seg, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False)[:120]
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_router_logits=True)
        rows = trace.experts[trace.segment == seg]  # [120, L, k]
        for layer, logits in enumerate(out.router_logits):
            ref = torch.topk(logits.reshape(len(ids), -1), trace.top_k, dim=-1).indices.numpy()
            assert np.array_equal(np.sort(rows[:, layer], -1), np.sort(ref, -1)), f"layer {layer}"
    assert summary(trace)["tokens"] == 240
