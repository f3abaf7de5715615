"""Hugging Face FP8 block-scaled and MXFP4 checkpoints load as shipped: their quantized weights stay in
blocks (experts in the pool, FP8 attention projections as block weights), the results match
transformers on weights transformers itself dequantizes (fp32 log-probabilities within 1e-4, greedy
tokens equal), the expert hierarchy gives the plain engine's results, and what is wrong with a
checkpoint is a one-line error naming the file and the tensor."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hearth.engine import LLM
from hearth.engine.checkpoint.common import CheckpointError
from hearth.engine.checkpoint.hf import load_model
from hearth.engine.checkpoint.hf_quant import fp8_rows, mxfp4_rows
from hearth.engine.config import ConfigError
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.quant.registry import block_format, dequantize
from tests.checkpoints import make_checkpoint
from tests.helpers import greedy, max_rel_error
from tests.hf_quant_checkpoints import (
    assert_matches_transformers,
    float_checkpoint,
    fp8_reference,
    mxfp4_reference,
    quantize_fp8,
    read_tensors,
    write_fp8,
    write_mxfp4,
)
from tests.test_hierarchy import BATCH4, SPLIT_BANDWIDTHS, run

KERNELS = cpu_decode_ops() is not None
FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Factory: quantized(family, fmt) -> checkpoint directory (written once per module)."""
    root = tmp_path_factory.mktemp("hf-quant")
    floats, made = {}, {}

    def make(family: str, fmt: str) -> Path:
        if family not in floats:
            floats[family] = float_checkpoint(root, family)
        if (family, fmt) not in made:
            src, model = floats[family]
            dst = root / f"{family}-{fmt}"
            made[family, fmt] = write_fp8(src, dst) if fmt == "fp8" else write_mxfp4(model, src, dst)
        return made[family, fmt]

    return make


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_checkpoint_matches_transformers(quantized, family, fmt) -> None:
    path = quantized(family, fmt)
    ref = fp8_reference(path) if fmt == "fp8" else mxfp4_reference(path)
    llm, worst = assert_matches_transformers(ref, path)
    print(f"{family} {fmt}: first-token log-probabilities, max relative error {worst:.2e}")
    cfg = llm.engine.model_config
    assert cfg.dtype == torch.float32  # the default for quantized checkpoints (config.json says bf16)
    if not KERNELS:
        return
    pool, model = llm.engine.pool, llm.engine.runner.model
    name = "fp8_e4m3" if fmt == "fp8" else "mxfp4"
    assert pool.gate_up.dtype == pool.down.dtype == torch.uint8
    assert {(b.gate_up.name, b.down.name) for b in pool.blocks.values()} == {(name, name)}
    attn = model.model.layers[0].self_attn
    if fmt == "fp8":  # q/k/v fused from their blocks, o too; the output projection stays float
        assert attn.qkv_weight.dtype == attn.o_proj.weight.dtype == torch.uint8
        assert attn.qkv_weight.block_format.name == attn.o_proj.weight.block_format.name == "fp8_e4m3"
    else:  # GPT-OSS style: only the experts are MXFP4
        assert attn.qkv_weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.skipif(not KERNELS, reason="no native kernels here: quantized weights are decoded at load")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_pool_holds_the_checkpoints_blocks(quantized, family) -> None:
    """The banks hold the file's bytes repacked (uint8 blocks, not decoded floats), expert e of
    layer l at row l·E + e, gate rows then up rows; FP8 takes 8.25 bits a weight and MXFP4 4.25."""
    fp8, mx = load_model(quantized(family, "fp8")), load_model(quantized(family, "mxfp4"))
    cfg = fp8.config
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    t8, t4 = read_tensors(quantized(family, "fp8")), read_tensors(quantized(family, "mxfp4"))
    layer, expert = 1, 3
    row = fp8.pool.layer_rows(layer) + expert
    prefix = f"model.layers.{layer}." + ("mlp.experts" if family == "qwen3_moe" else "block_sparse_moe.experts")
    names = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    gate, up, down = (fp8_rows(t8[f"{prefix}.{expert}.{n}.weight"], t8[f"{prefix}.{expert}.{n}.weight_scale_inv"],
                               (128, 128)) for n in names)
    assert torch.equal(fp8.pool.gate_up[row], torch.cat([gate, up]).reshape(-1))
    assert torch.equal(fp8.pool.down[row], down.reshape(-1))
    blocks = f"model.layers.{layer}.mlp.experts"
    gate_up = mxfp4_rows(t4[f"{blocks}.gate_up_proj_blocks"][expert], t4[f"{blocks}.gate_up_proj_scales"][expert])
    assert torch.equal(mx.pool.gate_up[row], gate_up.reshape(-1))
    weights = len(cfg.moe_layer_ids) * e * 3 * i * h
    assert fp8.pool.nbytes == weights * 33 // 32 and mx.pool.nbytes == weights * 17 // 32
    # Decoded where blocks cannot stay (here: asked not to): the same values, as floats.
    for quant, fmt in ((fp8, "fp8_e4m3"), (mx, "mxfp4")):
        plain = load_model(quant.model_dir, keep_blocks=False)
        assert plain.pool.gate_up.dtype == torch.float32 and plain.pool.blocks is None
        f = block_format(fmt)
        decoded = dequantize(quant.pool.gate_up[row].view(2 * i, -1), f, h)
        assert torch.equal(plain.pool.gate_up[row], decoded)
        assert torch.equal(plain.pool.down[row], dequantize(quant.pool.down[row].view(h, -1), f, i))
        q_blocks = quant.model.model.layers[0].self_attn.q_proj.weight
        q_plain = plain.model.model.layers[0].self_attn.q_proj.weight
        assert torch.equal(q_plain, dequantize(q_blocks, f, h) if q_blocks.dtype == torch.uint8 else q_blocks)


