"""dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention (per-head q/k norms, projection biases where
``attention_bias``, rotary on the whole head) with DeepSeek-V3's feed-forward (the first
``first_k_dense_replace`` layers dense, then routed experts beside shared ones, sigmoid routing corrected by
``e_score_correction_bias``, grouped and scaled). Layers named ``sliding_attention`` in ``layer_types`` attend
within ``sliding_window``. Computed by GLM-4.5's network (``glm4_moe.build``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.glm4_moe import Glm4MoeConfig, build, grouped_routing_fields, map_grouped_name


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    kinds = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or None
    return Glm4MoeConfig(
        architecture="Dots1ForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        **grouped_routing_fields(hf),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        out_bias=bool(getattr(hf, "attention_bias", False)),
        use_qk_norm=True,
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
    )


FAMILY = ModelFamily(
    "dots1",
    ("Dots1ForCausalLM",),
    parse_config,
    build,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",)),
)
