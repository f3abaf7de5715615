"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's multi-head latent attention with GLM-4.5's
feed-forward (shared experts, sigmoid routing corrected by ``e_score_correction_bias``, grouped and
scaled); ``mlp_layer_types`` names the dense and the MoE ("sparse") layers. Computed by DeepSeek-V3's
network. Multi-token-prediction layers (numbered past the last) are skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.deepseek_v3 import DeepseekConfig, build, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_routing_fields, map_grouped_name


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    return DeepseekConfig(
        architecture="Glm4MoeLiteForCausalLM",
        **(decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)),
        **grouped_routing_fields(hf),
    )


FAMILY = ModelFamily(
    "glm4_moe_lite",
    ("Glm4MoeLiteForCausalLM",),
    parse_config,
    build,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), ("kv_lora_rank",)),
)