def test_fused_fp8_experts_load_as_the_per_expert_ones(quantized, tmp_path) -> None:
    """``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` with their ``_scale_inv``: the same pool."""
    path = quantized("qwen3_moe", "fp8")
    src = path.parent / "qwen3_moe-float"
    fused = write_fp8(src, tmp_path / "fused", fused_experts=True)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in read_tensors(fused)
    a, b = load_model(path), load_model(fused)
    assert torch.equal(a.pool.gate_up, b.pool.gate_up) and torch.equal(a.pool.down, b.pool.down)


def test_bf16_compute_decodes_the_blocks(quantized) -> None:
    loaded = load_model(quantized("mixtral", "fp8"), dtype="bfloat16")
    assert loaded.pool.blocks is None and loaded.pool.gate_up.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


# -- the expert hierarchy -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_runs(quantized):
    """Factory: the plain engine's tokens and logits on BATCH4 for a quantized Qwen3-MoE checkpoint."""
    runs = {}

    def get(fmt: str):
        if fmt not in runs:
            plain = LLM(quantized("qwen3_moe", fmt), expert_device="none")
            runs[fmt] = run(plain, BATCH4, 16)
            plain.close()
        return runs[fmt]

    return get


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("capacity", ["0slots", "0.1", "0.37", "1.0"])
def test_quantized_experts_through_the_hierarchy_equal_the_plain_engine(quantized, plain_runs, fmt,
                                                                        capacity) -> None:
    path = quantized("qwen3_moe", fmt)
    llm = LLM(path, expert_device="virtual", expert_cache=capacity, q_mode="table",
              expert_bandwidths=SPLIT_BANDWIDTHS, stream_min_tokens=1 << 20)
    if KERNELS:
        assert llm.engine.pool.blocks is not None  # kept in blocks, not decoded for the hierarchy
    tokens, logits = run(llm, BATCH4, 16)
    ref_tokens, ref_logits = plain_runs(fmt)
    assert tokens == ref_tokens
    assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-5
    if capacity == "0.37":
        stats = llm.engine.stats()["experts"]
        assert stats["fills"] > 0 and stats["cpu"] > 0  # both paths ran
    llm.close()


# -- errors -------------------------------------------------------------------------------------------


