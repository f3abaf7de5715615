"""GGUF files are checked up front, and their tensors come back as stored (block bytes in torch
layout) and decoded as the gguf package's own dequantizer decodes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hearth.engine.checkpoint.gguf_reader import GGUFError, GGUFFile  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, arch: str = "qwen3moe", tensors: dict | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, qtype) in (tensors or {}).items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantized(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.MXFP4):
        return gguf.quants.quantize(x, qtype)
    from hearth.engine.quant.registry import quantize  # the K-quants: the reference has no quantizer

    return quantize(torch.from_numpy(x), qtype.name.lower()).numpy()


def test_tensors_come_back_as_stored_and_decoded_like_the_reference(tmp_path) -> None:
    q8, q4k = _quantized(6, 64, Q.Q8_0), _quantized(4, 512, Q.Q4_K, seed=1)
    dense = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float16)
    _write(tmp_path / "m.gguf", tensors={"blk.0.a.weight": (q8, Q.Q8_0), "blk.0.b.weight": (q4k, Q.Q4_K),
                                         "token_embd.weight": (dense, Q.F16)})
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.architecture == "qwen3moe" and f.metadata("qwen3moe.block_count") == 1
    a, b, e = f.tensors["blk.0.a.weight"], f.tensors["blk.0.b.weight"], f.tensors["token_embd.weight"]
    assert (a.shape, a.format.name, b.shape, b.format.name, e.shape) == ((6, 64), "q8_0", (4, 512), "q4_k", (3, 5))
    assert torch.equal(a.raw(), torch.from_numpy(q8)) and a.raw().shape == (6, 68)
    np.testing.assert_array_equal(a.dequantized().numpy(), gguf.quants.dequantize(q8, Q.Q8_0))
    np.testing.assert_array_equal(b.dequantized().numpy(), gguf.quants.dequantize(q4k, Q.Q4_K))
    assert e.raw().dtype == torch.float16 and torch.equal(e.raw(), torch.from_numpy(dense))
    assert f.formats() == {"q8_0": q8.nbytes, "q4_k": q4k.nbytes, "float16": dense.nbytes}


def test_bad_files_get_one_line_errors_naming_file_and_problem(tmp_path) -> None:
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")
    _write(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(GGUFError, match=r"bert\.gguf: GGUF architecture 'bert' is not supported"):
        GGUFFile(tmp_path / "bert.gguf")
    iq2 = np.zeros((2, 66), dtype=np.uint8)  # two IQ2_XXS blocks of 256 elements
    _write(tmp_path / "iq2.gguf", tensors={"blk.0.x.weight": (iq2, Q.IQ2_XXS)})
    with pytest.raises(GGUFError, match="tensor 'blk.0.x.weight' has type IQ2_XXS, which hearth has no kernel for"):
        GGUFFile(tmp_path / "iq2.gguf")
    _write(tmp_path / "full.gguf", tensors={"blk.0.a.weight": (_quantized(64, 256, Q.Q8_0), Q.Q8_0)})
    whole = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf: .*truncated") as err:
        GGUFFile(tmp_path / "cut.gguf")
    assert "\n" not in str(err.value)
