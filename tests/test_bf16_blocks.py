"""hearth's ``bf16`` blocks: a bf16 GGUF file computed with fp32 activations keeps its weights as
stored. The native kernel (AVX2 and AVX-512 builds) against the torch decoder (a bf16 value widens
to fp32 exactly), and the loader keeping a bf16 file's tensors in them at the file's size; the
model's agreement with transformers is tests/test_gguf_load.py's (its bf16 file runs through these
blocks)."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import LLM, SamplingParams
from hearth.engine.quant.registry import HEARTH_FORMATS, dequantize
from tests.block_data import expert_banks, reference_experts, routed_tokens
from tests.gguf_checkpoints import write_gguf
from tests.kernel_builds import kernel_builds

BUILDS = kernel_builds()

BF16 = HEARTH_FORMATS["bf16"]


def bf16_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random bf16 values [rows, cols] as ``bf16`` block rows (uint8 [rows, 2 * cols])."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.05).to(torch.bfloat16).view(torch.uint8)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> None:
    scale = want.abs().max().item() or 1.0
    assert (got - want).abs().max().item() <= tol * scale, (got - want).abs().max().item() / scale


def test_the_torch_decoder_widens_exactly() -> None:
    values = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(dequantize(values.view(torch.uint8), "bf16", 64), values.float())
    assert BF16.row_bytes(64) == 128


@pytest.mark.parametrize("ops", BUILDS)
def test_linear_blocks_equals_the_widened_weights(ops) -> None:
    k, n = 1024, 40
    w = bf16_rows(n, k, 1)
    ref_w = dequantize(w, "bf16", k).double()
    for m in (1, 2, 3, 8, 11):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = ops.linear_blocks(x, w, "bf16")
        _close(got.double(), x.double() @ ref_w.T)
        assert torch.equal(ops.linear_blocks(x[:1], w, "bf16")[0], got[0])  # alone or in a batch
    assert torch.equal(ops.dequantize_blocks(w, "bf16", k), ref_w.float())


@pytest.mark.parametrize("ops", BUILDS)
def test_experts_blocks_equals_decoded_experts(ops) -> None:
    hidden, inter, experts = 256, 384, 5
    gu, dn = expert_banks(bf16_rows(experts * 2 * inter, hidden, 2), bf16_rows(experts * hidden, inter, 3), experts)
    for x, rows, weights in routed_tokens(hidden, experts):
        want = reference_experts(x, gu, dn, rows, weights, "bf16", "bf16", hidden, inter)
        _close(ops.experts_blocks(x, gu, dn, rows, weights, "bf16", "bf16", inter), want, 1e-5)


def test_a_bf16_file_stays_in_bf16_blocks(tmp_path, checkpoint) -> None:
    path, _ = checkpoint("qwen3_moe", hidden_size=128, moe_intermediate_size=64, intermediate_size=128,
                         head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    gguf = write_gguf(path, tmp_path / "m-bf16.gguf", "bf16")
    llm = LLM(str(gguf))  # GGUF's default: fp32 activations
    try:
        model = llm.engine.runner.model
        assert model.config.dtype == torch.float32
        weights = [p for p in model.parameters() if p.dtype == torch.uint8]
        assert weights and all(getattr(p, "block_format", None) == BF16 for p in weights)
        assert all(b.gate_up == BF16 and b.down == BF16 for b in llm.engine.pool.blocks.values())
        # No 2-D weight was widened to fp32 but the router's (f32 in the file).
        floats = [p for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2]
        assert all(p.shape[0] == model.config.num_experts for p in floats)
        out = llm.generate([[5, 17, 42]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        llm.close()
