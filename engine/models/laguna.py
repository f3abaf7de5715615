"""Laguna (``LagunaForCausalLM``): attention with per-head q/k norms, biases where ``attention_bias``, a
query-head count per layer, sliding-window layers where ``layer_types`` says, each layer type turning by
its own rotary (global layers on half of each head by default), and an output gate: the softplus (in
fp32) of a projection of the layer's input, per head or per channel (``gating``). Dense layers by
``mlp_layer_types``; elsewhere a sigmoid router over the model-dtype logits (soft-capped where
``moe_router_logit_softcapping``) choosing with a correction bias, its weights renormalised in the model
dtype, the routed sum times ``moe_routed_scaling_factor`` beside an ungated shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import ConfigError
from hearth.engine.config import ModelConfig, parse_layer_ropes
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import linear


@dataclass(frozen=True, kw_only=True)
class LagunaConfig(ModelConfig):
    heads_per_layer: tuple[int, ...]
    attention_bias: bool
    gate_per_head: bool
    shared_expert_size: int
    routed_scale: float
    router_softcap: float


class SoftplusGatedAttention(Attention):
    """Attention whose output is scaled by ``softplus(g_proj(x))`` (computed in fp32, rounded to the model
    dtype) before ``o_proj``: one gate a head, broadcast over its channels, or one a channel."""

    def __init__(self, *args, per_head: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.per_head = per_head
        width = self.num_heads if per_head else self.num_heads * self.head_dim
        self.g_proj = Projection(self.q_proj.weight.shape[1], width, False, self.o_proj.weight.dtype)

    def gate_of(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.g_proj.weight)  # [T, heads] or [T, heads * D]

    def project_out(self, out: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        gate = F.softplus(extra.float()).to(out.dtype)
        if self.per_head:
            out = (out.view(out.shape[0], self.num_heads, self.head_dim) * gate[..., None]).view(out.shape)
        else:
            out = out * gate
        return linear(out, self.o_proj.weight, self.o_proj.bias)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> LagunaConfig:
    if getattr(hf, "moe_apply_router_weight_on_input", False):
        raise ConfigError("Laguna with moe_apply_router_weight_on_input is not supported (transformers neither)")
    kinds, n = list(hf.layer_types), hf.num_hidden_layers
    rope, layer_ropes = parse_layer_ropes(hf.to_dict(), kinds[:n])
    window = getattr(hf, "sliding_window", None) or None
    heads = tuple(hf.num_attention_heads_per_layer or [hf.num_attention_heads] * n)
    return LagunaConfig(
        architecture="LagunaForCausalLM", **{**decoder_fields(hf, model_dir, dtype), "rope": rope},
        layer_ropes=layer_ropes, intermediate_size=hf.intermediate_size, num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
        moe_layers=tuple(kind == "sparse" for kind in hf.mlp_layer_types[:n]),
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds[:n]),
        heads_per_layer=heads, attention_bias=bool(hf.attention_bias),
        gate_per_head=hf.gating is True or hf.gating == "per-head",
        shared_expert_size=int(hf.shared_expert_intermediate_size or 0),
        routed_scale=float(hf.moe_routed_scaling_factor), router_softcap=float(hf.moe_router_logit_softcapping or 0))


def build(cfg: LagunaConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def feed_forward(i: int) -> nn.Module:
        if not cfg.moe_layers[i]:
            return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
        router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, dt, logits_in_fp32=False, weights_dtype=dt,
                                   softcap=cfg.router_softcap)
        shared = GatedMLP(h, cfg.shared_expert_size, cfg.hidden_act, dt) if cfg.shared_expert_size else None
        block = MoEBlock(i, cfg.num_experts, router, experts, shared)
        block.routed_scale = cfg.routed_scale
        return block

    def layer(i: int) -> DecoderLayer:
        attn = SoftplusGatedAttention(i, h, cfg.heads_per_layer[i], cfg.num_kv_heads, cfg.head_dim, dt,
                                      bias=cfg.attention_bias, out_bias=cfg.attention_bias, qk_norm=norm,
                                      window=cfg.window(i), per_head=cfg.gate_per_head)
        return DecoderLayer(attn, feed_forward(i), norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


def map_name(name: str) -> str:
    """Poolside's names (the correction bias on the experts, ``shared_expert``) and transformers'."""
    return name.replace(".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias") \
        .replace(".mlp.shared_experts.", ".mlp.shared_expert.")


FAMILY = ModelFamily("laguna", ("LagunaForCausalLM",), parse_config, build, map_name,
                     (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",),
                      ("num_experts",), ("moe_intermediate_size",)))
