"""bench/random_hf.py writes big random checkpoints layer by layer; a small one must be what transformers
would have saved (every tensor present, none extra), with fresh layers, and hearth must match
transformers on it."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from bench.random_hf import write_random_hf
from hearth.engine import LLM
from tests.checkpoints import record_logits
from tests.helpers import greedy, hf_argmax, max_rel_error, reference

SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
             norm_topk_prob=True, initializer_range=0.02)


def test_a_layer_by_layer_checkpoint_loads_in_transformers_and_hearth_matches_it(tmp_path):
    out = write_random_hf(tmp_path / "m", SMALL, "float32", vocab_size=512)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    ref = reference(out)
    _, info = type(ref).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.{}.self_attn.q_proj.weight"
    with safe_open(out / index[name.format(1)], "pt") as one, safe_open(out / index[name.format(2)], "pt") as two:
        assert not torch.equal(one.get_tensor(name.format(1)), two.get_tensor(name.format(2)))
    prompt = [5, 17, 42, 99, 7]
    ref_tokens, ref_logits = hf_argmax(ref, prompt, 6)
    with LLM(out) as llm:
        recorded = record_logits(llm)
        result = llm.generate([prompt], greedy(6))[0]
    assert result.token_ids == ref_tokens
    assert max_rel_error(torch.stack(recorded[result.request_id]), ref_logits) <= 1e-4
