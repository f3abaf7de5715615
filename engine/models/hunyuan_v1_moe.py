"""HunYuan-MoE (``HunYuanMoEV1ForCausalLM``: Hunyuan-A13B): per-head q/k RMSNorms after the rotary
(``query_layernorm`` / ``key_layernorm``), a softmax top-k router over an fp32 gate (``gate.wg``),
renormalised, its weights in fp32; a shared MLP (``shared_mlp``, ``intermediate_size`` wide) beside
the experts in every layer; rotary with the fixed NTK ``alpha`` where the config gives one."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ConfigError, ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, renaming
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class HunYuanMoeConfig(ModelConfig):
    attention_bias: bool


def _per_model(hf: Any, name: str) -> int:
    """A field HunYuan may write per layer (``moe_topk``, ``num_experts``): one value for all layers,
    as transformers reads it."""
    value = getattr(hf, name)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"HunYuanMoEV1ForCausalLM with {name} differing by layer ({value}) is not supported")
        value = value[0]
    return int(value)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> HunYuanMoeConfig:
    return HunYuanMoeConfig(
        architecture="HunYuanMoEV1ForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size, num_experts=_per_model(hf, "num_experts"),
        top_k=_per_model(hf, "moe_topk"), moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * hf.num_hidden_layers, attention_bias=bool(getattr(hf, "attention_bias", False)),
    )


def build(cfg: HunYuanMoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                         out_bias=cfg.attention_bias, qk_norm=norm)
        attn.norm_after_rope = True
        # (the gate is an fp32 weight in every dtype, the input upcast to it; the weights stay fp32)
        router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, torch.float32, scoring="softmax",
                                   correction_bias=False)
        moe = MoEBlock(i, cfg.num_experts, router, experts, GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt))
        return DecoderLayer(attn, moe, norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


map_name = renaming(((".self_attn.query_layernorm.", ".self_attn.q_norm."),
                     (".self_attn.key_layernorm.", ".self_attn.k_norm."), (".mlp.gate.wg.", ".mlp.gate."),
                     (".mlp.shared_mlp.", ".mlp.shared_expert.")))


FAMILY = ModelFamily(
    "hunyuan_v1_moe",
    ("HunYuanMoEV1ForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS[:-1] + (("num_experts",), ("moe_topk",)),
)
