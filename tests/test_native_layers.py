"""Native decode layers (engine/layers/native.py, kernels/cpu/layer.h) against the module path they
replace: the same checkpoint run with HEARTH_NATIVE_LAYERS=0 and =1, logits compared step by step.

fp32: within 1e-5 relative (only fp32 summation order differs); bf16: bit for bit (the attention core
and the router's softmax stay torch's in half precision, the native parts round where the module path
does). Batches of several sequences of different lengths, blocks that are not
consecutive, sliding windows, dense layers, a shared expert with its gate, q/k/v bias, and block-quantized
weights (unfused q/k/v of a Q4_K_M mix) are all covered; each case also checks that the native layers ran.
"""

from __future__ import annotations

import pytest
import torch

from hearth.engine import LLM
from hearth.engine.layers.native import NativeLayers
from tests.helpers import greedy, max_rel_error, record_logits

pytestmark = pytest.mark.skipif(
    __import__("hearth.engine.kernels.cpu", fromlist=["cpu_decode_ops"]).cpu_decode_ops() is None,
    reason="native kernels not available on this machine")

_RUN, _RUN_ALL = NativeLayers.run, NativeLayers.run_all
PROMPTS = [[5, 17, 33, 99, 100, 3, 7], [300, 12, 12, 250, 8, 9, 10, 11, 12, 13, 14, 15, 16], list(range(40, 75))]


def _run(path, monkeypatch, native: bool, steps: int = 12, **options):
    """Logits of every step of PROMPTS decoded together, and how often each native kind ran."""
    monkeypatch.setenv("HEARTH_NATIVE_LAYERS", "1" if native else "0")
    counts = {True: 0, False: 0}

    def counted(self, index, h, step):
        ran = _RUN(self, index, h, step)
        if ran is not None:
            counts[ran] += 1
        return ran

    def counted_all(self, h, step):
        ran = _RUN_ALL(self, h, step)
        if ran:
            counts[True] += len(self.layers)
        return ran

    monkeypatch.setattr(NativeLayers, "run", counted)
    monkeypatch.setattr(NativeLayers, "run_all", counted_all)
    llm = LLM(str(path), **options)
    logits = record_logits(llm)
    outs = llm.generate(PROMPTS, greedy(steps))
    llm.close()
    by_request = [logits[o.request_id] for o in outs]
    return [o.token_ids for o in outs], by_request, counts


def _compare(path, monkeypatch, tol: float, expect_whole: bool = True, **options):
    tokens_m, logits_m, counts_m = _run(path, monkeypatch, False, **options)
    tokens_n, logits_n, counts_n = _run(path, monkeypatch, True, **options)
    assert counts_m == {True: 0, False: 0}
    assert counts_n[expect_whole] > 0, counts_n
    assert tokens_n == tokens_m
    for ours, ref in zip(logits_n, logits_m, strict=True):
        for a, b in zip(ours, ref, strict=True):
            assert max_rel_error(a, b) <= tol


CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-dense-layer": ("qwen3_moe", {"mlp_only_layers": [1]}),
    "qwen3_moe-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),
    "qwen2_moe-shared-bias": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_module_path(checkpoint, monkeypatch, case):
    family, overrides = CASES[case]
    path, _ = checkpoint(family, **overrides)
    _compare(path, monkeypatch, 1e-5)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-dense-layer", "qwen2_moe-shared-bias", "mixtral"])
def test_bf16_matches_module_path(checkpoint, monkeypatch, case):
    family, overrides = CASES[case]
    path, _ = checkpoint(family, dtype="bfloat16", **overrides)
    _compare(path, monkeypatch, 0.0)


def test_scattered_blocks(checkpoint, monkeypatch):
    """Small blocks shared out among three growing sequences are not consecutive: the native
    attention reads them through the block table."""
    path, _ = checkpoint("qwen3_moe")
    _compare(path, monkeypatch, 1e-5, block_size=4, kv_cache_tokens=512, prefill_chunk=4,
             max_num_batched_tokens=8)


def test_hierarchy_keeps_its_feed_forward(checkpoint, monkeypatch):
    """Behind the expert hierarchy the attention half runs natively and the MoE goes through the
    hierarchy's backend."""
    path, _ = checkpoint("qwen3_moe")
    _compare(path, monkeypatch, 1e-5, expect_whole=False, expert_device="virtual", expert_cache=0.37)


def test_block_weights(tmp_path, checkpoint, monkeypatch):
    """A Q4_K_M GGUF file (experts in Q4_K / Q6_K, q/k/v unfused where v is Q6_K) through the
    block-format kernels of the native layer."""
    from hearth.engine.checkpoint.gguf_writer import write_gguf

    path, _ = checkpoint("qwen3_moe", hidden_size=256, moe_intermediate_size=256, intermediate_size=512,
                         head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "model-q4_k_m.gguf"
    write_gguf(path, out, "q4_k_m")
    _compare(out, monkeypatch, 1e-5)


def test_descriptions_match_the_kernels():
    from hearth.engine.kernels.cpu import cpu_decode_ops
    from hearth.engine.layers.native import LAYER_FIELDS, STEP_FIELDS

    assert cpu_decode_ops()._decode.layer_desc_size() == (len(LAYER_FIELDS), len(STEP_FIELDS))
    assert torch.get_num_threads() >= 1
