"""Hunyuan V3 (``HYV3ForCausalLM``, Tencent): GLM-4.5's network (``glm4_moe.py``) with per-head q/k norms
before the rotary, biases on q/k/v and the output where ``attention_bias``, dense layers where
``mlp_layer_types`` says, and a sigmoid router (one group) whose choice adds a correction bias, its
weights renormalised and times ``router_scaling_factor``, beside ``num_shared_experts`` shared experts.
The checkpoint keeps the correction bias on the MoE block; its multi-token-prediction layer, numbered
past the last, is skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, renaming
from hearth.engine.models.glm4_moe import Glm4MoeConfig, build, grouped_routing_fields


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return Glm4MoeConfig(
        architecture="HYV3ForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        **{**grouped_routing_fields(hf), "n_shared_experts": int(hf.num_shared_experts or 0),
           "routed_scaling_factor": float(hf.router_scaling_factor), "n_group": 1, "topk_group": 1,
           "norm_topk_prob": True},
        attention_bias=bias, out_bias=bias, use_qk_norm=True,
    )


# Tencent's names (``mlp.router.gate``, ``mlp.expert_bias``, ``mlp.shared_mlp``, which transformers also
# saves) and transformers' in-memory ones (``mlp.gate``, ``mlp.e_score_correction_bias``, ``mlp.shared_experts``).
map_name = renaming(((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
                     (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                     (".mlp.shared_mlp.", ".mlp.shared_expert."), (".mlp.shared_experts.", ".mlp.shared_expert.")))

FAMILY = ModelFamily("hy_v3", ("HYV3ForCausalLM",), parse_config, build, map_name,
                     COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",), ("router_scaling_factor",)))
