"""The torch decoders of the block formats equal the ``gguf`` package's reference dequantizer,
on blocks the reference quantizer wrote and on random blocks (every bit pattern of the codes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth.engine.quant.registry import FORMATS, dequantize
from tests.block_data import random_blocks as _random_blocks

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decoder_equals_the_gguf_reference_on_random_blocks(name) -> None:
    rng = np.random.default_rng(len(name))
    data = _random_blocks(name, 6, 512, rng)
    qtype = gguf.GGMLQuantizationType(FORMATS[name].ggml_type)
    ref = gguf.quants.dequantize(data, qtype)
    got = dequantize(torch.from_numpy(data), name, 512).numpy()
    np.testing.assert_array_equal(got, ref.astype(np.float32))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4"])
def test_decoder_reads_what_the_reference_quantizer_wrote(name) -> None:
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType(FORMATS[name].ggml_type)
    data = gguf.quants.quantize(x, qtype)
    got = dequantize(torch.from_numpy(data), name, 256).numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, qtype))
    assert np.abs(got - x).max() < {"q8_0": 0.05, "q4_0": 0.5, "mxfp4": 1.0}[name]


def test_sizes_match_ggml_and_bad_shapes_are_refused() -> None:
    for fmt in FORMATS.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)] == (fmt.block_elems, fmt.block_bytes)
    with pytest.raises(ValueError, match="whole number"):
        FORMATS["q4_k"].row_bytes(300)
    with pytest.raises(ValueError, match="expected uint8 rows of 34 bytes"):
        dequantize(torch.zeros(2, 30, dtype=torch.uint8), "q8_0", 32)
    assert FORMATS["q4_k"].bits_per_weight() == 4.5


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4"])
def test_quantizer_writes_the_reference_quantizers_bytes(name) -> None:
    from hearth.engine.quant.registry import quantize

    x = np.random.default_rng(7).standard_normal((4, 512)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(FORMATS[name].ggml_type))
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), name).numpy(), ref)


@pytest.mark.parametrize("name, bound", [("q4_k", 0.12), ("q5_k", 0.06), ("q6_k", 0.03), ("q8_0", 0.01)])
def test_k_quants_are_read_alike_by_the_reference_and_stay_close(name, bound) -> None:
    from hearth.engine.quant.registry import quantize

    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 2, 1024)
    x[1, :256] = 0.0  # an all-zero super-block
    x[2] = x[2].abs()  # no negative values: a zero minimum
    data = quantize(x, name)
    got = dequantize(data, name, 1024)
    ref = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(FORMATS[name].ggml_type))
    np.testing.assert_array_equal(got.numpy(), ref)
    rel = ((got - x).norm(dim=1) / x.norm(dim=1).clamp(min=1e-9))
    assert rel.max() < bound, rel
    assert torch.equal(got[1, :256], torch.zeros(256))
