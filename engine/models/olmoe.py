"""OLMoE: attention whose q/k RMSNorms span each whole projection (not each head), optional q/k/v
clipping, a softmax top-k router (renormalised only where ``norm_topk_prob``), no shared expert;
its experts are ``intermediate_size`` wide and every layer is MoE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import ProjectionNormAttention
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, NormFactory, decoder_fields, softmax_moe_decoder
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True, kw_only=True)
class OlmoeConfig(ModelConfig):
    attention_bias: bool = False
    clip_qkv: float | None = None
    norm_topk_prob: bool = False


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> OlmoeConfig:
    return OlmoeConfig(
        architecture="OlmoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        clip_qkv=getattr(hf, "clip_qkv", None),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,  # the experts' own width
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def build(cfg: OlmoeConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int, norm: NormFactory) -> ProjectionNormAttention:
        return ProjectionNormAttention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                       norm=norm, clip=cfg.clip_qkv, bias=cfg.attention_bias)

    return softmax_moe_decoder(cfg, experts, attention, normalize=cfg.norm_topk_prob)


FAMILY = ModelFamily(
    "olmoe",
    ("OlmoeForCausalLM",),
    parse_config,
    build,
    required_fields=COMMON_FIELDS + (("num_experts", "num_local_experts"),),
)
