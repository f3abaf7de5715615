"""Granite MoE with sliding-window attention (``GraniteMoeSWAForCausalLM``): Granite MoE's layout and
four scalars (granitemoe.py), a sliding window on the layers ``layer_types`` names, a learned sink
per head (GraniteSWA's order: the softmax times sigmoid(logsumexp - sink)), and a rotary base per
layer, 0 for a layer without rotary (``layer_rope_theta``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ConfigError
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import SigmoidSinkAttention
from hearth.engine.models import granitemoe
from hearth.engine.models.base import ModelFamily
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True, kw_only=True)
class GraniteMoeSWAConfig(granitemoe.GraniteMoeConfig):
    nope_layers: tuple[bool, ...] = ()


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> GraniteMoeSWAConfig:
    base = granitemoe.parse_config(hf, model_dir, dtype)
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None) or None
    thetas = list(getattr(hf, "layer_rope_theta", None) or [base.rope.theta] * n)
    if any(theta and theta != base.rope.theta for theta in thetas):
        raise ConfigError(f"GraniteMoeSWAForCausalLM with rotary bases other than 0 and rope_theta "
                          f"({base.rope.theta}) per layer is not supported: {thetas}")
    kinds = hf.layer_types or ["full_attention"] * n
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    return GraniteMoeSWAConfig(**fields | {
        "architecture": "GraniteMoeSWAForCausalLM",
        "sliding_windows": tuple(window if kind == "sliding_attention" else None for kind in kinds),
        "nope_layers": tuple(not theta for theta in thetas)})


def build(cfg: GraniteMoeSWAConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int) -> SigmoidSinkAttention:
        attn = SigmoidSinkAttention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                    bias=cfg.attention_bias, out_bias=cfg.attention_bias, window=cfg.window(i))
        attn.use_rope = not cfg.nope_layers[i]
        return attn

    return granitemoe.build(cfg, experts, attention)


FAMILY = ModelFamily(
    "granitemoe_swa",
    ("GraniteMoeSWAForCausalLM",),
    parse_config,
    build,
    granitemoe.map_name,
    granitemoe.FAMILY.required_fields,
)
