"""Qwen3-Next: a hybrid of gated DeltaNet (linear attention) and gated full attention layers (3:1),
zero-centred RMSNorm, partial rotary embeddings, softmax top-k experts plus a gated shared expert.

Checkpoint names follow transformers. The DeltaNet input projections are fused per key head
(``in_proj_qkvz``, ``in_proj_ba``), which :class:`FusedGatedDeltaNet` reads; Qwen3.5 reuses this
family's hybrid composition with the separate projections. Multi-token-prediction weights
(``mtp.*``) are not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import LinearAttentionConfig, ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import GatedAttention
from hearth.engine.layers.deltanet import GatedDeltaNet
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import ZeroCenteredRMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields, moe_layer_flags, qwen_moe_block
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import linear


@dataclass(frozen=True, kw_only=True)
class QwenHybridConfig(ModelConfig):
    qkv_bias: bool = False
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's DeltaNet: q, k, v and z come out of one projection grouped per key head
    ([q (Dk), k (Dk), v (group * Dv), z (group * Dv)] for each), and b, a out of another."""

    def _make_projections(self, hidden: int, dtype: torch.dtype) -> None:
        la = self.la
        self.in_proj_qkvz = Projection(hidden, la.conv_dim + la.value_dim, False, dtype)
        self.in_proj_ba = Projection(hidden, 2 * la.num_value_heads, False, dtype)

    def _project(self, x: torch.Tensor):
        la, t = self.la, x.shape[0]
        mixed = linear(x, self.in_proj_qkvz.weight).view(t, la.num_key_heads, -1)
        gv = self.group * la.value_head_dim
        q, k, v, z = mixed.split([la.key_head_dim, la.key_head_dim, gv, gv], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = linear(x, self.in_proj_ba.weight).view(t, la.num_key_heads, -1).split(self.group, dim=-1)
        return qkv, z.reshape(t, la.num_value_heads, -1), b.reshape(t, -1), a.reshape(t, -1)


def linear_attention_of(hf: Any) -> LinearAttentionConfig:
    """The DeltaNet shape of a Qwen hybrid config."""
    return LinearAttentionConfig(
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
    )


def hybrid_config(hf: Any, model_dir: Path, dtype: torch.dtype, architecture: str, moe_layers: tuple[bool, ...],
                  norm_topk_prob: bool, intermediate_size: int) -> QwenHybridConfig:
    """The config of a Qwen hybrid (Qwen3-Next, Qwen3.5) from its text config."""
    return QwenHybridConfig(
        architecture=architecture,
        **decoder_fields(hf, model_dir, dtype),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        intermediate_size=intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_layers=moe_layers,
        layer_types=tuple(hf.layer_types),
        linear_attention=linear_attention_of(hf),
    )


def build_hybrid(cfg: QwenHybridConfig, experts: ExpertBackend, deltanet: type[GatedDeltaNet]) -> MoECausalLM:
    """A Qwen hybrid: ``deltanet`` layers where ``layer_types`` says linear attention, gated attention
    with q/k norms elsewhere, zero-centred norms, and MoE blocks with a gated shared expert."""
    norm = partial(ZeroCenteredRMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        if cfg.is_linear_layer(i):
            mixer = deltanet(i, cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps, cfg.dtype)
        else:
            mixer = GatedAttention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                   bias=cfg.qkv_bias, qk_norm=norm, out_bias=cfg.qkv_bias)
        mlp = qwen_moe_block(cfg, i, experts, normalize=cfg.norm_topk_prob,
                             shared_expert_size=cfg.shared_expert_intermediate_size)
        return DecoderLayer(mixer, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> QwenHybridConfig:
    moe = moe_layer_flags(hf.num_hidden_layers, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step)
    return hybrid_config(hf, model_dir, dtype, "Qwen3NextForCausalLM", moe, bool(hf.norm_topk_prob),
                         hf.intermediate_size)


def build(cfg: QwenHybridConfig, experts: ExpertBackend) -> MoECausalLM:
    return build_hybrid(cfg, experts, FusedGatedDeltaNet)


def map_name(name: str) -> str:
    return "" if name.startswith("mtp.") else name


FAMILY = ModelFamily(
    "qwen3_next",
    ("Qwen3NextForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",), ("linear_num_value_heads",)),
)
