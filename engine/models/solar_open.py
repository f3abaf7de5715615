"""Solar Open (``SolarOpenForCausalLM``, Upstage): GLM-4.5's network (``glm4_moe.py``) with every layer
MoE (the config names no dense width), no q/k norms and biases on q/k/v only where the config asks;
shared experts and DeepSeek-style grouped sigmoid routing as GLM's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import COMMON_FIELDS, ModelFamily
from hearth.engine.models.glm4_moe import Glm4MoeConfig, build, map_grouped_name
from hearth.engine.models.glm4_moe import parse_config as glm4_moe_config


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    return replace(glm4_moe_config(hf, model_dir, dtype), architecture="SolarOpenForCausalLM")


FAMILY = ModelFamily("solar_open", ("SolarOpenForCausalLM",), parse_config, build, map_grouped_name,
                     tuple(f for f in COMMON_FIELDS if f != ("intermediate_size",))
                     + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",)))
