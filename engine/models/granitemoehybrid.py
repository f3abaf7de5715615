"""Granite 4 (``GraniteMoeHybridForCausalLM``: Granite-4.0-H Tiny / Small / Micro): Mamba-2 layers
(:class:`~hearth.engine.layers.mamba2.Mamba2Mixer`, ``layer_types`` "linear_attention") between
attention layers, with Granite MoE's scalars (embedding, residual, attention and logits multipliers),
its routed experts where ``num_local_experts`` > 0 and always its ungated shared MLP. Attention turns
rotary only where ``position_embedding_type`` is "rope" (the released models use none)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import LinearAttentionConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mamba2 import Mamba2Mixer
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.granitemoe import GraniteMoeConfig, map_name


class SharedOnly(nn.Module):
    """A dense Granite 4's feed-forward: its shared MLP alone, under the shared expert's name."""

    def __init__(self, shared: GatedMLP) -> None:
        super().__init__()
        self.shared_expert = shared

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return self.shared_expert(x)


@dataclass(frozen=True, kw_only=True)
class GraniteHybridConfig(GraniteMoeConfig):
    use_rope: bool = False
    mamba_groups: int = 1
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> GraniteHybridConfig:
    n, experts = hf.num_hidden_layers, int(hf.num_local_experts or 0)
    kinds = list(getattr(hf, "layer_types", None) or ["linear_attention"] * n)
    heads, head_dim, groups, state = hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state
    mamba = LinearAttentionConfig(0, heads, head_dim, state, conv_kernel=hf.mamba_d_conv,
                                  channels=heads * head_dim + 2 * groups * state)
    return GraniteHybridConfig(
        architecture="GraniteMoeHybridForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        embedding_multiplier=float(hf.embedding_multiplier), residual_multiplier=float(hf.residual_multiplier),
        attention_multiplier=float(hf.attention_multiplier), logits_scaling=float(hf.logits_scaling),
        shared_intermediate_size=int(hf.shared_intermediate_size), intermediate_size=hf.intermediate_size,
        num_experts=experts, top_k=hf.num_experts_per_tok if experts else 0, moe_intermediate_size=hf.intermediate_size,
        moe_layers=(experts > 0,) * n,
        layer_types=tuple("linear_attention" if kind == "linear_attention" else "full_attention" for kind in kinds),
        linear_attention=mamba, use_rope=getattr(hf, "position_embedding_type", None) == "rope",
        mamba_groups=groups, mamba_conv_bias=bool(hf.mamba_conv_bias), mamba_proj_bias=bool(hf.mamba_proj_bias),
        dt_limit=tuple(float(v) for v in (getattr(hf, "time_step_limit", None) or (0.0, float("inf")))),
    )


def build(cfg: GraniteHybridConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    h, dt, la = cfg.hidden_size, cfg.dtype, cfg.linear_attention

    def mixer(i: int):
        if cfg.is_linear_layer(i):
            return Mamba2Mixer(i, h, heads=la.num_value_heads, head_dim=la.key_head_dim, groups=cfg.mamba_groups,
                               state=la.value_head_dim, kernel=la.conv_kernel, conv_bias=cfg.mamba_conv_bias,
                               proj_bias=cfg.mamba_proj_bias, eps=cfg.rms_norm_eps, dtype=dt, dt_limit=cfg.dt_limit)
        attn = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                         out_bias=cfg.attention_bias)
        attn.scale, attn.use_rope = cfg.attention_multiplier, cfg.use_rope
        return attn

    def layer(i: int) -> DecoderLayer:
        shared = GatedMLP(h, cfg.shared_intermediate_size, cfg.hidden_act, dt)
        mlp = MoEBlock(i, cfg.num_experts, TopKRouter(h, cfg.num_experts, cfg.top_k, dt, normalize=True), experts,
                       shared) if cfg.moe_layers[i] else SharedOnly(shared)
        return DecoderLayer(mixer(i), mlp, norm(h), norm(h), residual_scale=cfg.residual_multiplier)

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h),
                       embedding_scale=cfg.embedding_multiplier, logits_divisor=cfg.logits_scaling)


FAMILY = ModelFamily(
    "granitemoehybrid",
    ("GraniteMoeHybridForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS[:-2] + (("mamba_n_heads",), ("mamba_d_head",), ("mamba_d_state",), ("shared_intermediate_size",)),
)
