"""DeepSeek-V2 / V2-Lite / V2.5 and DeepSeek-Coder-V2 (``DeepseekV2ForCausalLM``): multi-head
latent attention as DeepSeek-V3 (``deepseek_v3.py``), its rotary pairs turned in fp32 and left
interleaved; softmax routing, greedy or limited to the ``topk_group`` groups holding the best
experts (``topk_method`` "group_limited_greedy"), weights not renormalised, scaled by
``routed_scaling_factor``; shared experts; dense layers first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError
from hearth.engine.models import deepseek_v3
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.deepseek_v3 import DeepseekConfig, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_routing_fields, map_grouped_name

TOPK_METHODS = ("greedy", "group_limited_greedy")


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    method = getattr(hf, "topk_method", "greedy") or "greedy"
    if method not in TOPK_METHODS:
        raise ConfigError(f"{model_dir}/config.json: topk_method '{method}' is not supported "
                          f"({', '.join(TOPK_METHODS)})")
    fields = decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)
    routing = grouped_routing_fields(hf) | dict(scoring="softmax", correction_bias=False, group_score="max",
                                                 norm_topk_prob=False)  # V2 never renormalises
    if method == "greedy":
        routing |= dict(n_group=1, topk_group=1)
    cfg = DeepseekConfig(architecture="DeepseekV2ForCausalLM", **fields, **routing, rope_in_fp32=True)
    return replace(cfg, mla=replace(cfg.mla, rope_style="pairs"))


FAMILY = ModelFamily(
    "deepseek_v2",
    ("DeepseekV2ForCausalLM",),
    parse_config,
    deepseek_v3.build,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), ("kv_lora_rank",)),
)
