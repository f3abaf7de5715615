"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's sparse latent attention with GLM's choices: the
indexer rotates its keys as adjacent pairs, and ``indexer_types`` marks "shared" layers that run no
indexer but reuse the selection of the last layer before them that has one. Computed by DeepSeek-V3.2's
network (``deepseek_v32.py``). Multi-token-prediction layers (numbered past the last) are skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily
from hearth.engine.models.deepseek_v32 import SparseDeepseekConfig, build_sparse, parse_sparse
from hearth.engine.models.glm4_moe import map_grouped_name


def shared_layers(hf: Any) -> tuple[bool, ...]:
    """Per layer: whether it reuses an earlier layer's selection (``indexer_types``; transformers
    fills it from ``index_topk_freq`` / ``index_skip_topk_offset`` or a pattern when absent)."""
    kinds = list(getattr(hf, "indexer_types", None) or ["full"] * hf.num_hidden_layers)
    unknown = sorted(set(kinds) - {"full", "shared"})
    if unknown or len(kinds) != hf.num_hidden_layers:
        raise ConfigError(f"indexer_types must name 'full' or 'shared' for each of the {hf.num_hidden_layers} "
                          f"layers (got {kinds})")
    return tuple(kind == "shared" for kind in kinds)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> SparseDeepseekConfig:
    return parse_sparse(hf, model_dir, dtype, "GlmMoeDsaForCausalLM", interleaved=True, shared=shared_layers(hf))


FAMILY = ModelFamily(
    "glm_moe_dsa",
    ("GlmMoeDsaForCausalLM",),
    parse_config,
    build_sparse,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), ("kv_lora_rank",),
                     ("index_topk",)),
)
