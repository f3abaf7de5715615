"""Ling 3.0 (``BailingHybridForCausalLM``): Kimi-Linear's layout with Ling's parts: delta attention
with full-rank decay and output-gate projections and a bounded ("safe") decay
(``engine/layers/kda.py``: :class:`LingDeltaAttention`), latent attention with interleaved rotary and
a sigmoid gate per head on its output (:class:`HeadGatedLatentAttention`), every ``layer_group_size``-th
layer attention; DeepSeek-V3's experts. Names as Ant Group ships them (``word_embeddings``,
``attention``, ``attention.dense``, ``gate.expert_bias``) and as transformers holds them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.kda import LingDeltaAttention
from hearth.engine.layers.mla import HeadGatedLatentAttention
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, renaming
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.deepseek_v3 import DeepseekConfig, latent_attention
from hearth.engine.models.glm4_moe import grouped_moe_block, map_grouped_name
from hearth.engine.models.kimi_linear import delta_hybrid_fields


@dataclass(frozen=True, kw_only=True)
class LingConfig(DeepseekConfig):
    """Kimi-Linear's fields, and the choice of Ling's delta attention decay."""

    safe_gate: bool = True  # the delta attention's bounded decay
    lower_bound: float = -5.0


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> LingConfig:
    fields = delta_hybrid_fields(hf, model_dir, dtype, "interleaved")
    fields["mla"] = replace(fields["mla"], q_lora_rank=None)  # (Ling's attention has a full-rank q_proj only)
    return LingConfig(architecture="BailingHybridForCausalLM", **fields,
                      safe_gate=bool(hf.kda_safe_gate), lower_bound=float(hf.kda_lower_bound))


def build(cfg: LingConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        mixer = LingDeltaAttention(i, cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps, cfg.dtype,
                                   safe_gate=cfg.safe_gate, lower_bound=cfg.lower_bound) \
            if cfg.is_linear_layer(i) else latent_attention(cfg, i, HeadGatedLatentAttention)
        return DecoderLayer(mixer, grouped_moe_block(cfg, i, experts), norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


_RENAMES = renaming((("model.word_embeddings.", "model.embed_tokens."), (".attention.", ".self_attn."),
                     (".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.forget_gate.", ".self_attn."),
                     (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias")))


def map_name(name: str) -> str:
    return map_grouped_name(_RENAMES(name))


FAMILY = ModelFamily("bailing_hybrid", ("BailingHybridForCausalLM",), parse_config, build, map_name,
                     COMMON_FIELDS + (("kv_lora_rank",), ("moe_intermediate_size",)))
