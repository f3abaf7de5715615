"""Kimi-K2.5 (``KimiK25ForConditionalGeneration`` as Moonshot ships it, transformers'
``Kimi_K25ForConditionalGeneration``): its language model is Kimi-K2's, DeepSeek-V3's
network (``deepseek_v3.py``), under ``text_config``; its tensors sit under ``language_model.model.``
and ``language_model.lm_head`` as Moonshot ships them (``model.language_model.`` and ``lm_head`` as
transformers saves them). The vision tower and its projector are not read (one log line names them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.engine.models.base import ModelFamily, decoder_fields
from hearth.engine.models.deepseek_v3 import DeepseekConfig, build, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_routing_fields, map_grouped_name

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.",
                   "model.multi_modal_projector.")


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    text = getattr(hf, "text_config", None) or hf
    return DeepseekConfig(
        architecture="Kimi_K25ForConditionalGeneration",
        **(decoder_fields(text, model_dir, dtype) | latent_attention_fields(text)),
        **grouped_routing_fields(text),
    )


def map_name(name: str) -> str:
    if name.startswith(VISION_PREFIXES):
        return ""
    for shipped, ours in (("language_model.model.", "model."), ("model.language_model.", "model."),
                          ("language_model.lm_head.", "lm_head.")):
        if name.startswith(shipped):
            name = ours + name[len(shipped):]
            break
    return map_grouped_name(name)


FAMILY = ModelFamily("kimi_k25", ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"), parse_config,
                     build, map_name)
