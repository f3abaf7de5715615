"""Quantized experts through the expert hierarchy (virtual device): cache slots hold experts in
their blocks, fills copy the blocks, the CPU share and the device share compute from them, and
prefill streams them; the results equal the plain engine's on the same GGUF file at every cache
size (tokens equal, fp32 logits within 1e-5)."""

from __future__ import annotations

import pytest

from hearth.config import ConfigError
from hearth.engine import LLM
from hearth.engine.kernels.cpu import cpu_decode_ops
from tests.helpers import PROMPTS, max_rel_error
from tests.test_hierarchy import BATCH4, SPLIT_BANDWIDTHS, run

pytest.importorskip("gguf")
SHAPE = dict(hidden_size=256, moe_intermediate_size=512, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4, num_hidden_layers=3)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    from hearth.engine.checkpoint.gguf_writer import write_gguf
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("gguf-hier")
    hf, _ = make_checkpoint(root / "hf", "qwen3_moe", **SHAPE)
    path = write_gguf(hf, root / "m-q4_k_m.gguf", "q4_k_m")  # layer 2's down projections in Q6_K
    plain = LLM(path, expert_device="none")
    refs = {1: run(plain, PROMPTS[:1], 16), 4: run(plain, BATCH4, 16)}
    plain.close()
    return path, refs


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("capacity", ["0slots", "0.1", "0.37", "1.0"])
def test_quantized_experts_through_the_hierarchy_equal_the_plain_engine(q4_k_m, capacity, batch) -> None:
    path, refs = q4_k_m
    llm = LLM(path, expert_device="virtual", expert_cache=capacity, q_mode="table",
              expert_bandwidths=SPLIT_BANDWIDTHS, stream_min_tokens=1 << 20)
    if cpu_decode_ops() is not None:
        assert llm.engine.pool.blocks is not None  # kept in blocks, not decoded for the hierarchy
    tokens, logits = run(llm, PROMPTS[:1] if batch == 1 else BATCH4, 16)
    ref_tokens, ref_logits = refs[batch]
    assert tokens == ref_tokens
    assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-5
    stats = llm.engine.stats()["experts"]
    if capacity == "0.37":
        assert stats["fills"] > 0 and stats["cpu"] > 0  # both paths ran
    llm.close()


def test_prefill_streams_quantized_layers(q4_k_m) -> None:
    path, refs = q4_k_m
    # 3 MoE layers of 16 experts: two streaming buffers need 32 of the 40 slots.
    llm = LLM(path, expert_device="virtual", expert_cache="40slots", expert_bandwidths=SPLIT_BANDWIDTHS,
              stream_min_tokens=4)
    tokens, logits = run(llm, BATCH4, 16)
    assert tokens == refs[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, refs[4][1], strict=True)) <= 1e-5
    assert llm.engine.stats()["experts"]["prefill_streamed_steps"] > 0
    llm.close()


def test_worker_processes_get_float_experts(q4_k_m) -> None:
    """CPU worker processes compute float experts: with them the file's experts are decoded."""
    path, _ = q4_k_m
    import uuid

    llm = LLM(path, expert_device="virtual", expert_cache="0.1", cpu_experts="process",
              host_pool_name=f"test-q-{uuid.uuid4().hex[:8]}")
    assert llm.engine.pool.blocks is None
    llm.close()
    with pytest.raises(ConfigError):
        LLM(path, expert_device="virtual", cpu_experts="process")  # the shared pool needs a name
