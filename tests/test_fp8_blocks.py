"""hearth's ``fp8_e4m3`` blocks and the repacking of Hugging Face FP8 and MXFP4 tensors: the torch
decoder against transformers' own dequantization (bit for bit), and the native kernel (AVX2 and
AVX-512 builds) against the torch decoder, as tests/test_block_kernels.py does for GGML's formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth.engine.checkpoint.hf_quant import fp8_rows, mxfp4_rows
from hearth.engine.quant.registry import FORMATS, HEARTH_FORMATS, block_format, dequantize
from tests.block_data import expert_banks, random_blocks, reference_experts, routed_tokens
from tests.kernel_builds import kernel_builds

BUILDS = kernel_builds()

FP8 = HEARTH_FORMATS["fp8_e4m3"]


def random_fp8_rows(rows: int, cols: int, seed: int, extremes: bool = False) -> torch.Tensor:
    """Random ``fp8_e4m3`` rows: every e4m3 byte but the two NaN codes, scales from 2^-20 to 2^-2 (with
    ``extremes``, two blocks scaled by a subnormal fp32 scale and by 2^100)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, cols // 128, 128), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0x7E  # NaN -> 448
    scale = torch.exp2(torch.empty(rows, cols // 128, 1).uniform_(-20, -2, generator=g))
    if extremes:
        scale.view(-1)[:2] = torch.tensor([2.0**-130, 2.0**100])
    return torch.cat([scale.view(torch.uint8).reshape(rows, cols // 128, 4), q], -1).reshape(rows, -1).contiguous()


def test_fp8_repacking_decodes_to_transformers_values_bit_for_bit() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    # 300 rows: the last row tile is partial; 384 columns in 256-wide tiles: so is the last column tile.
    # [300, 384] in 128x256 tiles: the last row tile and the last column tile are partial.
    for shape, tile in [((256, 384), (128, 128)), ((300, 384), (128, 256)), ((2, 130, 256), (64, 128))]:
        w = (torch.randn(*shape, generator=g) * 3).to(torch.float8_e4m3fn)
        *lead, rows, k = w.shape
        scale = torch.rand(*lead, -(-rows // tile[0]), -(-k // tile[1]), generator=g) / 100
        packed = fp8_rows(w, scale, tile)
        assert packed.dtype == torch.uint8 and packed.shape == (*lead, rows, FP8.row_bytes(k))
        ours = dequantize(packed.reshape(-1, packed.shape[-1]), "fp8_e4m3", k).reshape(w.shape)
        want = _dequantize_fp8_weight(w, scale, list(tile), torch.float32)
        assert torch.equal(ours, want)


def test_mxfp4_repacking_decodes_to_transformers_values_bit_for_bit() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 8, 16), dtype=torch.uint8, generator=g)  # every nibble value
    scales = torch.randint(100, 150, (3, 40, 8), dtype=torch.uint8, generator=g)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # the smallest and a huge exponent
    rows = mxfp4_rows(blocks, scales)
    assert rows.shape == (3, 40, FORMATS["mxfp4"].row_bytes(256))
    ours = dequantize(rows.reshape(120, -1), "mxfp4", 256).reshape(3, 40, 256)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, R, K]
    assert torch.equal(ours, want)


def test_the_format_is_hearths_own() -> None:
    assert block_format("fp8_e4m3") is FP8 and FP8.bits_per_weight() == 8.25
    assert "fp8_e4m3" not in FORMATS  # no GGML type: never offered to the GGUF writer
    with pytest.raises(KeyError, match="unknown block format"):
        block_format("fp8_e5m2")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item() or 1.0
    assert (got - want).abs().max().item() <= 1e-5 * scale, (got - want).abs().max().item() / scale


@pytest.mark.parametrize("ops", BUILDS)
def test_fp8_kernel_reads_every_weight_exactly(ops) -> None:
    """Unit vectors read single weights: the kernel's decoding (fp16 by shift, scale times 2^8) is the
    torch decoder's, bit for bit, for every e4m3 byte and scales down to subnormal."""
    w = random_fp8_rows(6, 2048, 0, extremes=True)  # 6 · 16 blocks of 128 random bytes: all 254 codes appear
    x = torch.eye(2048)
    assert torch.equal(ops.linear_blocks(x, w, "fp8_e4m3"), dequantize(w, "fp8_e4m3", 2048).T)


@pytest.mark.parametrize("ops", BUILDS)
def test_fp8_linear_blocks_equals_decoded_weights(ops) -> None:
    k, n = 512, 40
    w = random_fp8_rows(n, k, 1)
    ref_w = dequantize(w, "fp8_e4m3", k)
    for m in (1, 2, 3, 8, 11):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        _close(ops.linear_blocks(x, w, "fp8_e4m3"), x @ ref_w.T)


def _rows(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    if name == "fp8_e4m3":
        return random_fp8_rows(rows, cols, seed)
    return torch.from_numpy(random_blocks(name, rows, cols, np.random.default_rng(seed)))


@pytest.mark.parametrize("ops", BUILDS)
@pytest.mark.parametrize(("gu_fmt", "dn_fmt"), [("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "q8_0"),
                                                ("q4_k", "fp8_e4m3")])
def test_fp8_experts_blocks_equals_decoded_experts(ops, gu_fmt, dn_fmt) -> None:
    hidden, inter, experts = 256, 384, 5
    gu, dn = expert_banks(_rows(gu_fmt, experts * 2 * inter, hidden, 2), _rows(dn_fmt, experts * hidden, inter, 3),
                          experts)
    for x, rows, weights in routed_tokens(hidden, experts):
        want = reference_experts(x, gu, dn, rows, weights, gu_fmt, dn_fmt, hidden, inter)
        _close(ops.experts_blocks(x, gu, dn, rows, weights, gu_fmt, dn_fmt, inter), want)
