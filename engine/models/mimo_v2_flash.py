"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, Xiaomi): attention whose values are narrower than its keys
(``v_head_dim``) and scaled by ``attention_value_scale`` before they are cached, computed as its eager path
does (scores and softmax in the model dtype, the max subtracted); sliding-window layers with twice the KV
heads and a learned sink per head, global layers without; each layer type turning by its own rotary
(on part of each head). DeepSeek-V3's grouped sigmoid routing without shared experts; dense layers by
``mlp_layer_types``. Its multi-token-prediction layers (``model.mtp.*``) are skipped."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import parse_layer_ropes
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import SinkAttention
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.glm4_moe import Glm4MoeConfig, grouped_moe_block, grouped_routing_fields


class NarrowValueAttention(SinkAttention):
    """Grouped-query attention with values ``v_head_dim`` wide (keys ``head_dim``), scaled by
    ``value_scale`` in the model dtype before the cache; a sink per head where ``sinks`` (else none)."""

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, *, bias: bool, window: int | None, sinks: bool,
                 value_scale: float) -> None:
        super().__init__(layer_idx, hidden, num_heads, num_kv_heads, head_dim, dtype, bias=bias, window=window)
        self.v_head_dim, self.value_scale = v_head_dim, value_scale
        self.v_proj = Projection(hidden, num_kv_heads * v_head_dim, bias, dtype)
        self.o_proj = Projection(num_heads * v_head_dim, hidden, False, dtype)
        self.qkv_weight = self.qkv_bias = None  # (q, k and v projected one by one: v is another width)
        if not sinks:
            self.sinks = None

    def adopt_block_weights(self) -> None:
        """q, k and v stay three projections (v's rows are another width)."""

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, q_size], k [T, kv_size] and the values [T, kv_heads * v_head_dim], scaled before the cache."""
        q, k, v = super().project_qkv(x)  # one by one: qkv_weight stays None
        return q, k, v * self.value_scale if self.value_scale != 1.0 else v


@dataclass(frozen=True, kw_only=True)
class MiMoConfig(Glm4MoeConfig):
    value_scale: float = 1.0  # (attention_value_scale)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> MiMoConfig:
    kinds, n = list(hf.layer_types), hf.num_hidden_layers
    rope, layer_ropes = parse_layer_ropes(hf.to_dict(), kinds[:n])
    window, kv, v = getattr(hf, "sliding_window", None) or None, hf.num_key_value_heads, hf.v_head_dim
    return MiMoConfig(
        architecture="MiMoV2FlashForCausalLM", **{**decoder_fields(hf, model_dir, dtype), "rope": rope},
        **grouped_routing_fields(hf), layer_ropes=layer_ropes,
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds[:n]),
        kv_layer_layouts=tuple((2 * kv if kind == "sliding_attention" else kv, hf.head_dim, v) for kind in kinds[:n]),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        value_scale=float(hf.attention_value_scale if hf.attention_value_scale is not None else 1.0))


def build(cfg: MiMoConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def layer(i: int) -> DecoderLayer:
        kv_heads, head_dim, v_dim = cfg.kv_layer_layouts[i]
        sliding = cfg.window(i) is not None
        attn = NarrowValueAttention(i, h, cfg.num_heads, kv_heads, head_dim, v_dim, dt, bias=cfg.attention_bias,
                                    window=cfg.window(i), sinks=sliding, value_scale=cfg.value_scale)
        return DecoderLayer(attn, grouped_moe_block(cfg, i, experts), norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


FAMILY = ModelFamily("mimo_v2_flash", ("MiMoV2FlashForCausalLM",), parse_config, build,
                     lambda name: name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks"),
                     COMMON_FIELDS + (("n_routed_experts",), ("moe_intermediate_size",), ("v_head_dim",)))
