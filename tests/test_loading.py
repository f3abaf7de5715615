"""Loading checkpoints: every malformed input fails with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.engine.checkpoint.common import CheckpointError
from hearth.engine.checkpoint.hf import load_model
from hearth.engine.config import ConfigError


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
    with pytest.raises(ConfigError, match="FancyNewMoeForCausalLM is not supported; supported: .*MixtralForCausalLM"):
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


def test_tensors_of_no_module_are_skipped_and_named(ckpt, caplog):
    """As transformers does: a stray tensor is left out with one log line that names it, and the
    model is the same as without it."""
    import logging

    reference = load_model(ckpt).model.state_dict()
    strays = {"model.layers.0.mystery.weight": torch.zeros(2), "foo.bar": torch.ones(3)}
    rewrite(ckpt, "model.norm.weight", lambda t: t.update(strays))
    with caplog.at_level(logging.INFO, logger="hearth.engine.checkpoint.hf"):
        loaded = load_model(ckpt)
    lines = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("skipped 2 tensors Qwen3MoeForCausalLM does not use: ")
    assert "belonging to no module: " in lines[0]
    assert "foo.bar" in lines[0] and "model.layers.0.mystery.weight" in lines[0]
    for (name, a), b in zip(loaded.model.state_dict().items(), reference.values(), strict=True):
        assert torch.equal(a, b), name


def test_a_stray_tensor_that_collides_with_a_real_name_is_still_refused(ckpt):
    """A name the model does have, in the wrong shape, is an error rather than a skip."""
    rewrite(ckpt, "model.norm.weight", lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' has shape \\[3\\]"):
        load_model(ckpt)


def test_model_type_without_architectures_loads_as_transformers_does(checkpoint, tmp_path):
    """No ``architectures`` in config.json: the family of transformers' causal-LM class for the
    ``model_type`` (AutoModelForCausalLM's choice), with the same weights and logits."""
    from hearth.engine.config import config_architectures

    for family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        src, _ = checkpoint(family)
        dst = tmp_path / family
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        named = cfg.pop("architectures")
        (dst / "config.json").write_text(json.dumps(cfg))
        assert config_architectures(cfg) == named
        a, b = load_model(src), load_model(dst)
        assert b.config.architecture == a.config.architecture == named[0]
        for (name, x), y in zip(b.model.state_dict().items(), a.model.state_dict().values(), strict=True):
            assert torch.equal(x, y), name


def test_a_model_type_transformers_has_no_causal_lm_for_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("architectures")
    cfg["model_type"] = "no_such_model_type"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no architecture"):
        load_model(ckpt)


def test_unused_tensors_are_skipped_with_one_log_line(ckpt, caplog):
    """Multi-token-prediction layers (numbered past the last layer, or under ``mtp.``), rotary
    caches and vision towers load as skipped, named in one log line; the model is unchanged."""
    import logging

    reference_model = load_model(ckpt).model
    extra = {"model.layers.3.self_attn.q_proj.weight": torch.zeros(2), "model.layers.3.eh_proj.weight": torch.zeros(2),
             "mtp.fc.weight": torch.zeros(2), "model.visual.blocks.0.attn.qkv.weight": torch.zeros(2),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(2)}
    rewrite(ckpt, "model.norm.weight", lambda t: t.update(extra))
    with caplog.at_level(logging.INFO, logger="hearth.engine.checkpoint.hf"):
        loaded = load_model(ckpt)
    lines = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("skipped 5 tensors Qwen3MoeForCausalLM does not use: ")
    for group in ("model.layers.3.* (2)", "mtp.* (1)", "model.visual.* (1)", "model.layers.0.* (1)"):
        assert group in lines[0]
    for (name, a), b in zip(loaded.model.state_dict().items(), reference_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


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
def test_missing_size_field_takes_the_default_and_is_refused(ckpt, field):
    """transformers' default for a missing size does not fit the tensors: a clear mismatch error."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop(field)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match its config"):
        load_model(ckpt)


def test_config_field_with_a_default_is_optional(checkpoint, tmp_path):
    """Mixtral without num_experts_per_tok: transformers' default (2) applies, as when it loads."""
    from hearth.engine import LLM
    from tests.helpers import greedy, hf_argmax, reference

    path = tmp_path / "mixtral"
    shutil.copytree(checkpoint("mixtral", num_experts_per_tok=2)[0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("num_experts_per_tok")
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(path).config.top_k == 2
    tokens, _ = hf_argmax(reference(path), [5, 17, 33, 99], 8)
    assert LLM(path).generate([5, 17, 33, 99], greedy(8))[0].token_ids == tokens


def test_unsupported_rope_type_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}  # (no fixed alpha)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported"):
        load_model(ckpt)
