"""The decoder shared by every MoE family, and the family descriptor the registry holds.

Parameter names follow the transformers in-memory layout (``model.layers.N.self_attn.q_proj.weight``),
so a family's checkpoint-name mapping only has to handle what differs from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.batch import ForwardBatch
from engine.config import ModelConfig, eos_ids, parse_rope
from engine.experts import ExpertBackend
from engine.kv_cache import PagedKVCache
from engine.layers.attention import Attention
from engine.layers.deltanet import GatedDeltaNet
from engine.layers.linear import Projection, linear
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoEBlock
from engine.layers.norm import make_norm
from engine.layers.rope import RotaryEmbedding
from engine.state_pool import RecurrentStatePool


@dataclass(frozen=True)
class ModelFamily:
    """How to read one family's config and checkpoint names.

    ``parse_config(hf_config, model_dir, dtype)`` returns the normalised :class:`ModelConfig`;
    ``map_name(name)`` turns a checkpoint tensor name into the canonical name (see module doc);
    ``required_fields`` lists config.json fields that must be present (each entry: alternatives).
    """

    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[Any, Path, torch.dtype], ModelConfig]
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


class DecoderLayer(nn.Module):
    """Pre-norm token mixer (attention, or a hybrid model's gated DeltaNet) + (MoE or dense)
    feed-forward, with residuals."""

    def __init__(self, cfg: ModelConfig, idx: int, backend: ExpertBackend) -> None:
        super().__init__()
        self.idx = idx
        self.input_layernorm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, cfg.zero_centered_norm)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: Attention | None = None
        if cfg.is_linear_layer(idx):
            self.linear_attn = GatedDeltaNet(cfg, idx)
        else:
            self.self_attn = Attention(cfg, idx)
        self.post_attention_layernorm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, cfg.zero_centered_norm)
        self.mlp: nn.Module
        if cfg.moe_layers[idx]:
            self.mlp = MoEBlock(cfg, idx, backend)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.dtype)

    def forward(self, h, rope, batch: ForwardBatch, kv: PagedKVCache, states: RecurrentStatePool | None):
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            h = h + self.linear_attn(x, batch, states.conv[self.idx], states.recurrent[self.idx])
        else:
            h = h + self.self_attn(x, rope, batch, kv.keys[self.idx], kv.values[self.idx])
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and final norm (the ``model.`` prefix of checkpoints)."""

    def __init__(self, cfg: ModelConfig, backend: ExpertBackend) -> None:
        super().__init__()
        # Uninitialised (the loader fills it) and frozen.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, cfg.zero_centered_norm)
        self.rotary = RotaryEmbedding(cfg)


class MoECausalLM(nn.Module):
    """A decoder-only MoE language model over a flattened batch and a paged KV cache."""

    def __init__(self, cfg: ModelConfig, backend: ExpertBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, backend)
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)

    def set_expert_backend(self, backend: ExpertBackend) -> None:
        """Route every MoE layer's experts through ``backend`` (e.g. the expert hierarchy)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.backend = backend

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache, states: RecurrentStatePool | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32. Hybrid models also need ``states``
        (each sequence's slot named in the batch)."""
        if self.config.linear_layer_ids and states is None:
            raise ValueError(f"{self.config.architecture} has linear-attention layers: forward needs a state pool")
        h = self.model.embed_tokens(batch.token_ids)  # [T, H]
        rope = self.model.rotary(batch.positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, rope, batch, kv, states)
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        return linear(h, self.lm_head.weight).float()


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
