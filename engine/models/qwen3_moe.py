"""Qwen3-MoE: q/k RMSNorm, no attention bias, softmax top-k router, no shared expert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, moe_layer_flags


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm=True,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_weights_in_fp32=False,
        shared_expert_intermediate_size=0,
        moe_layers=moe_layer_flags(n, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step),
        sliding_windows=(window or None,) * n,
    )


def map_name(name: str) -> str:
    return name


FAMILY = ModelFamily(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    parse_config,
    map_name,
    COMMON_FIELDS + (("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
)
