"""Flint (``FlintForCausalLM``): attention with per-head q/k norms, biases where ``attention_bias``, a
learned sink per head (scores, sinks and softmax in fp32), sliding-window layers that turn by the rotary
and global ones without it (``layer_types``); norms scaled in fp32 (GPT-OSS's); dense layers by Qwen's
``mlp_only_layers`` / ``decoder_sparse_step``, elsewhere experts chosen by the top k of the fp32 logits'
sigmoids (renormalised where ``norm_topk_prob``; the gate kept in fp32) beside an ungated shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Fp32SinkAttention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNormScaledInFp32
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, qwen_moe_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class FlintConfig(ModelConfig):
    attention_bias: bool
    norm_topk_prob: bool
    shared_expert_size: int
    nope_layers: tuple[bool, ...]


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> FlintConfig:
    kinds, n = list(hf.layer_types), hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or None
    return FlintConfig(
        architecture="FlintForCausalLM", **decoder_fields(hf, model_dir, dtype), **qwen_moe_fields(hf),
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds[:n]),
        nope_layers=tuple(kind != "sliding_attention" for kind in kinds[:n]),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        shared_expert_size=int(hf.shared_expert_intermediate_size or 0))


def build(cfg: FlintConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNormScaledInFp32, eps=cfg.rms_norm_eps, dtype=dt)

    def feed_forward(i: int) -> nn.Module:
        if not cfg.moe_layers[i]:
            return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
        router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, torch.float32, correction_bias=False,
                                   normalize=cfg.norm_topk_prob)  # (its weight kept in fp32, as shipped)
        shared = GatedMLP(h, cfg.shared_expert_size, cfg.hidden_act, dt) if cfg.shared_expert_size else None
        return MoEBlock(i, cfg.num_experts, router, experts, shared)

    def layer(i: int) -> DecoderLayer:
        attn = Fp32SinkAttention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                                 out_bias=cfg.attention_bias, qk_norm=norm, window=cfg.window(i))
        attn.use_rope = not cfg.nope_layers[i]
        return DecoderLayer(attn, feed_forward(i), norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


def map_name(name: str) -> str:
    """The sinks under their shipped name too (``self_attn.softmax_offset``)."""
    return name.replace(".self_attn.softmax_offset", ".self_attn.sinks")


FAMILY = ModelFamily("flint", ("FlintForCausalLM",), parse_config, build, map_name,
                     COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",)))
