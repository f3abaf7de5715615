"""EXAONE-MoE (``ExaoneMoeForCausalLM``: K-EXAONE): Qwen3's attention (per-head q/k norms before the
rotary) with sliding-window layers where ``layer_types`` names them and, when a window is set, no rotary
at all on the global layers; DeepSeek-V3's feed-forward (dense layers where ``mlp_layer_types`` says,
elsewhere routed experts beside ``num_shared_experts`` shared ones, sigmoid routing corrected by
``e_score_correction_bias``, grouped, renormalised and scaled). Computed by GLM-4.5's network
(``glm4_moe.build``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.glm4_moe import Glm4MoeConfig, build, map_grouped_name


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    n = hf.num_hidden_layers
    kinds = getattr(hf, "layer_types", None) or ["full_attention"] * n
    mlp = getattr(hf, "mlp_layer_types", None) or ["sparse"] * n
    window = getattr(hf, "sliding_window", None) or None
    return Glm4MoeConfig(
        architecture="ExaoneMoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        intermediate_size=hf.intermediate_size,
        moe_layers=tuple(kind == "sparse" for kind in mlp),
        n_shared_experts=int(getattr(hf, "num_shared_experts", 0) or 0),
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
        n_group=int(getattr(hf, "n_group", 1) or 1),
        topk_group=int(getattr(hf, "topk_group", 1) or 1),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        use_qk_norm=True,
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        nope_layers=tuple(window is not None and kind != "sliding_attention" for kind in kinds),
    )


def map_name(name: str) -> str:
    """The correction bias sits on the MoE block in EXAONE's checkpoints (``mlp.e_score_correction_bias``)."""
    return map_grouped_name(name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))


FAMILY = ModelFamily(
    "exaone_moe",
    ("ExaoneMoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",)),
)
