"""ERNIE-4.5 MoE (``Ernie4_5_MoeForCausalLM``: ERNIE-4.5-21B-A3B, -300B-A47B): plain GQA attention
whose rotary turns interleaved channel pairs, in fp32; dense layers before ``moe_layer_start_index``
(and off the ``moe_layer_interval`` steps); MoE layers routed by a softmax over an fp32 gate whose top
k are chosen on the probabilities plus ``e_score_correction_bias`` and weighed by the plain
probabilities, renormalised, in the model dtype; shared experts (``moe_num_shared_experts`` times the
expert width, ungated) beside the routed ones.

Checkpoints name the correction bias ``mlp.moe_statics.e_score_correction_bias`` [1, E] (transformers 5
moves it under ``mlp.gate.`` in memory; both are read) and the shared experts ``mlp.shared_experts``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.config import ConfigError
from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class ErnieMoeConfig(ModelConfig):
    shared_experts: int = 0


def moe_flags(hf: Any) -> tuple[bool, ...]:
    """Which layers are MoE: every ``moe_layer_interval``-th from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (inclusive; negative or absent: the last layer)."""
    n, step = hf.num_hidden_layers, max(int(getattr(hf, "moe_layer_interval", 1) or 1), 1)
    start = int(getattr(hf, "moe_layer_start_index", 0) or 0)
    end = getattr(hf, "moe_layer_end_index", None)
    end = n - 1 if end is None or int(end) < 0 else int(end)
    return tuple((i + 1) % step == 0 and start <= i <= end for i in range(n))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ErnieMoeConfig:
    if getattr(hf, "use_bias", False):
        raise ConfigError("Ernie4_5_MoeForCausalLM with use_bias=true (biases on every projection, the output "
                          "head's too) is not supported; the released checkpoints have none")
    return ErnieMoeConfig(
        architecture="Ernie4_5_MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.moe_num_experts,
        top_k=hf.moe_k,
        moe_intermediate_size=hf.moe_intermediate_size,
        moe_layers=moe_flags(hf),
        shared_experts=int(getattr(hf, "moe_num_shared_experts", 0) or 0),
        rope_in_fp32=True,  # (ERNIE turns q and k in fp32, then rounds them to the model dtype)
    )


def _router(cfg: ErnieMoeConfig) -> GroupedTopKRouter:
    # The gate is an fp32 weight in every checkpoint dtype; the correction bias is stored [1, E].
    router = GroupedTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, torch.float32, scoring="softmax",
                               weights_dtype=cfg.dtype)
    router.e_score_correction_bias = nn.Parameter(torch.zeros(1, cfg.num_experts), requires_grad=False)
    return router


def build(cfg: ErnieMoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    h, dt = cfg.hidden_size, cfg.dtype

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt)
        attn.interleaved_rope = True
        if not cfg.moe_layers[i]:
            mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
        else:
            shared = (GatedMLP(h, cfg.moe_intermediate_size * cfg.shared_experts, cfg.hidden_act, dt)
                      if cfg.shared_experts else None)
            mlp = MoEBlock(i, cfg.num_experts, _router(cfg), experts, shared)
        return DecoderLayer(attn, mlp, norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


_NAMES = (
    (re.compile(r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
)


def map_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


FAMILY = ModelFamily(
    "ernie4_5_moe",
    ("Ernie4_5_MoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("moe_num_experts", "num_experts"), ("moe_intermediate_size",)),
)
