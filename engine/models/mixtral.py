"""Mixtral: plain GQA attention, top-k router with renormalised fp32 weights, no shared expert.

Checkpoints name the MoE block ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up) and
``w2`` (down); transformers 5 uses ``mlp`` in memory. Both are accepted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig, eos_ids, parse_rope
from engine.models.base import COMMON_FIELDS, ModelFamily, head_dim_of

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_W_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    n = hf.num_hidden_layers
    return ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=n,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim_of(hf),
        rms_norm_eps=hf.rms_norm_eps,
        rope=parse_rope(hf.to_dict()),
        max_position_embeddings=hf.max_position_embeddings,
        hidden_act=hf.hidden_act,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        norm_topk_prob=True,
        router_weights_in_fp32=True,
        shared_expert_intermediate_size=0,
        moe_layers=(True,) * n,
        sliding_windows=(getattr(hf, "sliding_window", None) or None,) * n,
        dtype=dtype,
        eos_token_ids=eos_ids(hf.to_dict(), model_dir),
    )


def map_name(name: str) -> str:
    match = _EXPERT.match(name)
    if match:
        prefix, expert, w = match.groups()
        return f"{prefix}.mlp.experts.{expert}.{_W_NAMES[w]}.weight"
    return name.replace(".block_sparse_moe.", ".mlp.")


FAMILY = ModelFamily(
    "mixtral", ("MixtralForCausalLM",), parse_config, map_name, COMMON_FIELDS + (("num_local_experts",),)
)
