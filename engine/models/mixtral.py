"""Mixtral: plain GQA attention, a top-k router whose renormalised weights stay in fp32, no shared
expert, every layer MoE.

Checkpoints name the MoE block ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up) and
``w2`` (down); transformers 5 uses ``mlp`` in memory. Both are accepted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, NormFactory, decoder_fields, softmax_moe_decoder
from hearth.engine.models.decoder import MoECausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_W_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    n = hf.num_hidden_layers
    return ModelConfig(
        architecture="MixtralForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * n,
        sliding_windows=(getattr(hf, "sliding_window", None) or None,) * n,
    )


def build(cfg: ModelConfig, experts: ExpertBackend) -> MoECausalLM:
    def attention(i: int, norm: NormFactory) -> Attention:
        return Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         window=cfg.window(i))

    return softmax_moe_decoder(cfg, experts, attention, normalize=True, weights_in_fp32=True)


def map_name(name: str) -> str:
    match = _EXPERT.match(name)
    if match:
        prefix, expert, w = match.groups()
        return f"{prefix}.mlp.experts.{expert}.{_W_NAMES[w]}.weight"
    return name.replace(".block_sparse_moe.", ".mlp.")


FAMILY = ModelFamily(
    "mixtral", ("MixtralForCausalLM",), parse_config, build, map_name, COMMON_FIELDS + (("num_local_experts",),)
)
