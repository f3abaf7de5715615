"""Mellum (``MellumForCausalLM``, JetBrains): Qwen3-MoE's attention (per-head q/k norms before the rotary,
biases on q/k/v/o where ``attention_bias``) with sliding-window layers where ``layer_types`` says, each
layer type turning by a rotary table of its own (``rope_parameters`` per type: full layers 500000,
sliding ones 10000 by default); a softmax top-k router, dense layers where ``mlp_layer_types`` says. Its
multi-token-prediction layers (``mtp.*``) are skipped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig, parse_layer_ropes
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.models import base
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True, kw_only=True)
class MellumConfig(ModelConfig):
    attention_bias: bool = False
    norm_topk_prob: bool = True


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> MellumConfig:
    kinds, n = list(hf.layer_types), hf.num_hidden_layers
    rope, layer_ropes = parse_layer_ropes(hf.to_dict(), kinds)
    window = getattr(hf, "sliding_window", None) or None
    return MellumConfig(
        architecture="MellumForCausalLM",
        **{**base.decoder_fields(hf, model_dir, dtype), "rope": rope}, layer_ropes=layer_ropes,
        intermediate_size=hf.intermediate_size, num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
        moe_layers=tuple(kind == "sparse" for kind in hf.mlp_layer_types),
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds[:n]),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
    )


def build(cfg: MellumConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int, norm: base.NormFactory) -> Attention:
        return Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.attention_bias, out_bias=cfg.attention_bias, qk_norm=norm, window=cfg.window(i))

    return base.softmax_moe_decoder(cfg, experts, attention, normalize=cfg.norm_topk_prob)


FAMILY = base.ModelFamily("mellum", ("MellumForCausalLM",), parse_config, build,
                          required_fields=base.COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",)))
