"""Qwen2-MoE: q/k/v bias, a shared expert behind a sigmoid gate, optional sliding-window layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, moe_layer_flags


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    n = hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    windows = tuple((hf.sliding_window or None) if kind == "sliding_attention" else None for kind in layer_types)
    return ModelConfig(
        architecture="Qwen2MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        qk_norm=False,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_weights_in_fp32=False,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_layers=moe_layer_flags(n, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step),
        sliding_windows=windows,
    )


def map_name(name: str) -> str:
    return name


FAMILY = ModelFamily(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    parse_config,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",), ("shared_expert_intermediate_size",)),
)
