"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): GQA attention with q/k/v bias where configured,
per-head q/k norms where ``use_qk_norm``, rotary on part of each head (``partial_rotary_factor``);
the first ``first_k_dense_replace`` layers dense, the rest MoE with a shared expert and sigmoid
routing corrected by ``e_score_correction_bias``, grouped (``n_group``, ``topk_group``) and scaled
by ``routed_scaling_factor``. Multi-token-prediction layers (numbered past the last) are skipped."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock, PostNormedMoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class GroupedRoutingConfig(ModelConfig):
    """The DeepSeek-style MoE choices GLM-4.5 and DeepSeek-V2/V3 share."""

    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring: str = "sigmoid"
    correction_bias: bool = True
    group_score: str = "top2"
    mlp_bias: bool = False  # biases on the dense and shared MLPs (DeepSeek-V2's mlp_bias)


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(GroupedRoutingConfig):
    attention_bias: bool = False  # on the q/k/v projections
    out_bias: bool = False  # on the output projection (dots.llm1's attention_bias covers it too)
    use_qk_norm: bool = False
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary (EXAONE-MoE's global layers; empty: none)


def grouped_routing_fields(hf: Any) -> dict[str, Any]:
    """The routing fields every DeepSeek-style config names alike; the dense layers where
    ``mlp_layer_types`` names them ("dense" / "sparse"), else the first ``first_k_dense_replace``."""
    n, first_dense = hf.num_hidden_layers, int(getattr(hf, "first_k_dense_replace", 0) or 0)
    kinds = getattr(hf, "mlp_layer_types", None)
    return dict(
        num_experts=getattr(hf, "n_routed_experts", None) or hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        intermediate_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,  # (none: all MoE)
        moe_layers=tuple(kind == "sparse" for kind in kinds) if kinds else tuple(i >= first_dense for i in range(n)),
        n_shared_experts=int(getattr(hf, "n_shared_experts", 0) or 0),
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
        n_group=int(getattr(hf, "n_group", 1) or 1),
        topk_group=int(getattr(hf, "topk_group", 1) or 1),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
    )


def grouped_moe_block(cfg: GroupedRoutingConfig, idx: int, experts: ExpertBackend,
                      post_norm: nn.Module | None = None) -> nn.Module:
    """Layer ``idx``'s feed-forward: a gated MLP on dense layers; elsewhere the routed experts by
    :class:`GroupedTopKRouter` plus the shared experts (one MLP ``n_shared_experts`` wide), their sum
    normalised by ``post_norm`` where given (A.X K1's)."""
    h, dt = cfg.hidden_size, cfg.dtype
    if not cfg.moe_layers[idx]:
        return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt, cfg.mlp_bias)
    router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, dt, scoring=cfg.scoring,
                               correction_bias=cfg.correction_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                               group_score=cfg.group_score, normalize=cfg.norm_topk_prob,
                               scaling=cfg.routed_scaling_factor)
    shared = GatedMLP(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, dt, cfg.mlp_bias) \
        if cfg.n_shared_experts else None
    if post_norm is not None:
        return PostNormedMoEBlock(idx, cfg.num_experts, router, experts, shared, post_mlp_layernorm=post_norm)
    return MoEBlock(idx, cfg.num_experts, router, experts, shared)


def map_grouped_name(name: str) -> str:
    """DeepSeek-style checkpoint names -> ours: ``shared_experts`` is our ``shared_expert``."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    return Glm4MoeConfig(
        architecture="Glm4MoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        **grouped_routing_fields(hf),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        use_qk_norm=bool(getattr(hf, "use_qk_norm", False)),
    )


def build(cfg: Glm4MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         bias=cfg.attention_bias, out_bias=cfg.out_bias, qk_norm=norm if cfg.use_qk_norm else None,
                         window=cfg.window(i))
        attn.use_rope = not (cfg.nope_layers and cfg.nope_layers[i])
        return DecoderLayer(attn, grouped_moe_block(cfg, i, experts), norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


FAMILY = ModelFamily(
    "glm4_moe",
    ("Glm4MoeForCausalLM",),
    parse_config,
    build,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",)),
)
