"""A.X K1 (``AXK1ForCausalLM``, SK Telecom): DeepSeek-V3's network (``deepseek_v3.py``: latent attention
with a query LoRA, grouped sigmoid routing scaled by ``routed_scaling_factor``, shared experts, dense
layers by ``mlp_layer_types``) whose MoE output (routed plus shared) is normalised by an RMSNorm before
the residual add (``post_mlp_layernorm``). Its releases ship no correction bias: where a checkpoint has
none it stays zero, as in transformers."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.moe import MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.models.deepseek_v3 import DeepseekConfig, latent_attention, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_moe_block, grouped_routing_fields, map_grouped_name


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekConfig:
    return DeepseekConfig(architecture="AXK1ForCausalLM",
                          **(decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)),
                          **grouped_routing_fields(hf))


def build(cfg: DeepseekConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        mlp = grouped_moe_block(cfg, i, experts, post_norm=norm(cfg.hidden_size) if cfg.moe_layers[i] else None)
        if isinstance(mlp, MoEBlock):
            mlp.gate.e_score_correction_bias.optional = True  # (see the module's docstring)
        return DecoderLayer(latent_attention(cfg, i), mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    """SK Telecom's names (the MoE output norm at the layer, ``layers.N.post_mlp_layernorm``; dense layers
    carry one too, which nothing computes: it is skipped) and transformers' (``mlp.post_mlp_layernorm``)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] == "post_mlp_layernorm":
        name = ".".join([*parts[:3], "mlp", *parts[3:]])
    return map_grouped_name(name)


FAMILY = ModelFamily("axk1", ("AXK1ForCausalLM",), parse_config, build, map_name,
                     COMMON_FIELDS + (("n_routed_experts",), ("moe_intermediate_size",), ("kv_lora_rank",)))
