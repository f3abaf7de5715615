"""Kolibri-1 (``Kolibri1ForCausalLM``): attention with per-head q/k norms, sliding-window layers where
``layer_types`` says and, where the model has a window, no rotary on its global layers; four norms per
layer (after the attention, before and after the feed-forward, as AfMoE's ``SandwichDecoderLayer``);
every layer MoE, routed by the top k of the fp32 logits plus a correction bias, weighted by the chosen
logits' sigmoids (renormalised where ``norm_topk_prob``), beside an ungated shared expert."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import GroupedTopKRouter, MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.afmoe import SandwichDecoderLayer
from hearth.engine.models.base import ModelFamily, decoder_fields
from hearth.engine.models.decoder import MoECausalLM
from hearth.engine.models.glm4_moe import Glm4MoeConfig


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Glm4MoeConfig:
    kinds, n = list(hf.layer_types), hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or None
    return Glm4MoeConfig(
        architecture="Kolibri1ForCausalLM", **decoder_fields(hf, model_dir, dtype),
        num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
        intermediate_size=hf.shared_expert_intermediate_size, moe_layers=(True,) * n,
        sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds[:n]),
        nope_layers=tuple(window is not None and kind != "sliding_attention" for kind in kinds[:n]),
        norm_topk_prob=bool(hf.norm_topk_prob), use_qk_norm=True)


def build(cfg: Glm4MoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def layer(i: int) -> SandwichDecoderLayer:
        attn = Attention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, qk_norm=norm, window=cfg.window(i))
        attn.use_rope = not cfg.nope_layers[i]
        router = GroupedTopKRouter(h, cfg.num_experts, cfg.top_k, dt, normalize=cfg.norm_topk_prob,
                                   bias_on_logits=True)
        shared = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)  # (the shared expert's width)
        return SandwichDecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts, shared), partial(norm, h))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(h))


# Its four norms by name, in the checkpoint (either naming) -> the sandwich layer's: the attention's output
# norm is ours ``post_attention_layernorm``, the feed-forward's input norm ours ``pre_mlp_layernorm``.
_NORMS = {"post_attention_layernorm": "pre_mlp_layernorm", "post_self_attn_layernorm": "post_attention_layernorm",
          "post_attn_norm": "post_attention_layernorm", "post_ffn_norm": "post_mlp_layernorm"}
_NORM = re.compile(r"\.(" + "|".join(_NORMS) + r")\.")


def map_name(name: str) -> str:
    name = _NORM.sub(lambda m: f".{_NORMS[m.group(1)]}.", name)
    return name.replace(".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias") \
        .replace(".mlp.shared_experts.", ".mlp.shared_expert.")


FAMILY = ModelFamily("kolibri1", ("Kolibri1ForCausalLM",), parse_config, build, map_name,
                     (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",),
                      ("num_experts",), ("moe_intermediate_size",), ("shared_expert_intermediate_size",)))
