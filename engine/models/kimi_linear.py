"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi delta attention layers (``engine/layers/kda.py``,
their state and convolution history in the recurrent-state slots) between multi-head latent
attention layers without rotary (``layer_types``), each followed by DeepSeek-V3's feed-forward
(grouped sigmoid routing with a correction bias, shared experts; dense layers where
``mlp_layer_types`` says). Names as Moonshot ships them (and transformers saves them):
``block_sparse_moe`` with ``w1``/``w2``/``w3`` experts, the delta attention's parts under ``self_attn``."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError
from hearth.engine.config import LinearAttentionConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.kda import KimiDeltaAttention
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models import mixtral
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.deepseek_v3 import DeepseekConfig, latent_attention, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_moe_block, grouped_routing_fields, map_grouped_name


def delta_hybrid_fields(hf: Any, model_dir: Path, dtype: torch.dtype, rope_style: str) -> dict[str, Any]:
    """The config fields of a delta attention + latent attention hybrid with DeepSeek-V3's experts
    (Kimi-Linear, Ling 3.0), from transformers' config of it."""
    n = hf.num_hidden_layers
    kinds = list(hf.layer_types)
    if len(kinds) != n or set(kinds) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"{hf.architectures[0] if hf.architectures else 'the model'}: layer_types must name each "
                          f"of the {n} layers 'full_attention' or 'linear_attention' (got {kinds})")
    fields = decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)
    fields["mla"] = replace(fields["mla"], rope_style=rope_style)
    heads, width = hf.linear_num_heads, hf.linear_head_dim
    return fields | grouped_routing_fields(hf) | dict(
        layer_types=tuple(kinds),
        linear_attention=LinearAttentionConfig(heads, heads, width, width, conv_kernel=hf.linear_conv_kernel_dim))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    return DeepseekConfig(architecture="KimiLinearForCausalLM", **delta_hybrid_fields(hf, model_dir, dtype, "none"))


def build(cfg: DeepseekConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        mixer = KimiDeltaAttention(i, cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps, cfg.dtype) \
            if cfg.is_linear_layer(i) else latent_attention(cfg, i)
        return DecoderLayer(mixer, grouped_moe_block(cfg, i, experts), norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    """Moonshot's names (Mixtral's ``block_sparse_moe`` with ``w1``/``w2``/``w3`` experts) and
    transformers' in-memory ones (``forget_gate.``; the fused convolution is split by the loader) -> ours."""
    return map_grouped_name(mixtral.map_name(name.replace(".self_attn.forget_gate.", ".self_attn.")))


FAMILY = ModelFamily(
    "kimi_linear",
    ("KimiLinearForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("kv_lora_rank",), ("moe_intermediate_size",)),
)
