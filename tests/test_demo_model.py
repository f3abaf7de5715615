"""The bundled, trained demo model: packaged, exact against transformers, writes Python, and routes
with real but realistic locality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.demo import DEMO_NAME, demo_model_dir
from tests.checkpoints import record_logits
from tests.helpers import hf_greedy, max_rel_error, reference

ROOT = Path(__file__).resolve().parents[1]
PYTHON_PROMPT = "def read_lines(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def demo() -> Path:
    return demo_model_dir()


def test_demo_model_ships_in_the_package(demo):
    assert demo.name == DEMO_NAME and demo.parent.name == "assets" and demo.parent.parent.name == "engine"
    assert '"assets/hearth-demo/*"' in (ROOT / "pyproject.toml").read_text()  # installed with the package
    assert (demo / "model.safetensors").stat().st_size <= 40 * 2**20
    cfg = json.loads((demo / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert "tool_call" in (demo / "tokenizer_config.json").read_text() + "".join(
        p.read_text() for p in demo.glob("chat_template*"))


def test_demo_model_matches_transformers(demo):
    """bf16, the same token path: our engine is forced along transformers' greedy tokens, and at
    every step its logits are close to transformers' and pick the same token wherever
    transformers' choice is clear (top-2 margin above two bf16 steps; a trained model meets exact
    ties, where either token is a correct greedy choice)."""
    ref = reference(demo, torch.bfloat16)
    with LLM(demo) as llm:
        prompt = llm.tokenizer.encode(PYTHON_PROMPT, add_special_tokens=False)
        ref_tokens, ref_logits = hf_greedy(ref, prompt, 32)

        def follow_reference(prompt_ids, output_ids, logits):
            forced = torch.full_like(logits, float("-inf"))
            forced[ref_tokens[len(output_ids)]] = 0.0
            return forced

        llm.engine.logits_processors = (follow_reference,)
        recorded = record_logits(llm)
        out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens
    clear = 0
    for ours, theirs in zip(recorded[out.request_id], ref_logits, strict=True):
        assert max_rel_error(ours, theirs) < 2e-2
        top2 = torch.topk(theirs.float(), 2).values
        if top2[0] - top2[1] > 2 * 2.0 ** (int(torch.log2(top2[0].abs())) - 7):
            assert int(ours.argmax()) == int(theirs.argmax())
            clear += 1
    assert clear >= 24


def test_demo_model_writes_python(demo):
    with LLM(demo) as llm:
        text = llm.generate(PYTHON_PROMPT, SamplingParams(max_tokens=80, temperature=0))[0].text
    assert "\n    " in text  # indented body
    assert any(word in text for word in ("return", "with open", "for ", "if ", "os.path")), text


def test_demo_model_routing_is_spread_with_real_locality(demo, tmp_path):
    """Per-layer usage entropy ≥ 80 % of log E; reuse between uniform routing and the random twin."""
    from bench.traces import random_twin, record_held_out, reuse_probability, usage_entropy

    trained = record_held_out(demo, "demo")  # 16 held-out files, 512 tokens each
    twin = record_held_out(random_twin(demo, tmp_path / "twin"), "twin")
    assert min(usage_entropy(trained)) >= 0.8
    uniform = trained.top_k / trained.num_experts
    assert uniform < reuse_probability(trained) < reuse_probability(twin)
