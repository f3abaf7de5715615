"""``bench/peers.py batch`` on a tiny GGUF file: the figures it reports are there and consistent
(hearth alone; the llama.cpp peer needs the ``peers`` extra and is not run here)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

pytest.importorskip("gguf")

from bench.peers_batch import batch  # noqa: E402
from hearth.engine.checkpoint.gguf_writer import write_gguf  # noqa: E402

SHAPE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def test_batch_reports_speedup_shares_and_the_kernel_bound(tmp_path, checkpoint, capsys) -> None:
    hf, model = checkpoint("qwen3_moe", **SHAPE)
    path = write_gguf(hf, tmp_path / "m-q8_0.gguf", "q8_0")
    out = tmp_path / "b.json"
    args = argparse.Namespace(file=path, streams=2, rounds=1, prompt=8, tokens=4, threads=1, dtype=None,
                              int8_activations=False, flush_cache=True, peer=False, json=out)
    assert batch(args) == 0
    result = json.loads(out.read_text())
    assert result["aggregate_tok_s"] > 0 and result["one_stream_tok_s"] > 0
    assert math.isclose(result["speedup"], result["aggregate_tok_s"] / result["one_stream_tok_s"])
    # Two streams route to at least as many distinct experts as one, at most twice top-k per layer.
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert 0 < result["distinct_experts_per_step"] <= 2 * top_k * layers
    assert result["bytes_per_step"] > 0 and 0 < result["roofline_share"] < 10
    kernel = result["expert_kernel_bytes_per_s"]
    assert math.isnan(kernel) or kernel > 0
    assert "llama_cpp" not in result
    assert "streams vs 1" in capsys.readouterr().out
