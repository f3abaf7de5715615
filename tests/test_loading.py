"""Loading checkpoints: every malformed input fails with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.engine.config import ConfigError
from hearth.engine.loader import CheckpointError, load_model


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A private, writable copy of a tiny Qwen3-MoE checkpoint (per-expert layout, sharded)."""
    src, _ = checkpoint("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def shard_of(path: Path, tensor: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def rewrite(path: Path, tensor: str, edit) -> None:
    """Apply ``edit(tensors_dict)`` to the shard holding ``tensor`` and keep the index in sync."""
    shard = shard_of(path, tensor)
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if (path / v) != shard}
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    index_path.write_text(json.dumps(index))


def test_loads_sharded_checkpoint(ckpt):
    loaded = load_model(ckpt)
    assert loaded.config.architecture == "Qwen3MoeForCausalLM"
    assert len(list(ckpt.glob("*.safetensors"))) > 1


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FancyNewMoeForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="FancyNewMoeForCausalLM.*supported: MixtralForCausalLM"):
        load_model(ckpt)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_truncated_shard(ckpt):
    shard = shard_of(ckpt, "model.embed_tokens.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(ckpt)


def test_shard_with_garbage_header(ckpt):
    shard = shard_of(ckpt, "model.norm.weight")
    shard.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.1.self_attn.q_proj.weight"
    rewrite(ckpt, name, lambda t: t.__setitem__(name, torch.zeros(3, 5)))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[3, 5\]"):
        load_model(ckpt)


def test_wrong_expert_shape(ckpt):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    rewrite(ckpt, name, lambda t: t.__setitem__(name, torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    name = "model.layers.2.post_attention_layernorm.weight"
    rewrite(ckpt, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(ckpt)


def test_missing_expert(ckpt):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    rewrite(ckpt, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"):
        load_model(ckpt)


def test_extra_tensor(ckpt):
    rewrite(ckpt, "model.norm.weight", lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        load_model(ckpt)


def test_index_names_absent_shard(ckpt):
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-99999-of-99999.safetensors"):
        load_model(ckpt)


def test_unsupported_dtype(ckpt):
    with pytest.raises(ConfigError, match="unsupported dtype 'int3'"):
        load_model(ckpt, dtype="int3")


def test_dtype_override_converts_weights(ckpt):
    loaded = load_model(ckpt, dtype="bfloat16")
    assert loaded.pool.gate_up.dtype == torch.bfloat16
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "moe_intermediate_size"])
def test_missing_config_field_is_named(ckpt, field):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop(field)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"lacks the required field '{field}'"):
        load_model(ckpt)


def test_unsupported_rope_type_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0,
                              "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_type 'longrope' is not supported"):
        load_model(ckpt)
