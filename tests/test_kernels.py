"""Native single-token CPU kernels against PyTorch, and the engine with them switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hearth.engine.experts.compute
import hearth.engine.layers.norm
import hearth.engine.ops
from hearth.engine import LLM
from hearth.engine.kernels.cpu import cpu_decode_ops
from tests.helpers import PROMPTS, greedy, hf_greedy, max_rel_error, record_logits, reference
from tests.kernel_builds import kernel_builds

ops = cpu_decode_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="native CPU kernels unavailable on this machine")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BUILDS = kernel_builds()  # every decode library this CPU runs (AVX2 forms included), the others skipped by name


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference measured in units of the dtype's spacing at the reference's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs() * eps).clamp_min(1e-30)).max())


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_decode_matches_torch(dtype, bias, build):
    torch.manual_seed(0)
    w = torch.randn(77, 300, dtype=dtype)
    x = torch.randn(1, 300, dtype=dtype)
    b = torch.randn(77, dtype=dtype) if bias else None
    ref, got = F.linear(x, w, b), build.linear_decode(x, w, b)
    assert got.dtype == dtype and got.shape == (1, 77)
    if dtype == torch.float32:
        assert max_rel_error(got, ref) < 1e-5
    else:
        assert ulps_apart(got, ref) <= 1.0  # only fp32 accumulation order differs


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference_formula(dtype, build):
    torch.manual_seed(2)
    x = torch.randn(5, 3, 96, dtype=dtype) * 3
    w = torch.randn(96, dtype=dtype)
    v = x.float()
    ref = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = build.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert max_rel_error(got, ref) < 1e-5
    else:
        assert ulps_apart(got, ref) <= 2.0


def reference_experts(x, gate_up, down, rows, weights):
    """The transformers formulation: per-expert projections, weighted, summed in fp32."""
    inter = down.shape[2]
    parts = []
    for j, r in enumerate(rows):
        g, u = F.linear(x, gate_up[r]).split(inter, dim=-1)
        parts.append(F.linear(F.silu(g) * u, down[r]) * weights[j : j + 1])
    return torch.cat(parts).sum(0, keepdim=True).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights_fp32", [False, True])
def test_experts_decode_matches_reference(dtype, weights_fp32, build):
    torch.manual_seed(1)
    gate_up = torch.randn(10, 2 * 48, 64, dtype=dtype) * 0.2
    down = torch.randn(10, 64, 48, dtype=dtype) * 0.2
    x = torch.randn(1, 64, dtype=dtype)
    rows = [7, 2, 9, 0]
    weights = torch.softmax(torch.randn(4), 0).to(torch.float32 if weights_fp32 else dtype)
    ref = reference_experts(x, gate_up, down, rows, weights)
    got = build.experts_decode(x, gate_up, down, rows, weights)
    assert max_rel_error(got, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_engine_without_kernels_matches_transformers(checkpoint, monkeypatch):
    monkeypatch.setattr(hearth.engine.experts.compute, "cpu_decode_ops", lambda: None)
    monkeypatch.setattr(hearth.engine.ops, "cpu_decode_ops", lambda: None)
    monkeypatch.setattr(hearth.engine.layers.norm, "cpu_decode_ops", lambda: None)
    path, _ = checkpoint("qwen2_moe")
    ref = reference(path)
    llm = LLM(path)
    recorded = record_logits(llm)
    ref_tokens, ref_logits = hf_greedy(ref, PROMPTS[0], 16)
    out = llm.generate(PROMPTS[0], greedy(16))[0]
    assert out.token_ids == ref_tokens
    for a, b in zip(recorded[out.request_id], ref_logits, strict=True):
        assert max_rel_error(a, b) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_token_half_linear_keeps_torch_numerics(dtype):
    from hearth.engine.ops import linear

    torch.manual_seed(3)
    w = torch.randn(64, 200, dtype=dtype)
    x = torch.randn(9, 200, dtype=dtype)
    b = torch.randn(64, dtype=dtype)
    ref, got = F.linear(x, w, b), linear(x, w, b)
    assert got.dtype == dtype and ulps_apart(got, ref) <= 1.0


def test_copy_rows_is_a_batched_row_gather():
    ops = cpu_decode_ops()
    if ops is None:
        pytest.skip("native kernels unavailable")
    src = torch.randn(10, 3, 70000).bfloat16()  # rows larger than one 64 KiB piece
    dst = torch.zeros(4, 3, 70000).bfloat16()
    ops.copy_rows(dst, torch.tensor([2, 0, 3]), src, torch.tensor([7, 1, 7]))
    assert torch.equal(dst[2], src[7]) and torch.equal(dst[0], src[1]) and torch.equal(dst[3], src[7])
    assert torch.equal(dst[1], torch.zeros_like(dst[1]))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.copy_rows(dst, torch.tensor([4]), src, torch.tensor([0]))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_linear_is_bit_identical_to_one_token_at_a_time(dtype):
    torch.manual_seed(3)
    w, b = torch.randn(96, 200).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(hearth.engine.ops.SMALL_BATCH, 200).to(dtype)
    together = hearth.engine.ops.linear(x, w, b)
    alone = torch.cat([hearth.engine.ops.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    assert torch.equal(together, alone)
    assert max_rel_error(together, F.linear(x.float(), w.float(), b.float())) < 1e-2


@needs_kernels
def test_small_batch_experts_are_bit_identical_to_one_token_at_a_time():
    torch.manual_seed(4)
    gate_up, down = torch.randn(6, 64, 48).bfloat16(), torch.randn(6, 48, 32).bfloat16()
    x = torch.randn(5, 48).bfloat16()
    rows = torch.tensor([[0, 3], [5, -1], [2, 2], [-1, -1], [1, 4]])
    weights = torch.rand(5, 2)
    together = hearth.engine.experts.compute.routed_partial_sum(x, gate_up, down, rows, weights, F.silu)
    alone = torch.cat([hearth.engine.experts.compute.routed_partial_sum(x[i : i + 1], gate_up, down, rows[i : i + 1],
                                                         weights[i : i + 1], F.silu) for i in range(5)])
    assert torch.equal(together, alone) and not together[3].any()
