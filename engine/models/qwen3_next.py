"""Qwen3-Next: a hybrid of gated DeltaNet (linear attention) and gated full attention layers,
zero-centred RMSNorm, partial rotary embeddings, softmax top-k experts plus a gated shared expert.

Checkpoint names follow transformers; the DeltaNet input projections are fused per key head
(``in_proj_qkvz``, ``in_proj_ba``). Multi-token-prediction weights (``mtp.*``) are not used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import LinearAttentionConfig, ModelConfig
from engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, moe_layer_flags


def linear_attention_of(hf: Any, layout: str) -> LinearAttentionConfig:
    """The DeltaNet shape of a Qwen hybrid config."""
    return LinearAttentionConfig(
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
        projection_layout=layout,
    )


def hybrid_config(hf: Any, model_dir: Path, dtype: torch.dtype, architecture: str, layout: str,
                  moe_layers: tuple[bool, ...], norm_topk_prob: bool, intermediate_size: int) -> ModelConfig:
    """The ModelConfig of a Qwen hybrid (Qwen3-Next, Qwen3.5) from its text config."""
    n = hf.num_hidden_layers
    return ModelConfig(
        architecture=architecture,
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm=True,
        intermediate_size=intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        router_weights_in_fp32=False,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_layers=moe_layers,
        sliding_windows=(None,) * n,
        layer_types=tuple(hf.layer_types),
        linear_attention=linear_attention_of(hf, layout),
        attn_output_gate=True,
        zero_centered_norm=True,
    )


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    moe = moe_layer_flags(hf.num_hidden_layers, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step)
    return hybrid_config(hf, model_dir, dtype, "Qwen3NextForCausalLM", "qkvz", moe, bool(hf.norm_topk_prob),
                         hf.intermediate_size)


def map_name(name: str) -> str:
    return "" if name.startswith("mtp.") else name


FAMILY = ModelFamily(
    "qwen3_next",
    ("Qwen3NextForCausalLM",),
    parse_config,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",), ("linear_num_value_heads",)),
)
