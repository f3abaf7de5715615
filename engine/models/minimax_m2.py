"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): GQA attention whose q/k RMSNorms span each whole
projection, rotary on part of each head (``rotary_dim``); every layer MoE, routed by the sigmoid
of the gate's logits (in the model dtype) corrected by ``e_score_correction_bias`` for the choice,
the k weights renormalised; no shared expert. Checkpoints name the block ``block_sparse_moe`` and
the experts w1/w3/w2 (as Mixtral)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import ProjectionNormAttention
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models import mixtral
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(
        architecture="MiniMaxM2ForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,  # the experts' own width
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def build(cfg: ModelConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = ProjectionNormAttention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                       norm=norm)
        router = GroupedTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.dtype, logits_in_fp32=False)
        return DecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts), norm(cfg.hidden_size),
                            norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    """Mixtral's names, and the correction bias (the block's in checkpoints) moved to its router."""
    return mixtral.map_name(name).replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")


FAMILY = ModelFamily(
    "minimax_m2",
    ("MiniMaxM2ForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_local_experts",),),
)
