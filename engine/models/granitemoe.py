"""Granite MoE (IBM's Granite 3.x MoE, ``GraniteMoeForCausalLM``) and its shared-expert form
(``GraniteMoeSharedForCausalLM``): Mixtral's layout with four scalars of its own. The embeddings are
multiplied by ``embedding_multiplier``, each residual branch by ``residual_multiplier``, attention
scores by ``attention_multiplier`` (instead of 1/sqrt(head_dim)) and the logits divided by
``logits_scaling``. The router takes the softmax of the top-k logits (the renormalised top-k of the
full softmax, which hearth's router computes), its weights in the model dtype. The shared form adds
an ungated SwiGLU expert beside the routed ones.

Checkpoints keep the experts fused: ``block_sparse_moe.input_linear`` [E, 2I, H] (gate rows then
up) and ``output_linear`` [E, H, I] as IBM ships them (transformers 5 renames them
``experts.gate_up_proj`` / ``experts.down_proj`` in memory; both are read), the router as
``router.layer``, and the shared expert's gate and up rows as one ``shared_mlp.input_linear`` [2S, H]
(split by the loader).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class GraniteMoeConfig(ModelConfig):
    attention_bias: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    shared_intermediate_size: int = 0


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> GraniteMoeConfig:
    shared = int(getattr(hf, "shared_intermediate_size", 0) or 0)
    return GraniteMoeConfig(
        architecture="GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        attention_multiplier=float(hf.attention_multiplier),
        logits_scaling=float(hf.logits_scaling),
        shared_intermediate_size=shared,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,  # the experts' own width
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def build(cfg: GraniteMoeConfig, experts: ExpertBackend,
          attention: Callable[[int], Attention] | None = None) -> MoECausalLM:
    """Granite MoE's network; ``attention(layer)`` builds another attention (Granite MoE SWA's)."""
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    h, dt = cfg.hidden_size, cfg.dtype

    def layer(i: int) -> DecoderLayer:
        attn = attention(i) if attention is not None else Attention(
            i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
            out_bias=cfg.attention_bias)
        attn.scale = cfg.attention_multiplier
        router = TopKRouter(h, cfg.num_experts, cfg.top_k, dt, normalize=True)
        shared = GatedMLP(h, cfg.shared_intermediate_size, cfg.hidden_act, dt) if cfg.shared_intermediate_size \
            else None
        mlp = MoEBlock(i, cfg.num_experts, router, experts, shared)
        return DecoderLayer(attn, mlp, norm(h), norm(h), residual_scale=cfg.residual_multiplier)

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h),
                       embedding_scale=cfg.embedding_multiplier, logits_divisor=cfg.logits_scaling)


_NAMES = (
    (re.compile(r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.(layer\.)?weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.shared_mlp\.input_linear\.weight$"), ".mlp.shared_expert.gate_up_proj.weight"),
    (re.compile(r"\.shared_mlp\.output_linear\.weight$"), ".mlp.shared_expert.down_proj.weight"),
)


def map_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


FAMILY = ModelFamily(
    "granitemoe",
    ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_local_experts",), ("embedding_multiplier",), ("residual_multiplier",),
                     ("attention_multiplier",), ("logits_scaling",)),
)