def _edit(src: Path, dst: Path, drop: tuple[str, ...] = (), replace: dict | None = None,
          quantization: dict | None = None) -> Path:
    """A copy of checkpoint ``src`` with tensors dropped or replaced and its quantization_config
    updated with ``quantization`` (an empty dict: removed)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = f.keys()
            tensors = {k: f.get_tensor(k) for k in names if k not in drop}
        tensors.update({k: v for k, v in (replace or {}).items() if index["weight_map"].get(k) == shard.name})
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in drop}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    if quantization == {}:
        del cfg["quantization_config"]
    elif quantization:
        cfg["quantization_config"].update(quantization)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _one_line(exc_info, *parts: str) -> None:
    message = str(exc_info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message


def test_a_missing_scale_tensor_is_named(quantized, tmp_path) -> None:
    scale = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    bad = _edit(quantized("qwen3_moe", "fp8"), tmp_path / "fp8", drop=(scale,))
    with pytest.raises(CheckpointError) as exc:
        LLM(bad)
    _one_line(exc, "model-00001-of-00002.safetensors", "FP8 tensor 'model.layers.1.self_attn.k_proj.weight' has no "
              f"scale tensor '{scale}'")
    scales = "model.layers.2.mlp.experts.down_proj_scales"
    bad = _edit(quantized("mixtral", "mxfp4"), tmp_path / "mxfp4", drop=(scales,))
    with pytest.raises(CheckpointError) as exc:
        LLM(bad)
    _one_line(exc, "model-00001-of-00001.safetensors", f"has no scale tensor '{scales}'")


def test_a_scale_tensor_of_the_wrong_shape_is_named(quantized, tmp_path) -> None:
    path = quantized("qwen3_moe", "fp8")
    weight = "model.layers.0.mlp.experts.5.down_proj.weight"  # [256, 384]
    _, finer = quantize_fp8(torch.randn(256, 384), (64, 128))  # a 64x128 grid: [4, 3]
    bad = _edit(path, tmp_path / "fp8", replace={weight + "_scale_inv": finer})
    with pytest.raises(CheckpointError) as exc:
        LLM(bad)
    _one_line(exc, "model-00002-of-00002.safetensors", f"scale tensor '{weight}_scale_inv' has shape [4, 3], "
              "expected [2, 3] for weight [256, 384] in 128x128 tiles")
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    bad = _edit(quantized("qwen3_moe", "mxfp4"), tmp_path / "mxfp4",
                replace={name: torch.zeros(8, 768, 4, dtype=torch.uint8)})
    with pytest.raises(CheckpointError) as exc:
        LLM(bad)
    _one_line(exc, f"scale tensor '{name}' is U8 [8, 768, 4], expected U8 [8, 768, 8]")


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "gptq"}, "quantization_config quant_method 'gptq' is not supported (fp8 and mxfp4"),
    ({"fmt": "e5m2"}, "quantization_config fmt 'e5m2' is not supported"),
    ({"weight_block_size": [128, 64]}, "weight_block_size [128, 64]: tiles 64 columns wide are not whole "
                                       "128-element blocks"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
])
def test_an_unsupported_quantization_config_is_refused(quantized, tmp_path, change, message) -> None:
    bad = _edit(quantized("qwen3_moe", "fp8"), tmp_path / "bad", quantization=change)
    with pytest.raises(ConfigError) as exc:
        LLM(bad)
    _one_line(exc, f"{bad}/config.json: ", message)


def test_rows_that_are_not_whole_blocks_are_refused(tmp_path) -> None:
    """Rows of 192 elements under weight_block_size [128, 128]: the last tile of each row is partial,
    which hearth's 128-element blocks cannot hold."""
    src, _ = float_checkpoint(tmp_path, "mixtral", hidden_size=192, intermediate_size=128, num_hidden_layers=1)
    tensors = read_tensors(src)
    shards = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.q_proj.weight"):
            n, k = t.shape  # [192, 192]: padded to whole tiles to quantize, then cut back
            q, s = quantize_fp8(torch.nn.functional.pad(t, (0, 256 - k, 0, 256 - n)))
            shards[name], shards[name + "_scale_inv"] = q[:n, :k].contiguous(), s
        else:
            shards[name] = t
    for p in src.glob("*.safetensors"):
        p.unlink()
    (src / "model.safetensors.index.json").unlink()
    save_file(shards, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as exc:
        LLM(src)
    _one_line(exc, "model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' [192, 192]: rows of 192 "
              "elements are not whole 128-element blocks (weight_block_size [128, 128])")


def test_quantized_tensors_without_a_quantization_config_are_refused(quantized, tmp_path) -> None:
    bad = _edit(quantized("qwen3_moe", "fp8"), tmp_path / "bad", quantization={})
    with pytest.raises(CheckpointError, match="is stored as F8_E4M3"):
        LLM(bad)


def test_the_cli_reports_one_line_without_a_traceback(quantized, tmp_path) -> None:
    bad = _edit(quantized("qwen3_moe", "fp8"), tmp_path / "bad",
                drop=("model.layers.0.mlp.experts.2.up_proj.weight_scale_inv",))
    out = subprocess.run([sys.executable, "-m", "hearth.cli.main", "generate", "--model", str(bad), "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = re.findall(r"hearth: error: [^\r\n]*", out.stderr)  # after the progress bar's last update
    assert len(lines) == 1 and "has no scale tensor 'model.layers.0.mlp.experts.2.up_proj.weight_scale_inv'" in lines[0]


def test_gpt_oss_mxfp4_as_shipped_matches_transformers(tmp_path) -> None:
    """GPT-OSS's MXFP4 release layout (interleaved gate/up rows, expert biases in bf16): fp32 logits
    and greedy tokens against transformers with the experts decoded by its own MXFP4 code, also
    through the hierarchy."""
    from tests.hf_quant_checkpoints import write_gpt_oss_mxfp4

    src, model = make_checkpoint(tmp_path / "gpt-oss-float", "gpt_oss", hidden_size=64, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2)
    path = write_gpt_oss_mxfp4(model, src, tmp_path / "gpt-oss-mxfp4")
    ref = mxfp4_reference(path)
    llm, _ = assert_matches_transformers(ref, path)
    if KERNELS:  # the experts stay in their MXFP4 blocks, each row's fp32 biases after them
        blocks = llm.engine.pool.layer_blocks(0)
        assert blocks is not None and blocks.bias and blocks.gate_up.name == "mxfp4"
        assert llm.engine.pool.gate_up.shape[1] == blocks.gate_up_bytes + 8 * 64
    assert_matches_transformers(ref, path, expert_device="virtual", expert_cache="0.3")
    # A worker process computes float experts: the blocks are decoded, the biases a last column.
    decoded, _ = assert_matches_transformers(ref, path, expert_device="virtual", expert_cache="0.5",
                                             cpu_experts="process", host_pool_name=f"oss-{uuid.uuid4().hex[:8]}")
    assert decoded.engine.pool.blocks is None and decoded.engine.pool.gate_up.shape[-1] == 64 + 1
    decoded.close()
    if KERNELS:  # to FTW and back: the blocks and the biases after them, as they were
        from hearth.engine.checkpoint.dispatch import convert

        ftw = tmp_path / "gpt-oss-ftw"
        convert(path, ftw)
        prompt = list(range(40, 61))
        assert LLM(ftw).generate(prompt, greedy(16))[0].token_ids == llm.generate(prompt, greedy(16))[0].token_ids


def test_a_multimodal_checkpoints_language_model_quantization_is_read_too() -> None:
    """Kimi-K2.5 keeps its INT4 compressed-tensors config under text_config: refused by name, not as
    a heap of unexpected tensors."""
    from hearth.engine.checkpoint.hf_quant import quant_spec

    raw = {"architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": {"quantization_config": {"quant_method": "compressed-tensors"}}}
    with pytest.raises(ConfigError, match="quant_method 'compressed-tensors' is not supported"):
        quant_spec(raw, "/models/kimi")
    assert quant_spec({"text_config": {"hidden_size": 8}}, "/models/kimi") is None
