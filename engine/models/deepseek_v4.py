"""DeepSeek-V4 (``DeepseekV4ForCausalLM``; V4-Flash, V4-Pro).

- The residual stream is ``hc_mult`` streams mixed around every block by hyper-connections
  (``engine/layers/hyper.py``), collapsed by ``hc_head`` before the final norm.
- Attention (``engine/layers/compressed_attention.py``) is shared-KV multi-query attention over a
  sliding window with a sink per head; ``layer_types`` adds, per layer, compressed entries every
  ``compress_rates`` tokens: heavily compressed (HCA) or compressed sparse with a lightning
  indexer (CSA). The output leaves through a grouped low-rank projection.
- Every layer is MoE with one shared expert; routed and shared experts clamp their gate and up
  at ``swiglu_limit``. The first layers (``mlp_layer_types`` "hash_moe") take each token's experts
  from the table ``tid2eid``; the others the top k of ``sqrt(softplus(logits))`` plus a correction
  bias. Weights are renormalised and scaled by ``routed_scaling_factor``.
- Rotary is interleaved pairs on the last ``qk_rope_head_dim`` channels of each head: the "main"
  table on sliding layers, the "compress" one (its own theta and YaRN) on compressed layers.
- Norms, sinks, position biases and the hyper-connection weights stay fp32 in every dtype, as in
  transformers.

Checkpoints come as shipped (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn`` …) or in
transformers' in-memory names; :func:`map_name` renames the former as transformers does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.config import ConfigError
from hearth.engine.config import ModelConfig, RopeConfig, parse_rope
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.batch import ForwardBatch, LayerContext, StaticBatch
from hearth.engine.layers.compressed_attention import (
    CompressedAttention,
    LightningIndexer,
    PairRotary,
    SparseCompressor,
    WindowCompressor,
)
from hearth.engine.layers.hyper import HyperConnection, HyperHead
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import HashRouter, MoEBlock, ScoredTopKRouter
from hearth.engine.layers.norm import RMSNormScaledInFp32
from hearth.engine.layers.rope import inverse_frequencies
from hearth.engine.models.base import ModelFamily, decoder_fields
from hearth.engine.models.decoder import MoECausalLM
from hearth.engine.ops import ClampedSiLU, linear

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(ModelConfig):
    q_lora_rank: int
    rope_dim: int  # rotating channels at the end of each head
    compress_rope: RopeConfig
    o_groups: int
    o_lora_rank: int
    window: int
    attention_kinds: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    compress_rates: dict[str, int]
    index_heads: int
    index_head_dim: int
    index_topk: int
    hash_layers: tuple[bool, ...]
    scoring: str
    routed_scaling_factor: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float


def _cache_columns(kind: str, head_dim: int, index_head_dim: int) -> int:
    """Per-token cache values of a layer: see WindowCompressor.columns (CSA adds its indexer's)."""
    return {SLIDING: 0, HCA: 3 * head_dim, CSA: 5 * head_dim + 5 * index_head_dim}[kind]


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> DeepseekV4Config:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"DeepSeek-V4 with hidden_act '{hf.hidden_act}' is not supported (silu is)")
    fields = decoder_fields(hf, model_dir, dtype)
    rope = hf.rope_parameters
    rope_dim = int(hf.head_dim * hf.partial_rotary_factor)
    main = RopeConfig(theta=float(rope["main"]["rope_theta"]),
                      params={"partial_rotary_factor": hf.partial_rotary_factor})
    fields.update(rope=main, hidden_act=ClampedSiLU(float(hf.swiglu_limit)).name, num_kv_heads=1)
    kinds = tuple(hf.layer_types)
    return DeepseekV4Config(
        architecture="DeepseekV4ForCausalLM",
        **fields,
        intermediate_size=hf.moe_intermediate_size,
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        moe_layers=(True,) * hf.num_hidden_layers,
        kv_layer_layouts=tuple((1, hf.head_dim, _cache_columns(k, hf.head_dim, hf.index_head_dim)) for k in kinds),
        q_lora_rank=hf.q_lora_rank,
        rope_dim=rope_dim,
        compress_rope=parse_rope({"rope_parameters": dict(rope["compress"])}),
        o_groups=hf.o_groups,
        o_lora_rank=hf.o_lora_rank,
        window=hf.sliding_window,
        attention_kinds=kinds,
        compress_rates=dict(hf.compress_rates),
        index_heads=hf.index_n_heads,
        index_head_dim=hf.index_head_dim,
        index_topk=hf.index_topk,
        hash_layers=tuple(kind == "hash_moe" for kind in hf.mlp_layer_types),
        scoring=hf.scoring_func,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        hc_mult=hf.hc_mult,
        hc_sinkhorn_iters=hf.hc_sinkhorn_iters,
        hc_eps=float(hf.hc_eps),
    )


class HyperDecoderLayer(nn.Module):
    """A block over the hyper-connection streams: attention, then the MoE block, each between its
    hyper-connection's collapse and merge."""

    def __init__(self, attention: CompressedAttention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, attn_hc: HyperConnection, ffn_hc: HyperConnection) -> None:
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # h: [T, streams, hidden]
        post, comb, x = self.attn_hc(h)
        h = HyperConnection.merge(h, self.self_attn(self.input_layernorm(x), ctx), post, comb)
        post, comb, x = self.ffn_hc(h)
        return HyperConnection.merge(h, self.mlp(self.post_attention_layernorm(x), ctx), post, comb)


