"""GPT-OSS-20B / 120B (``GptOssForCausalLM``): attention with q/k/v/o bias and a learned sink per
head, layers alternating between a sliding window and full attention (``layer_types``), YaRN;
every layer MoE, routed by a softmax over the top k of the biased gate logits, through experts
with biases and GPT-OSS's clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``). The checkpoint's
``gate_up_proj`` is [E, H, 2I] with gate and up interleaved; the loader de-interleaves it
(``expert_bias``: biases ride in the pool rows). RMSNorm scales in fp32 before its cast."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import SinkAttention
from hearth.engine.layers.moe import MoEBlock, TopKSoftmaxRouter
from hearth.engine.layers.norm import RMSNormScaledInFp32
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import ClampedSwiGLU

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # the released models' clamped SwiGLU


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    n = hf.num_hidden_layers
    kinds = getattr(hf, "layer_types", None) or ["full_attention"] * n
    fields = decoder_fields(hf, model_dir, dtype)
    # Older transformers (5.17) fix these in the modeling code rather than the config: its values.
    alpha, limit = getattr(hf, "swiglu_alpha", GPT_OSS_ALPHA), getattr(hf, "swiglu_limit", GPT_OSS_LIMIT)
    fields["hidden_act"] = ClampedSwiGLU(float(alpha), float(limit)).name
    return ModelConfig(
        architecture="GptOssForCausalLM",
        **fields,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * n,
        sliding_windows=tuple(hf.sliding_window if kind == "sliding_attention" else None for kind in kinds),
        expert_bias=True,
    )


def build(cfg: ModelConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNormScaledInFp32, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = SinkAttention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                             bias=True, out_bias=True, window=cfg.window(i))
        router = TopKSoftmaxRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.dtype)
        return DecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts), norm(cfg.hidden_size),
                            norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def map_name(name: str) -> str:
    return name.replace(".mlp.router.", ".mlp.gate.")


FAMILY = ModelFamily(
    "gpt_oss",
    ("GptOssForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_local_experts",),),
)
