"""LFM2-MoE (``Lfm2MoeForCausalLM``: LFM2-8B-A1B): a hybrid of gated short-convolution layers
(``layer_types`` "conv", :class:`~hearth.engine.layers.short_conv.ShortConv`, their histories in the
recurrent-state pool) and GQA attention layers with per-head q/k norms; the first ``num_dense_layers``
feed-forwards dense (SiLU gated), then routed experts by sigmoid scores, chosen on the scores plus
``expert_bias``, renormalised (+1e-6) and scaled, all in the model dtype.

Checkpoints name the parts ``operator_norm`` / ``ffn_norm`` (the pre-norms), ``embedding_norm`` (the
final norm), ``feed_forward`` with ``w1`` / ``w3`` / ``w2`` (gate / up / down), ``q_layernorm`` /
``k_layernorm`` and ``out_proj``; the names here are transformers' usual ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError
from hearth.engine.config import LinearAttentionConfig, ModelConfig, eos_ids, parse_rope
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, ScoredTopKRouter
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.layers.short_conv import ShortConv
from hearth.engine.models.base import ModelFamily, head_dim_of
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM


@dataclass(frozen=True, kw_only=True)
class Lfm2MoeConfig(ModelConfig):
    conv_bias: bool = False
    routing_bias: bool = True  # (the router's expert_bias; ModelConfig.expert_bias is the experts' own biases)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Lfm2MoeConfig:
    n = hf.num_hidden_layers
    kinds = list(getattr(hf, "layer_types", None) or [])
    if len(kinds) != n or any(kind not in ("conv", "full_attention") for kind in kinds):
        raise ConfigError(f"Lfm2MoeForCausalLM: layer_types must name each of the {n} layers 'conv' or "
                          f"'full_attention' (got {kinds})")
    dense = int(getattr(hf, "num_dense_layers", 0) or 0)
    return Lfm2MoeConfig(
        architecture="Lfm2MoeForCausalLM",
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=n, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, head_dim=head_dim_of(hf), rms_norm_eps=hf.norm_eps,
        rope=parse_rope(hf.to_dict()), max_position_embeddings=hf.max_position_embeddings, hidden_act="silu",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), dtype=dtype,
        eos_token_ids=eos_ids(hf.to_dict(), model_dir),
        intermediate_size=hf.intermediate_size, num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, moe_layers=tuple(i >= dense for i in range(n)),
        layer_types=tuple("linear_attention" if kind == "conv" else kind for kind in kinds),
        linear_attention=LinearAttentionConfig(0, 0, 0, 0, conv_kernel=hf.conv_L_cache, channels=hf.hidden_size),
        conv_bias=bool(getattr(hf, "conv_bias", False)), routing_bias=bool(getattr(hf, "use_expert_bias", True)),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
    )


def build(cfg: Lfm2MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    h, dt = cfg.hidden_size, cfg.dtype

    def layer(i: int) -> DecoderLayer:
        if cfg.is_linear_layer(i):
            mixer = ShortConv(i, h, cfg.linear_attention.conv_kernel, cfg.conv_bias, dt)
        else:
            mixer = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, qk_norm=norm)
        if not cfg.moe_layers[i]:
            mlp = GatedMLP(h, cfg.intermediate_size, "silu", dt)
        else:
            router = ScoredTopKRouter(h, cfg.num_experts, cfg.top_k, dt, scoring="sigmoid",
                                      scaling=cfg.routed_scaling_factor, correction_bias=cfg.routing_bias,
                                      normalize=cfg.norm_topk_prob, eps=1e-6)
            mlp = MoEBlock(i, cfg.num_experts, router, experts)
        return DecoderLayer(mixer, mlp, norm(h), norm(h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


_NAMES = (
    (re.compile(r"^model\.embedding_norm\."), "model.norm."),
    (re.compile(r"\.operator_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
    (re.compile(r"\.feed_forward\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.feed_forward\."), ".mlp."),
    (re.compile(r"\.w1\.weight$"), ".gate_proj.weight"),
    (re.compile(r"\.w3\.weight$"), ".up_proj.weight"),
    (re.compile(r"\.w2\.weight$"), ".down_proj.weight"),
    (re.compile(r"\.self_attn\.q_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.self_attn\.k_layernorm\."), ".self_attn.k_norm."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
)


def map_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        name = pattern.sub(replacement, name)
    return name


FAMILY = ModelFamily(
    "lfm2_moe",
    ("Lfm2MoeForCausalLM",),
    parse_config,
    build,
    map_name,
    (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("num_experts",),
     ("num_experts_per_tok",), ("moe_intermediate_size",), ("layer_types",), ("conv_L_cache",)),
)
