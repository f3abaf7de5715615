"""Helpers for comparing the engine with transformers."""

from __future__ import annotations

import torch

from hearth.engine import LLM, SamplingParams
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


def run_resizing(llm: LLM, prompts: list[list[int]], tokens: int, resizes: dict[int, str]):
    """Greedy generation stepping the engine by hand, resizing its expert cache before the steps
    named in ``resizes`` (and checking the cache after each resize); (tokens, logits) per prompt."""
    engine = llm.engine
    recorded = record_logits(llm)
    ids = [engine.add_request(p, greedy(tokens)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    step = 0
    while engine.has_unfinished():
        if step in resizes:
            report = engine.resize_expert_cache(resizes[step])
            check_cache(engine, report)
        for output in engine.step():
            out[output.request_id] += output.chunk.token_ids
        step += 1
    return [out[rid] for rid in ids], [torch.stack(recorded[rid]) for rid in ids]


def check_cache(engine, report: dict[str, int]) -> None:
    """The tables, the arena and the report agree: every resident expert's weights are in its slot."""
    backend = engine.experts
    tables, device, pool = backend.tables, backend.device, backend.pool
    assert report["slots"] == tables.num_slots == device.num_slots == device.gate_up.shape[0]
    assert report["bytes"] == report["slots"] * pool.expert_bytes
    resident = tables.resident()
    assert len(resident) == report["kept"] <= report["slots"]
    for g, slot in resident.items():
        assert int(tables.slot_of[g]) == slot
        row = int(pool.row_table[g])
        # On a GPU the slots are device memory: compared on the host.
        assert torch.equal(device.gate_up[slot].cpu(), pool.gate_up[row]) \
            and torch.equal(device.down[slot].cpu(), pool.down[row])
    assert int((tables.slot_of[:-1] >= 0).sum()) == len(resident)
