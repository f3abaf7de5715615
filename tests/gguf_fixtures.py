"""GGUF files of every family written by llama.cpp's own converter and quantizer
(``tools/make_gguf_fixtures.py``, committed under ``tests/fixtures/gguf``), and the tiny checkpoints
they were made from, made again here from the same recipe and seed: the tests' reference is
transformers on that checkpoint, and a file hearth did not write is what hearth reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3", "minimax_m2",
            "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v4", "dots1", "glm4_moe_lite", "granitemoe_shared",
            "ernie4_5_moe", "exaone_moe", "lfm2_moe", "granitemoehybrid",
            "afmoe", "cohere2_moe", "llama4", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "dbrx",
            "solar_open", "hy_v3", "mellum", "laguna")
# make_checkpoint's arguments beyond the family: bf16 weights (the converter's bf16 file is then
# lossless), and the tokenizer each family's converter expects.
RECIPES: dict[str, dict[str, Any]] = {
    "glm4_moe": {"chat_format": "glm"},
    "glm4_moe_lite": {"chat_format": "glm"},
    "glm_moe_dsa": {"chat_format": "glm"},
    "solar_open": {"chat_format": "solar"},
    "hy_v3": {"attention_bias": False, "mlp_bias": False},  # (as released: llama.cpp's hy_v3 has no biases)
    "mellum": {"mlp_layer_types": ["sparse"] * 3},  # (as released: llama.cpp's converter maps no dense MLP)
    # (as released: global layers every fourth from the first, which llama.cpp assumes, YaRN on them; no
    # router soft-cap, which llama.cpp has not)
    "laguna": {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
               "moe_router_logit_softcapping": 0.0,
               "rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "partial_rotary_factor": 0.5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # (llama.cpp's Kimi-Linear routes without groups: one, as Moonshot ships it)
    "kimi_linear": {"n_group": 1},
    # (llama.cpp takes every fourth layer global and always scales by muP: four layers, the last global)
    # (llama.cpp's constants: chunks of 8192, floor 8192, scale 0.1; llama3 rotary, written as rope_freqs)
    "llama4": {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "afmoe": {"num_hidden_layers": 4, "global_attn_every_n_layers": 4, "mup_enabled": True},
    # (the converter writes no routed scale and maps no output head: LFM2 ships unscaled and tied)
    "lfm2_moe": {"routed_scaling_factor": 1.0, "tie_word_embeddings": True},
    # (no sliding-window layer, as released: the converter writes no window for dots1)
    "dots1": {"max_window_layers": 3},
    # (llama.cpp holds GPT-OSS's SwiGLU clamp as a constant, 7.0, which every GPT-OSS checkpoint has)
    "gpt_oss": {"chat_format": "harmony", "swiglu_limit": 7.0},
    "deepseek_v4": {"chat_format": "deepseek_v4"},
    "minimax_m2": {"bos_token_id": None},  # (its config class's default, 200034, is past the tiny vocabulary)
    # YaRN with DeepSeek's attention scale, as every V2/V3 checkpoint ships it (V2-Lite's mscale 0.707)
    "deepseek_v2": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 0.707, "mscale_all_dim": 0.707}},
    "deepseek_v3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 1.0, "mscale_all_dim": 1.0}},
}
# The converter's flags per family: the hybrids' checkpoints here have no MTP layers to export.
CONVERTER_FLAGS: dict[str, tuple[str, ...]] = {"qwen3_next": ("--no-mtp",), "qwen3_5_moe": ("--no-mtp",)}
# Kimi-Linear's layers, dense layers and router as Moonshot's config names them.
_KIMI_LINEAR = {"first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
                "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 4,
                                       "short_conv_kernel_size": 4}}
# config.json fields a shipped checkpoint has and transformers' config class does not write.
SHIPPED_FIELDS: dict[str, dict[str, Any]] = {"deepseek_v4": {"num_hash_layers": 1}, "kimi_linear": _KIMI_LINEAR,
                                             # (DeepSeek-V3.2's router as its config.json names it)
                                             "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                                             # (GLM-4.7-Flash's dense first layer, as the converter reads it)
                                             "glm4_moe_lite": {"first_k_dense_replace": 1},
                                             # (Solar Open's full rotary, which the converter takes as half
                                             # where config.json does not name it)
                                             "solar_open": {"partial_rotary_factor": 1.0},
                                             # (Granite 4's own names for its layers, which the converter reads)
                                             "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"]}}


# Families whose converter reads a SentencePiece ``tokenizer.model`` only (as they ship one): the
# fixture checkpoint gets one beside its tokenizer.json (the tests prompt with token ids).
SENTENCEPIECE = ("ernie4_5_moe",)
# Families whose converter insists that the tokenizer adds a BOS token (DeepSeek-V3.2's ships so), which
# transformers 5 reads only from vocabulary files, not from tokenizer.json: GPT-2's files instead.
ADDS_BOS = ("deepseek_v32",)


# Tensor names a shipped checkpoint has where transformers saves others: Kimi-Linear's dense layers
# are ``mlp`` (transformers writes them under the MoE layers' ``block_sparse_moe``).
SHIPPED_NAMES = {"kimi_linear": lambda name: re.sub(r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj.",
                                                    name)}


def rename_tensors(path: Path, rename: Any) -> None:
    """Every tensor of the checkpoint at ``path`` renamed by ``rename(name)`` (shards and index)."""
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        save_file({rename(name): t for name, t in load_file(file).items()}, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def fixture_checkpoint(out_dir: Path, family: str) -> tuple[Path, Any]:
    """The checkpoint ``family``'s fixtures were made from (its directory, the transformers model)."""
    from tests.checkpoints import make_checkpoint, write_gpt2_files, write_sentencepiece

    path, model = make_checkpoint(out_dir, family, dtype="bfloat16", seed=0, **RECIPES.get(family, {}))
    if family in SENTENCEPIECE:
        write_sentencepiece(path)
    if family in ADDS_BOS:
        write_gpt2_files(path)
    if family in SHIPPED_NAMES:
        rename_tensors(path, SHIPPED_NAMES[family])
    if family in SHIPPED_FIELDS:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **SHIPPED_FIELDS[family]}, indent=2))
    return path, model


def fixture_model(out_dir: Path, family: str) -> Any:
    """transformers' model of the fixture checkpoint, in fp32 as loaded from the directory (a bf16
    model cast with ``.float()`` would keep its buffers, the rotary frequencies among them, rounded)."""
    import torch
    from transformers import AutoModelForCausalLM

    path, _ = fixture_checkpoint(out_dir, family)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def fixture(family: str, kind: str) -> Path:
    """The fixture file of ``family`` in ``kind`` (bf16, q8_0, q4_k_m)."""
    return FIXTURES / f"{family}-{kind}.gguf"
