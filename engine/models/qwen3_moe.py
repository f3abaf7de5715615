"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm and no bias, a softmax top-k router, no shared
expert; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.models import base
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(ModelConfig):
    qkv_bias: bool = False
    norm_topk_prob: bool = True


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        **base.decoder_fields(hf, model_dir, dtype),
        **base.qwen_moe_fields(hf),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        sliding_windows=(getattr(hf, "sliding_window", None) or None,) * hf.num_hidden_layers,
    )


def build(cfg: Qwen3MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int, norm: base.NormFactory) -> Attention:
        return Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.qkv_bias, qk_norm=norm, window=cfg.window(i), out_bias=cfg.qkv_bias)

    return base.softmax_moe_decoder(cfg, experts, attention, normalize=cfg.norm_topk_prob)


FAMILY = base.ModelFamily(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    parse_config,
    build,
    required_fields=base.COMMON_FIELDS + (("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
)
