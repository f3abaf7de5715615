"""The native block-quantized kernels (every decode library this CPU runs) against the torch decoders: fp32
products on weights decoded by :func:`~hearth.engine.quant.registry.dequantize`, itself equal to
the ``gguf`` reference. Projections for 1 to 11 tokens, and routed experts for several tokens with
shared experts, mixed formats, padded bank rows and rows computed elsewhere; prefill's routed experts
(``experts_gemm``) for up to 70 tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth.engine.kernels import cpu as kernels
from hearth.engine.quant.registry import FORMATS, dequantize
from tests.block_data import expert_banks, random_blocks, reference_experts, routed_tokens
from tests.kernel_builds import kernel_builds

KERNEL_FORMATS = sorted(n for n, f in FORMATS.items() if f.kernel is not None)  # (the others are decoded at load)
_base = kernels.cpu_decode_ops()
pytestmark = pytest.mark.skipif(_base is None, reason="native kernels not available on this machine")


BUILDS = kernel_builds()


def _rows(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    data = random_blocks(name, rows, cols, np.random.default_rng(seed))
    if name == "mxfp4":  # finite products only: no 2^127 exponents (the decoders agree there too)
        blocks = data.reshape(-1, FORMATS[name].block_bytes)
        blocks[:, 0] = np.minimum(blocks[:, 0], 140)
    return torch.from_numpy(data)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item() or 1.0
    assert (got - want).abs().max().item() <= 1e-5 * scale, (got - want).abs().max().item() / scale


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_linear_blocks_equals_decoded_weights(ops, name) -> None:
    k, n = 512, 40
    w = _rows(name, n, k, 1)
    ref_w = dequantize(w, name, k)
    for m in (1, 2, 3, 8, 11):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        _close(ops.linear_blocks(x, w, name), x @ ref_w.T)


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(ops, name) -> None:
    """One token's products do not depend on the other tokens of the call, nor on whether its rows
    were paired (the one-token kernels interleave two rows; an odd row count leaves one alone)."""
    k, n = 512, 37
    w = _rows(name, n, k, 7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    together = ops.linear_blocks(x, w, name)
    for m in range(5):
        assert torch.equal(ops.linear_blocks(x[m : m + 1], w, name), together[m : m + 1])


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_dequantize_blocks_equals_the_torch_decoder(ops, name) -> None:
    """Prefill's native decode of rows of blocks, strided rows included (a bank row's experts), against
    the torch decoder: the same values but for the one fused rounding of q * scale + bias."""
    k, n = 512, 24
    w = _rows(name, n, k, 3)
    ref = dequantize(w, name, k)
    torch.testing.assert_close(ops.dequantize_blocks(w, name, k), ref, rtol=1e-6, atol=1e-7)
    padded = torch.cat([w, torch.zeros(n, 7, dtype=torch.uint8)], dim=1)[:, : w.shape[1]]  # stride > row bytes
    torch.testing.assert_close(ops.dequantize_blocks(padded, name, k), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize(("gu_fmt", "dn_fmt"), [(f, f) for f in KERNEL_FORMATS] + [("q4_k", "q6_k"),
                                                                                        ("q8_0", "q4_0")])
def test_experts_blocks_equals_decoded_experts(ops, gu_fmt, dn_fmt) -> None:
    hidden, inter, experts = 256, 512, 6
    gu, dn = expert_banks(_rows(gu_fmt, experts * 2 * inter, hidden, 2), _rows(dn_fmt, experts * hidden, inter, 3),
                          experts)
    for x, rows, weights in routed_tokens(hidden, experts):
        got = ops.experts_blocks(x, gu, dn, rows, weights, gu_fmt, dn_fmt, inter)
        _close(got, reference_experts(x, gu, dn, rows, weights, gu_fmt, dn_fmt, hidden, inter))


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize(("gu_fmt", "dn_fmt"), [(f, f) for f in KERNEL_FORMATS] + [("q4_k", "q6_k")])
def test_experts_gemm_equals_decoded_experts(ops, gu_fmt, dn_fmt) -> None:
    """Prefill's routed experts (fp32 activations, any token count): experts with 1 to 40 tokens, so
    whole and partial 16-token tiles, gate/up row counts not a multiple of the 6-row register block,
    and pairs computed elsewhere."""
    hidden, inter, experts = 256, 256, 5
    gu, dn = expert_banks(_rows(gu_fmt, experts * 2 * inter, hidden, 8), _rows(dn_fmt, experts * hidden, inter, 9),
                          experts)
    g = torch.Generator().manual_seed(5)
    for t in (9, 23, 70):
        x = torch.randn(t, hidden, generator=g)
        rows = torch.randint(0, experts, (t, 3), generator=g)
        rows[0, 1], rows[t - 1, 2] = -1, -1  # computed elsewhere
        weights = torch.rand(t, 3, generator=g)
        got = ops.experts_gemm(x, gu, dn, rows, weights, gu_fmt, dn_fmt, inter)
        _close(got, reference_experts(x, gu, dn, rows, weights, gu_fmt, dn_fmt, hidden, inter))


@pytest.mark.parametrize("ops", BUILDS)
def test_block_kernels_reject_what_they_cannot_read(ops) -> None:
    w = _rows("q8_0", 4, 64, 5)
    with pytest.raises(ValueError, match="linear_blocks"):
        ops.linear_blocks(torch.randn(1, 96), w, "q8_0")  # 96 columns are not 2 blocks
    gu, dn = _rows("q8_0", 2 * 64, 64, 6).reshape(2, -1), _rows("q8_0", 2 * 64, 32, 7).reshape(2, -1)
    x, weights = torch.randn(1, 64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="row out of"):
        ops.experts_blocks(x, gu, dn, torch.tensor([[2]]), weights, "q8_0", "q8_0", 32)
    with pytest.raises(ValueError, match="experts_blocks"):
        ops.experts_blocks(x, gu, dn, torch.tensor([[0]]), weights, "q8_0", "q8_0", 64)  # banks too small
    with pytest.raises(ValueError, match="row out of"):
        ops.experts_gemm(x, gu, dn, torch.tensor([[2]]), weights, "q8_0", "q8_0", 32)
    with pytest.raises(ValueError, match="experts_gemm"):
        ops.experts_gemm(x, gu, dn, torch.tensor([[0]]), weights, "q8_0", "q8_0", 64)  # banks too small
