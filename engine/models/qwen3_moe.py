"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm and no bias, a softmax top-k router, no shared
expert; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say."""

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
class Qwen3MoeConfig(ModelConfig):
    qkv_bias: bool = False
    norm_topk_prob: bool = True


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Qwen3MoeConfig:
    n = hf.num_hidden_layers
    return Qwen3MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_layers=moe_layer_flags(n, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step),
        sliding_windows=(getattr(hf, "sliding_window", None) or None,) * n,
    )


def build(cfg: Qwen3MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.qkv_bias, qk_norm=norm, window=cfg.window(i), out_bias=cfg.qkv_bias)
        mlp = qwen_moe_block(cfg, i, experts, normalize=cfg.norm_topk_prob)
        return DecoderLayer(attn, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    return name


FAMILY = ModelFamily(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
)
