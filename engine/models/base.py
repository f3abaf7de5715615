"""What a family file declares (:class:`ModelFamily`), and the helpers families share to read HF
configs and to compose the common parts (a Qwen-style MoE block or a dense MLP per layer, and a
whole decoder of such layers behind the family's own attention: :func:`softmax_moe_decoder`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig, eos_ids, parse_rope
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM

# ``norm(width)``: the family's RMSNorm (its eps and dtype), for attention's q/k norms.
NormFactory = Callable[[int], nn.Module]
# ``attention(layer, norm)``: a family's attention module for one layer.
AttentionFactory = Callable[[int, NormFactory], nn.Module]


def same_name(name: str) -> str:
    """The name map of a family whose checkpoint names are already the in-memory ones."""
    return name


def renaming(pairs: tuple[tuple[str, str], ...]) -> Callable[[str], str]:
    """The name map that replaces each ``(old, new)`` substring, in order."""

    def map_name(name: str) -> str:
        for old, new in pairs:
            name = name.replace(old, new)
        return name

    return map_name


@dataclass(frozen=True)
class ModelFamily:
    """One family: how to read its config, how to build its network, and its checkpoint names.

    ``parse_config(hf_config, model_dir, dtype)`` returns its :class:`ModelConfig` (subclass);
    ``build(config, experts)`` composes the network from layer classes, every MoE layer calling
    ``experts``; ``map_name(name)`` turns a checkpoint tensor name into the in-memory name (the
    transformers layout; "" for a tensor the family does not use; by default the name as it is);
    ``required_fields`` lists
    config.json fields that must be present (each entry: alternatives).
    """

    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[Any, Path, torch.dtype], ModelConfig]
    build: Callable[[ModelConfig, ExpertBackend], MoECausalLM]
    map_name: Callable[[str], str] = same_name
    required_fields: tuple[tuple[str, ...], ...] = ()


COMMON_FIELDS: tuple[tuple[str, ...], ...] = (
    ("vocab_size",),
    ("hidden_size",),
    ("num_hidden_layers",),
    ("num_attention_heads",),
    ("intermediate_size",),
    ("num_experts_per_tok",),
)


def moe_layer_flags(num_layers: int, num_experts: int, mlp_only: list[int], sparse_step: int) -> tuple[bool, ...]:
    """Which layers are MoE, following Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` rule."""
    step = max(int(sparse_step or 1), 1)
    return tuple(i not in set(mlp_only or []) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def qwen_moe_fields(hf: Any) -> dict[str, Any]:
    """The MoE fields Qwen2-MoE and Qwen3-MoE read alike: the experts, their width, top-k and its
    renormalisation, and which layers are MoE (``mlp_only_layers`` / ``decoder_sparse_step``)."""
    return dict(
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_layers=moe_layer_flags(hf.num_hidden_layers, hf.num_experts, hf.mlp_only_layers, hf.decoder_sparse_step),
    )


def head_dim_of(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def decoder_fields(hf: Any, model_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way from its HF config."""
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim_of(hf),
        rms_norm_eps=hf.rms_norm_eps,
        rope=parse_rope(hf.to_dict()),
        max_position_embeddings=hf.max_position_embeddings,
        hidden_act=hf.hidden_act,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        dtype=dtype,
        eos_token_ids=eos_ids(hf.to_dict(), model_dir),
    )


def qwen_moe_block(cfg: ModelConfig, idx: int, experts: ExpertBackend, *, normalize: bool,
                   weights_in_fp32: bool = False, shared_expert_size: int = 0) -> nn.Module:
    """Layer ``idx``'s feed-forward in the Qwen/Mixtral pattern: a softmax top-k MoE block (with a
    sigmoid-gated shared expert of ``shared_expert_size``) on MoE layers, a gated MLP elsewhere."""
    h, dt = cfg.hidden_size, cfg.dtype
    if not cfg.moe_layers[idx]:
        return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
    router = TopKRouter(h, cfg.num_experts, cfg.top_k, dt, normalize=normalize, weights_in_fp32=weights_in_fp32)
    shared = gate = None
    if shared_expert_size:
        shared, gate = GatedMLP(h, shared_expert_size, cfg.hidden_act, dt), Projection(h, 1, False, dt)
    return MoEBlock(idx, cfg.num_experts, router, experts, shared, gate)


def softmax_moe_decoder(cfg: ModelConfig, experts: ExpertBackend, attention: AttentionFactory, *, normalize: bool,
                        weights_in_fp32: bool = False, shared_expert_size: int = 0) -> MoECausalLM:
    """A decoder of pre-norm layers, each the family's ``attention(layer, norm)`` and
    :func:`qwen_moe_block` (``normalize``, ``weights_in_fp32``, ``shared_expert_size`` as there),
    with RMSNorms before each and at the end: the Qwen-MoE, OLMoE and Mixtral network."""
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=cfg.dtype)

    def layer(i: int) -> DecoderLayer:
        attn = attention(i, norm)
        mlp = qwen_moe_block(cfg, i, experts, normalize=normalize, weights_in_fp32=weights_in_fp32,
                             shared_expert_size=shared_expert_size)
        return DecoderLayer(attn, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size))
