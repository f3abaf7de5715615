"""Helpers for comparing the engine with transformers."""

from __future__ import annotations

import torch

from hearth.engine import SamplingParams
from tests.checkpoints import record_logits  # noqa: F401 - re-exported for the tests

PROMPTS = [
    [5, 17, 33, 99, 100, 3, 7, 200, 201, 45],
    [300, 12, 12, 250, 8],
    list(range(40, 110)),
]


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| — the relative error used throughout the suite."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def hf_greedy(model, prompt: list[int], steps: int):
    """transformers' greedy generation: (new token ids, per-step logits [steps, V])."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([x[0] for x in out.logits])


def hf_argmax(model, prompt: list[int], steps: int):
    """Plain argmax decoding with transformers' own cache: (new token ids, per-step logits [steps, V]).
    Unlike :func:`hf_greedy` (``min_new_tokens``) nothing is suppressed, so EOS may be chosen,
    as our ``ignore_eos`` greedy requests may choose it."""
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            last = out.logits[0, -1]
            tokens.append(int(last.argmax()))
            logits.append(last)
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def reference(path, dtype: torch.dtype = torch.float32):
    """The checkpoint loaded by transformers itself: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
