"""Qwen2-MoE: attention with q/k/v bias and no q/k norm, optional sliding-window layers, a softmax
top-k router and a shared expert behind a sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, moe_layer_flags, qwen_moe_block
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class Qwen2MoeConfig(ModelConfig):
    qkv_bias: bool = True
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Qwen2MoeConfig:
    n = hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    windows = tuple((hf.sliding_window or None) if kind == "sliding_attention" else None for kind in layer_types)
    return Qwen2MoeConfig(
        architecture="Qwen2MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_layers=moe_layer_flags(n, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step),
        sliding_windows=windows,
    )


def build(cfg: Qwen2MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.qkv_bias, window=cfg.window(i))
        mlp = qwen_moe_block(cfg, i, experts, normalize=cfg.norm_topk_prob,
                             shared_expert_size=cfg.shared_expert_intermediate_size)
        return DecoderLayer(attn, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    return name


FAMILY = ModelFamily(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",), ("shared_expert_intermediate_size",)),
)
