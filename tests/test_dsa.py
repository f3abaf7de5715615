"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) beyond the family suite: where its config is
refused, where a pipeline stage may not start, and that the sparse path decides the output."""

from __future__ import annotations

import json

import pytest
import torch

from hearth.config import ConfigError, EngineConfig
from hearth.engine import LLM, LLMEngine
from tests.helpers import greedy, hf_argmax, reference


def test_a_stage_cannot_start_at_a_layer_that_reuses_the_selection_before_it(checkpoint) -> None:
    path, _ = checkpoint("glm_moe_dsa")  # indexer_types: full, shared, full
    with pytest.raises(ConfigError, match="cannot start at layer 1"):
        LLMEngine(path, EngineConfig(), layers=(1, 3))


@pytest.mark.parametrize("change, message", [
    ({"q_lora_rank": 0}, "without q_lora_rank"),
    ({"indexer_types": ["shared", "full", "full"]}, "first layer cannot reuse"),
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types must name"),
])
def test_configs_sparse_attention_cannot_run_are_refused(checkpoint, tmp_path, change, message) -> None:
    path, _ = checkpoint("glm_moe_dsa")
    for item in path.iterdir():
        (tmp_path / item.name).symlink_to(item)
    raw = json.loads((path / "config.json").read_text()) | change
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        LLM(tmp_path)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_a_long_prompt_attends_sparsely_and_matches_transformers(checkpoint, family) -> None:
    """A 200-token prompt (each query keeps 6 of up to 232 tokens), prefilled in chunks of 16 with a
    second request beside it: the same greedy tokens as transformers, and not those of dense attention."""
    path, _ = checkpoint(family)
    prompt = [int(t) for t in torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(7))]
    ref_tokens, _ = hf_argmax(reference(path), prompt, 32)
    llm = LLM(path, config=EngineConfig(prefill_chunk=16, max_num_batched_tokens=24))
    outs = llm.generate([prompt, prompt[:40]], greedy(32))
    assert outs[0].token_ids == ref_tokens
    from transformers import AutoModelForCausalLM

    dense_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, index_topk=4096).eval()
    dense, _ = hf_argmax(dense_model, prompt, 32)
    assert dense != ref_tokens  # the selection matters here, so the match above tests it


def test_the_indexer_scores_a_long_context_in_blocks_as_at_once(monkeypatch) -> None:
    from hearth.engine.layers import dsa

    torch.manual_seed(0)
    indexer = dsa.TokenIndexer(32, 16, heads=4, head_dim=16, rope_dim=8, topk=5, interleaved=False,
                               dtype=torch.float32)
    for param in indexer.parameters():
        param.data.normal_()
    x, q_res, keys = torch.randn(7, 32), torch.randn(7, 16), torch.randn(300, 16)
    angles = torch.rand(7, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    whole = indexer.select(q_res, x, keys, cos, sin)
    monkeypatch.setattr(dsa, "SCORE_ELEMENTS", 1)  # 128 keys at a time: three blocks
    blocked = indexer.select(q_res, x, keys, cos, sin)
    assert blocked.shape == (7, 300) and int(blocked.sum()) == 7 * 5 and torch.equal(blocked, whole)
