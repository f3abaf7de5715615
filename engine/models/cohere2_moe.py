"""Cohere2-MoE (``Cohere2MoeForCausalLM``: Command A's MoE): parallel blocks, ``h + attn(norm(h)) +
ffn(norm(h))`` over one norm (a LayerNorm without bias, or an RMSNorm where ``rms_norm_eps`` is set);
rotary on interleaved pairs, turned in fp32 over the model-dtype tables, on the sliding-window layers
only (and on the dense leading layers when ``prefix_dense_sliding_window_pattern`` is 1), none on the
global ones; dense leading layers (``mlp_layer_types``) of ``prefix_dense_intermediate_size``; a router
that takes the top k logits first and scores those (softmax, or sigmoid renormalised), shared experts
summed or averaged in; logits times ``logit_scale``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.batch import LayerContext
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKThenScoreRouter
from hearth.engine.layers.norm import LayerNormScaledInFp32, RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class Cohere2MoeConfig(ModelConfig):
    layer_norm: bool  # LayerNorm (no bias) rather than RMSNorm
    rope_layers: tuple[bool, ...]
    expert_selection: str  # "softmax" or "sigmoid"
    norm_topk_prob: bool
    shared_experts: int
    shared_average: bool
    logit_scale: float
    attention_bias: bool = False


class ParallelDecoderLayer(DecoderLayer):
    """``h + mixer(norm(h)) + mlp(norm(h))``: attention and feed-forward side by side on one norm."""

    native_order = False

    def __init__(self, mixer: nn.Module, mlp: nn.Module, norm: nn.Module) -> None:
        super().__init__(mixer, mlp, norm, nn.Identity())
        del self.post_attention_layernorm  # (the checkpoint has none)

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        return h + self._mixer(x, ctx) + self.mlp(x, ctx)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Cohere2MoeConfig:
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None) or None
    kinds = hf.layer_types or ["full_attention"] * n
    dense = [kind == "dense" for kind in (hf.mlp_layer_types or ["sparse"] * n)]
    rope_dense = getattr(hf, "prefix_dense_sliding_window_pattern", 1) == 1
    rms = getattr(hf, "rms_norm_eps", None)
    fields = decoder_fields(hf, model_dir, dtype) | {"rms_norm_eps": rms if rms is not None else hf.layer_norm_eps}
    return Cohere2MoeConfig(
        architecture="Cohere2MoeForCausalLM", **fields,
        num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, moe_intermediate_size=hf.intermediate_size,
        intermediate_size=getattr(hf, "prefix_dense_intermediate_size", None) or hf.intermediate_size,
        moe_layers=tuple(not d for d in dense),
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        layer_norm=rms is None,
        rope_layers=tuple(k == "sliding_attention" or (d and rope_dense) for k, d in zip(kinds, dense, strict=True)),
        expert_selection=getattr(hf, "expert_selection_fn", "softmax"),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        shared_experts=int(getattr(hf, "num_shared_experts", 0) or 0),
        shared_average=getattr(hf, "shared_expert_combination_strategy", "average") == "average",
        logit_scale=float(getattr(hf, "logit_scale", 1.0)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
    )


def _feed_forward(cfg: Cohere2MoeConfig, i: int, experts: ExpertBackend) -> nn.Module:
    h, dt = cfg.hidden_size, cfg.dtype
    if not cfg.moe_layers[i]:
        return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
    router = TopKThenScoreRouter(h, cfg.num_experts, cfg.top_k, dt, scoring=cfg.expert_selection,
                                 normalize=cfg.norm_topk_prob)
    shared = GatedMLP(h, cfg.moe_intermediate_size * cfg.shared_experts, cfg.hidden_act, dt) \
        if cfg.shared_experts else None
    block = MoEBlock(i, cfg.num_experts, router, experts, shared)
    block.shared_average = cfg.shared_average
    return block


def build(cfg: Cohere2MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(LayerNormScaledInFp32 if cfg.layer_norm else RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.attention_bias, out_bias=cfg.attention_bias, window=cfg.window(i))
        attn.use_rope, attn.interleaved_rope, attn.rotate_in_fp32 = cfg.rope_layers[i], True, True
        return ParallelDecoderLayer(attn, _feed_forward(cfg, i, experts), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size),
                       logits_scale=cfg.logit_scale)


def map_name(name: str) -> str:
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


FAMILY = ModelFamily(
    "cohere2_moe",
    ("Cohere2MoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts",),),
)
