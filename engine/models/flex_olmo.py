"""FlexOlmo (``FlexOlmoForCausalLM``): OLMo-2's layer order, its norms after each part rather than
before (``post_attention_layernorm`` on the attention's output, ``post_feedforward_layernorm`` on the
feed-forward's), q/k norms over each whole projection, every norm's weight in the model dtype
scaling in fp32 and cast once, rotary in fp32; OLMoE's softmax top-k router (renormalised where
``norm_topk_prob``) over experts ``intermediate_size`` wide. llama.cpp has no converter for it: no
GGUF file of it exists to read."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import ProjectionNormAttention
from hearth.engine.layers.batch import LayerContext
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.layers.norm import RMSNormScaledInFp32
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.olmoe import OlmoeConfig


class PostNormDecoderLayer(DecoderLayer):
    """``h + post_attn(mixer(h))``, then ``h + post_ff(mlp(h))``: OLMo-2's order, no norm before either part."""

    native_order = False

    def __init__(self, mixer: nn.Module, mlp: nn.Module, norm) -> None:
        super().__init__(mixer, mlp, nn.Identity(), norm())
        del self.input_layernorm  # (the checkpoint has none)
        self.post_feedforward_layernorm = norm()

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self._mixer(h, ctx))
        return self.feed_forward(h, ctx)

    def feed_forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        return h + self.post_feedforward_layernorm(self.mlp(h, ctx))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> OlmoeConfig:
    return OlmoeConfig(
        architecture="FlexOlmoForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        intermediate_size=hf.intermediate_size, num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size, norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_layers=(True,) * hf.num_hidden_layers,
        rope_in_fp32=True,  # (OLMo-2's rotary tables stay fp32: q and k turn in fp32, then round)
    )


def build(cfg: OlmoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNormScaledInFp32, eps=cfg.rms_norm_eps, dtype=dt)

    def layer(i: int) -> DecoderLayer:
        attn = ProjectionNormAttention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, norm=norm,
                                       bias=cfg.attention_bias)
        router = TopKRouter(h, cfg.num_experts, cfg.top_k, dt, normalize=cfg.norm_topk_prob)
        return PostNormDecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts), partial(norm, h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


FAMILY = ModelFamily(
    "flex_olmo",
    ("FlexOlmoForCausalLM",),
    parse_config,
    build,
    required_fields=COMMON_FIELDS + (("num_experts",),),
)
