"""AfMoE (``AfmoeForCausalLM``: Arcee's Trinity): attention with per-head q/k norms, a sigmoid output
gate of its own projection (``gate_proj``), sliding-window layers where ``layer_types`` says and no
rotary on the global ones; norms before and after both the attention and the feed-forward, each
scaled in fp32; the first ``num_dense_layers`` feed-forwards dense, then routed experts beside shared
ones, sigmoid routing corrected by ``expert_bias``, renormalised and times ``route_scale``; muP's
sqrt(hidden) on the embeddings where ``mup_enabled``.

Checkpoints name the router ``mlp.router.gate`` and its bias ``mlp.expert_bias``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.batch import LayerContext
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import Fp32ScaledRMSNorm
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import linear


@dataclass(frozen=True, kw_only=True)
class AfmoeConfig(ModelConfig):
    shared_experts: int = 0
    route_scale: float = 1.0
    attention_bias: bool = False
    mup: bool = False
    nope_layers: tuple[bool, ...] = ()


class OutputGatedAttention(Attention):
    """Attention whose output is scaled by the sigmoid of its own projection of the input, per channel,
    before ``o_proj``."""

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(layer_idx, hidden, num_heads, num_kv_heads, head_dim, dtype, **kwargs)
        self.gate_proj = Projection(hidden, num_heads * head_dim, False, dtype)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        return torch.cat([q, linear(x, self.gate_proj.weight)], dim=-1), k, v  # the gate rides with q

    def split_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, gate = q.split([self.q_size, self.q_size], dim=-1)
        return q.reshape(q.shape[0], self.num_heads, self.head_dim), gate

    def project_out(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return linear(out * torch.sigmoid(gate), self.o_proj.weight, self.o_proj.bias)


class SandwichDecoderLayer(DecoderLayer):
    """``h + post_attn(mixer(in(h)))``, then ``h + post_mlp(mlp(pre_mlp(h)))``: here the checkpoint's
    ``post_attention_layernorm`` norms the attention's output, ``pre_mlp_layernorm`` the feed-forward's input."""

    native_order = False

    def __init__(self, mixer: nn.Module, mlp: nn.Module, norm) -> None:
        super().__init__(mixer, mlp, norm(), norm())
        self.pre_mlp_layernorm, self.post_mlp_layernorm = norm(), norm()

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self._mixer(self.input_layernorm(h), ctx))
        return self.feed_forward(h, ctx)

    def feed_forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        return h + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(h), ctx))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> AfmoeConfig:
    n, dense = hf.num_hidden_layers, int(getattr(hf, "num_dense_layers", 0) or 0)
    kinds = list(hf.layer_types)
    window = getattr(hf, "sliding_window", None) or None
    return AfmoeConfig(
        architecture="AfmoeForCausalLM",
        **decoder_fields(hf, model_dir, dtype),
        intermediate_size=hf.intermediate_size, num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, moe_layers=tuple(i >= dense for i in range(n)),
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        nope_layers=tuple(kind != "sliding_attention" for kind in kinds),
        shared_experts=int(getattr(hf, "num_shared_experts", 0) or 0),
        route_scale=float(getattr(hf, "route_scale", 1.0) or 1.0),
        attention_bias=bool(getattr(hf, "attention_bias", False)), mup=bool(getattr(hf, "mup_enabled", False)),
    )


def build(cfg: AfmoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(Fp32ScaledRMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def feed_forward(i: int) -> nn.Module:
        if not cfg.moe_layers[i]:
            return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
        router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, dt, scoring="sigmoid", scaling=cfg.route_scale,
                                   logits_in_fp32=False)
        shared = GatedMLP(h, cfg.moe_intermediate_size * cfg.shared_experts, cfg.hidden_act, dt) \
            if cfg.shared_experts else None
        return MoEBlock(i, cfg.num_experts, router, experts, shared)

    def layer(i: int) -> DecoderLayer:
        attn = OutputGatedAttention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                                    out_bias=cfg.attention_bias, qk_norm=norm, window=cfg.window(i))
        attn.use_rope = not cfg.nope_layers[i]
        return SandwichDecoderLayer(attn, feed_forward(i), partial(norm, h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h),
                       embedding_scale=h**0.5 if cfg.mup else 1.0)


_NAMES = (
    (re.compile(r"\.mlp\.router\.gate\.weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.mlp\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
)


def map_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


FAMILY = ModelFamily(
    "afmoe",
    ("AfmoeForCausalLM",),
    parse_config,
    build,
    map_name,
    COMMON_FIELDS + (("num_experts",), ("moe_intermediate_size",)),
)
