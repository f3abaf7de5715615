"""What every family's GGUF file has in common, as llama.cpp's converter writes it: the metadata
from the config (:func:`common_fields`), and the description of one family (:class:`WriteFamily`)
that ``gguf_write_families`` lists."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from hearth.engine.config import parse_rope

Fields = dict[str, Any]


class ConvertError(ValueError):
    """A checkpoint the GGUF writer cannot convert, or an unknown quantization."""



def _no_fields(cfg: dict, fields: Fields) -> None:
    """A family whose metadata are the common ones."""


def _as_is(target: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    yield target, t


@dataclass(frozen=True)
class WriteFamily:
    """One family as llama.cpp's converter writes it.

    - ``arch``: the ``gguf.MODEL_ARCH`` member's name.
    - ``fields(cfg, fields)``: changes the common metadata in place (:func:`common_fields`).
    - ``special_tokens``: GGUF special-token kind (``bos``, ``eot``…) -> the token's text, where
      the converter names them itself rather than taking them from ``tokenizer_config.json``.
    - ``nextn``: multi-token-prediction layers are counted in ``block_count`` (and written).
    - ``tensors(target, t, cfg)``: the GGUF tensors one dense tensor becomes (DeepSeek splits one).
    - ``keeps(name, cfg)``: whether a checkpoint tensor is written at all.
    - ``prepare(tensors, cfg)``: the checkpoint's tensors (name -> loader) in the names and layouts
      the writer takes (GPT-OSS's interleaved experts as the standard fused ones).
    - ``vocab``: the tokenizer as written: "bpe" (``tokenizer.json``) or "spm" (``tokenizer.model``,
      as the converter writes ERNIE's, with its ``add_prefix_space``).
    - ``config(cfg)``: config.json in the common names the writer reads (DBRX's sub-configs flattened).
    - ``quantized_router``: the router's matrix is quantized in the converter's plain types (q8_0), as
      the converter does for DBRX (llama.cpp's quantizer, hence its mixes, keeps every router as it is).
    """

    arch: str
    fields: Callable[[dict, Fields], None] = _no_fields
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    nextn: bool = False
    tensors: Callable[[str, torch.Tensor, dict], Iterator[tuple[str, torch.Tensor]]] = _as_is
    keeps: Callable[[str, dict], bool] = lambda name, cfg: True
    prepare: Callable[[dict, dict], dict] = lambda tensors, cfg: tensors
    vocab: str = "bpe"
    config: Callable[[dict], dict] = lambda cfg: cfg
    quantized_router: bool = False


def nextn_layers(cfg: dict) -> int:
    """The checkpoint's multi-token-prediction layers (after the decoder's)."""
    return int(cfg.get("num_nextn_predict_layers") or 0)


def rope_of(cfg: dict) -> dict:
    """The config's rotary parameters (``rope_parameters`` or the older ``rope_scaling``, as the loader
    reads them) as one dict with ``rope_type`` and ``rope_theta``."""
    rope = parse_rope(cfg)
    return {**rope.params, "rope_type": rope.rope_type, "rope_theta": rope.theta}


def common_fields(cfg: dict) -> Fields:
    """The keys every MoE decoder's file has, from its config."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = rope_of(cfg)
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    fields: Fields = dict(
        context_length=_context_length(cfg),
        embedding_length=cfg["hidden_size"],
        block_count=cfg["num_hidden_layers"],
        head_count=cfg["num_attention_heads"], head_count_kv=cfg["num_key_value_heads"],
        key_length=head_dim, value_length=head_dim,
        rope_dimension_count=int(cfg.get("rotary_dim") or head_dim * partial),
        rope_freq_base=rope["rope_theta"],
        expert_count=next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                           if cfg.get(k)), None),
        expert_used_count=cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or cfg["moe_k"],
        vocab_size=cfg["vocab_size"])
    if cfg.get("rms_norm_eps", cfg.get("norm_eps")) is not None:
        fields["layer_norm_rms_eps"] = cfg["rms_norm_eps"] if "rms_norm_eps" in cfg else cfg["norm_eps"]
    else:  # (a LayerNorm: Cohere's)
        fields["layer_norm_eps"] = cfg["layer_norm_eps"]
    if cfg.get("intermediate_size") is not None:
        fields["feed_forward_length"] = cfg["intermediate_size"]
    if "moe_intermediate_size" in cfg:
        fields["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if cfg.get("shared_expert_intermediate_size"):
        fields["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    fields.update(rope_scaling_fields(rope))
    score = next((cfg[k] for k in ("score_function", "scoring_func", "score_func", "moe_router_activation",
                                   "moe_router_activation_func", "expert_selection_fn")
                  if cfg.get(k) is not None), None)
    if score == "noaux_tc":  # (DeepSeek's name for its sigmoid scores with a correction bias)
        score = "sigmoid"
    if score is not None:
        if score not in GATING:
            raise ConvertError(f"router score function '{score}' has no GGUF gating type (known: {', '.join(GATING)})")
        fields["expert_gating_func"] = GATING[score]
    return fields


def _context_length(cfg: dict) -> int:
    length = cfg.get("max_position_embeddings") or cfg.get("model_max_length")
    if not length:
        raise ConvertError("config.json names no context length (max_position_embeddings or model_max_length)")
    return int(length)


GATING = MappingProxyType({"softmax": 1, "sigmoid": 2})  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def rope_scaling_fields(rope: dict) -> Fields:
    """Linear and YaRN context extension, as the converter writes them."""
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if factor is None or kind not in ("linear", "yarn"):
        return {}
    fields: Fields = dict(rope_scaling_type=kind, rope_scaling_factor=factor)
    if kind == "yarn":
        fields["rope_scaling_orig_ctx_len"] = rope["original_max_position_embeddings"]
        for key, name in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                          ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(key) is not None:
                fields[f"rope_scaling_{name}"] = rope[key]
    return fields


def deepseek_router(cfg: dict, fields: Fields) -> None:
    """The DeepSeek-style router (GLM-4.5, DeepSeek-V2/V3): shared experts, leading dense layers,
    groups, the weights' scale and normalisation."""
    fields.update(expert_count=cfg["n_routed_experts"], expert_shared_count=cfg.get("n_shared_experts") or 0,
                  leading_dense_block_count=cfg.get("first_k_dense_replace") or 0)
    if cfg.get("n_group") is not None:
        fields["expert_group_count"] = cfg["n_group"]
    if cfg.get("topk_group") is not None:
        fields["expert_group_used_count"] = cfg["topk_group"]
    if cfg.get("routed_scaling_factor") is not None:
        fields["expert_weights_scale"] = cfg["routed_scaling_factor"]
