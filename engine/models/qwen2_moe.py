"""Qwen2-MoE: attention with q/k/v bias and no q/k norm, optional sliding-window layers, a softmax
top-k router and a shared expert behind a sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.models.base import (
    COMMON_FIELDS,
    ModelFamily,
    NormFactory,
    decoder_fields,
    qwen_moe_fields,
    softmax_moe_decoder,
)
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True, kw_only=True)
class Qwen2MoeConfig(ModelConfig):
    qkv_bias: bool = True
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Qwen2MoeConfig:
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    windows = tuple((hf.sliding_window or None) if kind == "sliding_attention" else None for kind in layer_types)
    return Qwen2MoeConfig(
        architecture="Qwen2MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        **qwen_moe_fields(hf),
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        sliding_windows=windows,
    )


def build(cfg: Qwen2MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int, norm: NormFactory) -> Attention:
        return Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.qkv_bias, window=cfg.window(i))

    return softmax_moe_decoder(cfg, experts, attention, normalize=cfg.norm_topk_prob,
                               shared_expert_size=cfg.shared_expert_intermediate_size)


FAMILY = ModelFamily(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    parse_config,
    build,
    required_fields=COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",),
                                     ("shared_expert_intermediate_size",)),
)
