"""DBRX (``DbrxForCausalLM``, Databricks): LayerNorms without bias, one fused ``Wqkv`` projection whose
q, k and v are clipped to ``clip_qkv``, grouped-query attention, and every layer an MoE of SwiGLU
experts routed by a softmax in the model dtype whose top k are divided by their p-norm
(``moe_normalize_expert_weights``).

Its checkpoints keep their own names (``transformer.blocks.N.norm_attn_norm.attn.Wqkv``, the experts as
``ffn.experts.mlp.w1``/``v1``/``w2``, each [E * I, H], ``w2`` transposed), and its settings in two
sub-configs (``attn_config``, ``ffn_config``). The rotary base is the top-level ``rope_parameters`` where
config.json has them, else ``attn_config.rope_theta`` as DBRX ships it (and as llama.cpp reads it):
transformers 5 reads only the former and turns a shipped DBRX config's 500000 into its default 10000."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import ModelConfig, RopeConfig, eos_ids, parse_rope, read_config_json
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention, ClippedAttention
from hearth.engine.layers.moe import MoEBlock, PNormRouter
from hearth.engine.layers.norm import LayerNorm
from hearth.engine.models.base import ModelFamily, renaming
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM

LAYER_NORM_EPS = 1e-5  # (nn.LayerNorm's default: DBRX's config names no eps)


@dataclass(frozen=True, kw_only=True)
class DbrxConfig(ModelConfig):
    clip_qkv: float | None
    normalize_p: float | None  # the p of the top-k weights' norm (None: not normalised)


def _rope(hf: Any, model_dir: Path) -> RopeConfig:
    """The top-level rotary parameters where config.json has them (or there is none: a GGUF file's
    config), else ``attn_config.rope_theta``."""
    raw = read_config_json(model_dir) if (model_dir / "config.json").is_file() else {"rope_parameters": True}
    if raw.get("rope_parameters") or raw.get("rope_theta"):
        return parse_rope(hf.to_dict())
    return RopeConfig(theta=float(getattr(hf.attn_config, "rope_theta", None) or 10000.0))


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DbrxConfig:
    attn, ffn, n = hf.attn_config, hf.ffn_config, hf.num_hidden_layers
    p = ffn.moe_normalize_expert_weights
    return DbrxConfig(
        architecture="DbrxForCausalLM",
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=n, num_heads=hf.num_attention_heads,
        num_kv_heads=attn.kv_n_heads, head_dim=hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=LAYER_NORM_EPS, rope=_rope(hf, model_dir), max_position_embeddings=hf.max_position_embeddings,
        hidden_act=(ffn.ffn_act_fn or {}).get("name", "silu"), tie_word_embeddings=False, dtype=dtype,
        eos_token_ids=eos_ids(hf.to_dict(), model_dir),
        intermediate_size=ffn.ffn_hidden_size, num_experts=ffn.moe_num_experts, top_k=ffn.moe_top_k,
        moe_intermediate_size=ffn.ffn_hidden_size, moe_layers=(True,) * n,
        clip_qkv=None if attn.clip_qkv is None else float(attn.clip_qkv),
        normalize_p=None if p is None else float(p),
    )


def build(cfg: DbrxConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(LayerNorm, h, cfg.rms_norm_eps, dt)

    def layer(i: int) -> DecoderLayer:
        shape = (i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt)
        attn = Attention(*shape) if cfg.clip_qkv is None else ClippedAttention(*shape, clip=cfg.clip_qkv)
        router = PNormRouter(h, cfg.num_experts, cfg.top_k, dt, p=cfg.normalize_p)
        return DecoderLayer(attn, MoEBlock(i, cfg.num_experts, router, experts), norm(), norm())

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm())


map_name = renaming((
    ("transformer.blocks.", "model.layers."), ("transformer.wte.", "model.embed_tokens."),
    ("transformer.norm_f.", "model.norm."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
    (".norm_attn_norm.norm_2.", ".post_attention_layernorm."), (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
    (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."), (".ffn.router.layer.", ".mlp.gate."),
    (".ffn.experts.mlp.w1", ".mlp.experts.gate_rows"), (".ffn.experts.mlp.v1", ".mlp.experts.up_rows"),
    (".ffn.experts.mlp.w2", ".mlp.experts.down_rows"),
))

FAMILY = ModelFamily("dbrx", ("DbrxForCausalLM",), parse_config, build, map_name,
                     (("vocab_size",), ("d_model",), ("n_layers",), ("n_heads",)))
