"""The block-format registry (engine/quant/registry.py): a format is one module and one registry
entry. A toy format (tests/toy_block_format.py) registered by one line round-trips exactly through
the generic paths that look formats up by name (quantize, dequantize, the FTW writer and reader), and
the real registry is untouched afterwards. The tables the engine keeps per format are the ones the
formats' modules declare, and each kernel entry names its struct and code in kernels/cpu/blocks.h."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hearth.engine.checkpoint.common import replace_parameter
from hearth.engine.checkpoint.ftw import load_ftw, read_index
from hearth.engine.checkpoint.ftw_writer import write_ftw
from hearth.engine.checkpoint.gguf_writer import MIXES
from hearth.engine.checkpoint.hf import load_model
from hearth.engine.kernels.cpu import BLOCK_CODES, int8_mode
from hearth.engine.ops import block_weight, decode_blocks
from hearth.engine.quant import registry
from hearth.engine.quant.block import BlockFormat, Registry
from tests import toy_block_format as toy
from tests.checkpoints import make_checkpoint

BLOCKS_H = Path(__file__).resolve().parents[1] / "engine" / "kernels" / "cpu" / "blocks.h"


@pytest.fixture
def with_toy(monkeypatch):
    """The real registry plus the toy format, for one test (the one registry line)."""
    monkeypatch.setattr(registry, "REGISTRY", registry.REGISTRY.adding(toy.FORMAT))
    return monkeypatch


def on_the_grid(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values the toy format holds exactly: integers in [-127, 127], a ±127 in every block, times a
    power of two per block (so that d = amax / 127 is that power)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows * cols // 16, 16), generator=g).float()
    q[:, 0] = torch.where(torch.rand(q.shape[0], generator=g) < 0.5, -127.0, 127.0)
    scale = torch.exp2(torch.randint(-12, 4, (q.shape[0], 1), generator=g).float())
    return (q * scale).reshape(rows, cols)


def test_a_toy_format_round_trips_by_name(with_toy):
    x = on_the_grid(8, 64)
    blocks = registry.quantize(x, "toy_i8x16")
    assert blocks.dtype == torch.uint8 and blocks.shape == (8, toy.FORMAT.row_bytes(64)) == (8, 80)
    assert registry.block_format("toy_i8x16") is toy.FORMAT
    assert torch.equal(registry.dequantize(blocks, "toy_i8x16", 64), x)
    with_toy.undo()  # the registry as it was: the toy is gone, nothing else changed
    with pytest.raises(KeyError):
        registry.block_format("toy_i8x16")
    assert [f.name for f in registry.REGISTRY] == ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4", "fp8_e4m3",
                                                   "bf16", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k",
                                                   "iq4_xs"]


def test_ftw_stores_and_reads_a_toy_block_weight(tmp_path, with_toy):
    """A weight in the toy format is written by the FTW writer under the format's name and read back
    by name, kept in its blocks where blocks may stay (float32 with the native kernels) or decoded at
    load: the toy's exact values either way."""
    hf, _ = make_checkpoint(tmp_path / "hf", "qwen3_moe", num_hidden_layers=1, hidden_size=64,
                            moe_intermediate_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32)
    loaded = load_model(hf, "float32")
    name = "model.layers.0.self_attn.o_proj.weight"
    param = loaded.model.get_parameter(name)
    values = on_the_grid(*param.shape, seed=1)
    blocks = registry.quantize(values, "toy_i8x16")
    replace_parameter(loaded.model, param, block_weight(blocks, toy.FORMAT))
    write_ftw(loaded, tmp_path / "ftw")
    entry = read_index(tmp_path / "ftw")["tensors"][name]
    assert entry["format"] == "toy_i8x16" and entry["shape"] == list(blocks.shape)

    stored = load_ftw(tmp_path / "ftw").model.get_parameter(name)
    if stored.dtype == torch.uint8:  # kept: the same bytes, decoded as the projections decode them
        assert stored.block_format is toy.FORMAT and torch.equal(stored, blocks)
        stored = decode_blocks(stored, stored.block_format, param.shape[1])
    assert torch.equal(stored, values)


def test_the_tables_are_the_formats_declarations():
    formats = list(registry.REGISTRY)
    assert dict(BLOCK_CODES) == {f.name: f.kernel.code for f in formats if f.kernel is not None}
    assert {f.name for f in formats if f.int8_activations} == int8_mode.FORMATS
    assert dict(MIXES) == {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}
    assert set(registry.FORMATS) | set(registry.HEARTH_FORMATS) == {f.name for f in formats}


def test_kernel_entries_match_blocks_h():
    """Each format's kernel entry names a struct of kernels/cpu/blocks.h with that kCode, and the
    ``by_format`` switch dispatches it."""
    source = BLOCKS_H.read_text()
    codes = {m[1]: int(m[2]) for m in re.finditer(r"struct (\w+) \{\s*static constexpr int [^;]*kCode = (\d+)", source)}
    switch = set(re.findall(r"case (\w+)::kCode: fn\(\1\{\}\)", source))
    for fmt in registry.REGISTRY:
        if fmt.kernel is not None:
            assert codes.get(fmt.kernel.struct) == fmt.kernel.code, fmt.name
            assert fmt.kernel.struct in switch, fmt.name


def test_the_registry_refuses_clashes():
    q8 = registry.block_format("q8_0")
    with pytest.raises(ValueError, match="name"):
        registry.REGISTRY.adding(BlockFormat("q8_0", 16, 20, -1, decode=toy.decode))
    with pytest.raises(ValueError, match="GGML type"):
        Registry([q8, BlockFormat("other", 32, 34, q8.ggml_type, decode=toy.decode)])
    with pytest.raises(ValueError, match="lack"):
        Registry([BlockFormat("half_mix", 16, 20, -1, decode=toy.decode, mixes=(("toy_m", "base"),))])
