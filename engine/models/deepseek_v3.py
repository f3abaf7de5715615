"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (``DeepseekV3ForCausalLM``): multi-head latent attention
(``engine/layers/mla.py``: the paged cache holds the compressed latent and the rotary key), YaRN
with its softmax mscale, the first ``first_k_dense_replace`` layers dense, then MoE with shared
experts and sigmoid routing corrected by ``e_score_correction_bias`` over expert groups, scaled by
``routed_scaling_factor``. The multi-token-prediction layers (numbered past the last) are skipped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.mla import LatentAttention, yarn_softmax_scale
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.glm4_moe import (
    GroupedRoutingConfig,
    grouped_moe_block,
    grouped_routing_fields,
    map_grouped_name,
)


@dataclass(frozen=True, kw_only=True)
class LatentAttentionConfig:
    """The shape of multi-head latent attention."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_style: str  # see LatentAttention
    bias: bool


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig(GroupedRoutingConfig):
    mla: LatentAttentionConfig


def latent_attention_fields(hf: Any) -> dict[str, Any]:
    """The MLA shape, and the KV cache layout it implies (one head: latent as keys, rotary key as values)."""
    mla = LatentAttentionConfig(
        q_lora_rank=getattr(hf, "q_lora_rank", None), kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        rope_style="interleaved" if getattr(hf, "rope_interleave", True) else "half",
        bias=bool(getattr(hf, "attention_bias", False)))
    return dict(mla=mla, kv_cache_layout=(1, hf.kv_lora_rank, hf.qk_rope_head_dim), head_dim=hf.qk_rope_head_dim)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    return DeepseekConfig(
        architecture="DeepseekV3ForCausalLM",
        **(decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)),
        **grouped_routing_fields(hf),
    )


def latent_attention(cfg: DeepseekConfig, i: int, cls: type[LatentAttention] = LatentAttention,
                     **extra: Any) -> LatentAttention:
    """Layer ``i``'s latent attention (``cls``, with ``extra`` keyword arguments: DSA's indexer)."""
    m = cfg.mla
    scale = yarn_softmax_scale(m.qk_nope_head_dim + m.qk_rope_head_dim, cfg.rope.rope_type, cfg.rope.params)
    return cls(i, cfg.hidden_size, cfg.num_heads, cfg.dtype, q_lora_rank=m.q_lora_rank,
               kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
               qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, bias=m.bias,
               rope_style=m.rope_style, softmax_scale=scale, **extra)


def build(cfg: DeepseekConfig, experts: ExpertBackend,
          attention: Callable[[int], LatentAttention] | None = None) -> MoECausalLM:
    """DeepSeek-V3's network, and V2's (which differs only in its config's choices); ``attention(layer)``
    builds another latent attention (DeepSeek-V3.2's sparse one)."""
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    attention = attention or partial(latent_attention, cfg)

    def layer(i: int) -> DecoderLayer:
        return DecoderLayer(attention(i), grouped_moe_block(cfg, i, experts), norm(cfg.hidden_size),
                            norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


FAMILY = ModelFamily(
    "deepseek_v3",
    ("DeepseekV3ForCausalLM",),
    parse_config,
    build,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), ("kv_lora_rank",)),
)
