"""Long prompts never materialise [T, T] attention scores: every prefill chunk (a causal block,
or a later chunk's masked [chunk, context] block, with grouped-query heads and sliding windows)
runs through torch's CPU flash kernel, which tiles keys and keeps an online softmax."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from hearth.engine import LLM, SamplingParams

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _attention_ops(llm: LLM, prompt: list[int]) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_moe", {}),  # grouped-query attention
    ("mixtral", {"sliding_window": 24}),  # a window shorter than the prompt: a banded mask
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_prefill_runs_on_the_flash_kernel(checkpoint, family, overrides, dtype) -> None:
    path, _ = checkpoint(family, dtype=dtype, **overrides)
    llm = LLM(path, prefill_chunk=16, max_num_batched_tokens=16, max_model_len=256)
    ops = _attention_ops(llm, [(i * 13) % 90 + 3 for i in range(70)])  # 5 chunks, 4 of them masked
    assert FLASH in ops and MATH not in ops


def test_the_check_sees_the_math_kernel_when_it_runs(checkpoint) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path, prefill_chunk=16, max_num_batched_tokens=16, max_model_len=256)
    with sdpa_kernel(SDPBackend.MATH):
        assert MATH in _attention_ops(llm, list(range(3, 40)))


@pytest.mark.parametrize("heads, kv_heads, q_len, context", [(4, 2, 16, 70), (8, 2, 37, 300), (4, 4, 1, 9)])
def test_prefix_then_causal_equals_one_masked_call(heads, kv_heads, q_len, context) -> None:
    import torch
    import torch.nn.functional as F

    from hearth.engine.layers.attention import prefix_then_causal

    gen = torch.Generator().manual_seed(heads * context)
    q = torch.randn(heads, q_len, 32, generator=gen)
    k, v = (torch.randn(context, kv_heads, 32, generator=gen) for _ in range(2))
    mask = torch.ones(q_len, context, dtype=torch.bool).tril(context - q_len)
    ref = F.scaled_dot_product_attention(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                         enable_gqa=True, scale=32**-0.5)[0]
    got = prefix_then_causal(q, k, v, 32**-0.5)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
