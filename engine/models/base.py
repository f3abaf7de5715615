"""What a family file declares (:class:`ModelFamily`), and the helpers families share to read HF
configs and to compose the common parts (a Qwen-style MoE block or a dense MLP per layer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig, eos_ids, parse_rope
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.models.decoder import MoECausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One family: how to read its config, how to build its network, and its checkpoint names.

    ``parse_config(hf_config, model_dir, dtype)`` returns its :class:`ModelConfig` (subclass);
    ``build(config, experts)`` composes the network from layer classes, every MoE layer calling
    ``experts``; ``map_name(name)`` turns a checkpoint tensor name into the in-memory name (the
    transformers layout; "" for a tensor the family does not use); ``required_fields`` lists
    config.json fields that must be present (each entry: alternatives).
    """

    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[Any, Path, torch.dtype], ModelConfig]
    build: Callable[[ModelConfig, ExpertBackend], MoECausalLM]
    map_name: Callable[[str], str]
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