class HyperCausalLM(MoECausalLM):
    """The model over hyper-connection streams: embeddings copied to every stream, the layers, the
    ``hc_head`` collapse, the final norm and the output projection."""

    def __init__(self, cfg: DeepseekV4Config, layers: list[HyperDecoderLayer], norm: nn.Module,
                 rotary: PairRotary) -> None:
        super().__init__(cfg, layers, norm)  # type: ignore[arg-type] - the streams' layers
        self.model.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.model.pair_rotary = rotary

    def native_layers(self, kv) -> None:
        return None  # the native decode kernels know no hyper-connections

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch | StaticBatch, kv, states=None, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32. A pipeline stage (``layer_range``) runs
        its layers only: from ``hidden`` [T, streams, hidden] (the previous stage's streams) unless it
        is the first, and returns its streams unless it is the last."""
        if isinstance(batch, StaticBatch):
            raise NotImplementedError("fixed-shape decode steps do not run DeepSeek-V4")
        first, end = self.config.layer_range or (0, self.config.num_layers)
        if first == 0:
            h = self.model.embed_tokens(batch.token_ids)  # [T, hidden]
            h = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, streams, hidden]
        elif hidden is None:
            raise ValueError(f"pipeline stage [{first}, {end}) needs the previous stage's hidden states")
        else:
            h = hidden
        rotary = self.model.pair_rotary
        tables = {kind: rotary.table(kind, batch.positions, h.dtype) for kind in ("main", "compress")}
        ctx = LayerContext(batch, kv, states, tables["main"], {**tables, "rotary": rotary})
        for layer in self.model.layers[first:end]:
            h = layer(h, ctx)
        if end < self.config.num_layers:
            return h
        h = self.model.norm(self.model.hc_head(h.index_select(0, batch.logits_indices)))
        return linear(h, self.lm_head.weight).float()


def attention(cfg: DeepseekV4Config, i: int) -> CompressedAttention:
    """Layer ``i``'s attention with the compressor its kind asks for."""
    h, d, eps, dt, kind = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, cfg.attention_kinds[i]
    compressor = None
    if kind == HCA:
        compressor = WindowCompressor(h, d, cfg.compress_rates[HCA], False, eps, dt)
    elif kind == CSA:
        rate = cfg.compress_rates[CSA]
        indexer = LightningIndexer(h, cfg.q_lora_rank, cfg.index_heads, cfg.index_head_dim, rate, cfg.index_topk,
                                   eps, dt)
        compressor = SparseCompressor(h, d, rate, eps, dt, indexer)
    return CompressedAttention(i, h, cfg.num_heads, d, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
                               o_lora_rank=cfg.o_lora_rank, window=cfg.window, norm_eps=eps, dtype=dt,
                               compressor=compressor)


def moe_block(cfg: DeepseekV4Config, i: int, experts: ExpertBackend) -> MoEBlock:
    h, dt = cfg.hidden_size, cfg.dtype
    options = dict(scoring=cfg.scoring, scaling=cfg.routed_scaling_factor)
    router = HashRouter(h, cfg.num_experts, cfg.top_k, dt, vocab_size=cfg.vocab_size, **options) \
        if cfg.hash_layers[i] else ScoredTopKRouter(h, cfg.num_experts, cfg.top_k, dt, **options)
    return MoEBlock(i, cfg.num_experts, router, experts, GatedMLP(h, cfg.moe_intermediate_size, cfg.hidden_act, dt))


def build(cfg: DeepseekV4Config, experts: ExpertBackend) -> HyperCausalLM:
    norm = partial(RMSNormScaledInFp32, eps=cfg.rms_norm_eps, dtype=torch.float32)
    hyper = partial(HyperConnection, cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def layer(i: int) -> HyperDecoderLayer:
        return HyperDecoderLayer(attention(cfg, i), moe_block(cfg, i, experts), norm(cfg.hidden_size),
                                 norm(cfg.hidden_size), hyper(), hyper())

    frequencies = {"main": inverse_frequencies(cfg.rope, cfg.rope_dim, cfg.max_position_embeddings),
                   "compress": inverse_frequencies(cfg.compress_rope, cfg.rope_dim, cfg.max_position_embeddings)}
    return HyperCausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], norm(cfg.hidden_size),
                         PairRotary(frequencies))


# The shipped checkpoint's names -> transformers' in-memory ones, in transformers' order (each rule
# sees the result of the ones before it). Names already in memory form pass through unchanged.
_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
    (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
))


def map_name(name: str) -> str:
    inner = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        inner = pattern.sub(replacement, inner)
    return inner if inner == "lm_head.weight" else f"model.{inner}"


FAMILY = ModelFamily(
    "deepseek_v4",
    ("DeepseekV4ForCausalLM",),
    parse_config,
    build,
    map_name,
    (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("head_dim",),
     ("n_routed_experts",), ("moe_intermediate_size",), ("q_lora_rank",)),
)
