"""Phi-3.5-MoE (``PhimoeForCausalLM``; shipped as ``PhiMoEForCausalLM``): Mixtral's layout and names
(``block_sparse_moe.experts.{e}.w1/w2/w3``) with LayerNorms that have biases (eps ``rms_norm_eps``),
biases on q/k/v/o and, where ``lm_head_bias``, on the output head; LongRoPE's short and long factors
and scales; SparseMixer's routing at inference (two experts, each weighted by a softmax over the
logits near its own, ``router_jitter_noise`` wide; two whatever ``num_experts_per_tok`` says, as in
transformers)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.moe import MoEBlock, SparseMixerRouter
from hearth.engine.layers.norm import BiasedLayerNorm
from hearth.engine.models import mixtral
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class PhimoeConfig(ModelConfig):
    attention_bias: bool
    lm_head_bias: bool
    jitter_eps: float


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> PhimoeConfig:
    n = hf.num_hidden_layers  # (SparseMixer routes to two experts whatever num_experts_per_tok says)
    return PhimoeConfig(
        architecture="PhimoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size, num_experts=hf.num_local_experts, top_k=2,
        moe_intermediate_size=hf.intermediate_size, moe_layers=(True,) * n,
        sliding_windows=(getattr(hf, "sliding_window", None) or None,) * n,
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        lm_head_bias=bool(getattr(hf, "lm_head_bias", False)),
        jitter_eps=float(getattr(hf, "router_jitter_noise", 0.01)),
    )


def build(cfg: PhimoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(BiasedLayerNorm, h, cfg.rms_norm_eps, dt)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                         out_bias=cfg.attention_bias, window=cfg.window(i))
        router = SparseMixerRouter(h, cfg.num_experts, dt, jitter_eps=cfg.jitter_eps)
        return DecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts), norm(), norm())

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(), lm_head_bias=cfg.lm_head_bias)


def map_name(name: str) -> str:
    """Mixtral's names (``block_sparse_moe``, ``w1/w2/w3``), or transformers 5's (``mlp.router``)."""
    return mixtral.map_name(name).replace(".mlp.router.", ".mlp.gate.")


FAMILY = ModelFamily(
    "phimoe",
    ("PhimoeForCausalLM", "PhiMoEForCausalLM"),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_local_experts",),),
)
