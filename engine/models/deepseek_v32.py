"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's network with DeepSeek sparse attention
(``engine/layers/dsa.py``): a lightning indexer per layer picks the ``index_topk`` tokens each query
attends to. Everything else (latent attention, grouped sigmoid routing with its correction bias,
shared experts, dense leading layers by ``mlp_layer_types``) is DeepSeek-V3's. The indexer rotates
its keys as halves; the main attention as pairs (transformers always interleaves V3.2's). The
multi-token-prediction layers (numbered past the last) are skipped."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.dsa import IndexedLatentAttention, TokenIndexer
from hearth.engine.models.base import COMMON_FIELDS, ModelFamily, decoder_fields
from hearth.engine.models.decoder import MoECausalLM
from hearth.engine.models.deepseek_v3 import DeepseekConfig, build, latent_attention, latent_attention_fields
from hearth.engine.models.glm4_moe import grouped_routing_fields, map_grouped_name


@dataclass(frozen=True, kw_only=True)
class SparseAttentionConfig:
    """The lightning indexer's shape, and which layers reuse an earlier layer's choice."""

    topk: int
    heads: int
    head_dim: int
    interleaved: bool  # the indexer's rotary on adjacent pairs (GLM-5) or halves (V3.2)
    shared: tuple[bool, ...]  # per layer: no indexer of its own (GLM-5's "shared" layers)


@dataclass(frozen=True, kw_only=True)
class SparseDeepseekConfig(DeepseekConfig):
    dsa: SparseAttentionConfig

    def stage_may_start(self, idx: int) -> bool:
        return not self.dsa.shared[idx]

    def __post_init__(self) -> None:
        if self.layer_range is not None and self.dsa.shared[self.layer_range[0]]:
            raise ConfigError(f"a pipeline stage cannot start at layer {self.layer_range[0]}: it reuses the sparse "
                              "selection of the layer before it (start the stage one layer earlier or later)")


def parse_sparse(hf: Any, model_dir: Path, dtype: torch.dtype, architecture: str, *, interleaved: bool,
                 shared: tuple[bool, ...]) -> SparseDeepseekConfig:
    """A DSA config: DeepSeek-V3's fields, ``mlp_layer_types``' dense layers, the indexer's shape and
    the cache values' extra columns (the index key) on layers with an indexer."""
    if not getattr(hf, "q_lora_rank", None):
        raise ConfigError(f"{architecture} without q_lora_rank is not supported (the indexer reads the low-rank "
                          "query)")
    if shared and shared[0]:
        raise ConfigError(f"{architecture}: the first layer cannot reuse an earlier layer's sparse selection")
    routing = grouped_routing_fields(hf)
    fields = decoder_fields(hf, model_dir, dtype) | latent_attention_fields(hf)
    fields["mla"] = replace(fields["mla"], rope_style="interleaved")
    rank, rope, index_dim = hf.kv_lora_rank, hf.qk_rope_head_dim, hf.index_head_dim
    shared = shared or (False,) * hf.num_hidden_layers
    dsa = SparseAttentionConfig(topk=hf.index_topk, heads=hf.index_n_heads, head_dim=index_dim,
                                interleaved=interleaved, shared=shared)
    layouts = tuple((1, rank, rope + (0 if s else index_dim)) for s in shared)
    return SparseDeepseekConfig(architecture=architecture, **fields, **routing, dsa=dsa, kv_layer_layouts=layouts)


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> SparseDeepseekConfig:
    return parse_sparse(hf, model_dir, dtype, "DeepseekV32ForCausalLM", interleaved=False, shared=())


def sparse_attention(cfg: SparseDeepseekConfig, i: int) -> IndexedLatentAttention:
    """Layer ``i``'s latent attention with its indexer (none on a shared layer)."""
    d = cfg.dsa
    indexer = None if d.shared[i] else TokenIndexer(
        cfg.hidden_size, cfg.mla.q_lora_rank, d.heads, d.head_dim, cfg.mla.qk_rope_head_dim, d.topk,
        d.interleaved, cfg.dtype)
    return latent_attention(cfg, i, IndexedLatentAttention, indexer=indexer)


def build_sparse(cfg: SparseDeepseekConfig, experts: ExpertBackend) -> MoECausalLM:
    """DeepSeek-V3's network on sparse latent attention."""
    return build(cfg, experts, attention=partial(sparse_attention, cfg))


FAMILY = ModelFamily(
    "deepseek_v32",
    ("DeepseekV32ForCausalLM",),
    parse_config,
    build_sparse,
    map_grouped_name,
    COMMON_FIELDS + (("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), ("kv_lora_rank",),
                     ("index_topk",)),
)
