"""GGUF test files: tiny Hugging Face checkpoints written by hearth's own GGUF writer (the layout of
llama.cpp's converter; see :mod:`hearth.engine.gguf_writer`), and the check against transformers
loading the same file (which decodes it with the ``gguf`` package, independently of hearth)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth.engine import LLM, SamplingParams
from hearth.engine.gguf_writer import write_gguf

__all__ = ["assert_matches_transformers", "reference", "write_gguf"]
PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 31], list(range(40, 61))]


def reference(path: Path):
    """transformers on the GGUF file itself, with the widths its GGUF mapping leaves out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hearth.engine.gguf_file import GGUFFile
    from hearth.engine.gguf_loader import gguf_hf_config

    config = gguf_hf_config(GGUFFile(path))
    assert AutoConfig.from_pretrained(path.parent, gguf_file=path.name).num_experts == config.num_experts
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                dtype=torch.float32).eval()


def assert_matches_transformers(path: Path, **engine_options) -> LLM:
    """fp32: the first token's log-probability within 1e-4 of transformers on the same file, and 32
    greedy tokens equal, on 3 prompts. Returns the engine."""
    ref = reference(path)
    llm = LLM(path, **engine_options)
    assert llm.engine.model_config.moe_intermediate_size == ref.config.moe_intermediate_size
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0, -1]
        out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
        got = torch.log_softmax(want, -1)[out.token_ids[0]]
        assert out.chunk.logprobs[0].logprob == pytest.approx(float(got), abs=1e-4)
        tokens = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            expect = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
        assert list(tokens) == expect
    return llm
