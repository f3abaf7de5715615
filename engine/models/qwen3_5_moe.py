"""Qwen3.5-MoE (text): the Qwen3-Next hybrid with separate DeltaNet input projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: the shared :class:`GatedDeltaNet`),
every layer MoE and the top-k weights always renormalised. Multimodal checkpoints
(``Qwen3_5MoeForConditionalGeneration``) load their language model; the vision tower and
multi-token-prediction weights are not used. Text positions make its multimodal rotary embedding
the ordinary one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.deltanet import GatedDeltaNet
from hearth.engine.models.base import ModelFamily
from hearth.engine.models.decoder import MoECausalLM
from hearth.engine.models.qwen3_next import QwenHybridConfig, build_hybrid, hybrid_config


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> QwenHybridConfig:
    text = getattr(hf, "text_config", None) or hf
    n = text.num_hidden_layers
    return hybrid_config(text, model_dir, dtype, "Qwen3_5MoeForCausalLM", (True,) * n, True,
                         text.shared_expert_intermediate_size)


def build(cfg: QwenHybridConfig, experts: ExpertBackend) -> MoECausalLM:
    return build_hybrid(cfg, experts, GatedDeltaNet)


def map_name(name: str) -> str:
    if name.startswith(("mtp.", "model.visual.")):
        return ""
    return name.replace("model.language_model.", "model.", 1)


FAMILY = ModelFamily(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    parse_config,
    build,
    map_name,
)
