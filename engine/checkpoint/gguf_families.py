"""The GGUF architectures hearth reads, as llama.cpp's converter writes them: the transformers class
each is served as, and, where transformers' GGUF support has no config mapping for it, the config
built from the file's metadata (the keys llama.cpp's converter writes, read back into the fields of
transformers' config class for that family)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hearth.engine.checkpoint.gguf_latent import (
    deepseek2,
    deepseek2_variant,
    deepseek_router,
    kimi_linear,
    sparse_deepseek,
)
from hearth.engine.checkpoint.gguf_meta import Has, Meta, as_list, common_fields
from hearth.engine.checkpoint.gguf_plain import dbrx, hy_v3, laguna, mellum


@dataclass(frozen=True)
class GGUFArchitecture:
    """One GGUF architecture: the transformers class it is served as; ``model_type`` and ``fields``
    where hearth builds its config from the metadata (None: transformers' GGUF support reads it)."""

    hf_architecture: str
    model_type: str | None = None
    fields: Callable[[Meta, Has], dict[str, Any]] = field(default=lambda meta, has: {})
    # Where one GGUF architecture holds several transformers families: (model_type, class) by the file.
    variant: Callable[[Meta, Has], tuple[str, str]] | None = None


def _lfm2_moe(meta: Meta, has: Has) -> dict[str, Any]:
    """LFM2-MoE: the layers without KV heads are its short convolutions; leading dense layers; the
    router's bias where the file has one (the converter writes no scale or normalisation flag: LFM2's
    routed weights are renormalised and unscaled)."""
    fields = common_fields(meta)
    n = fields["num_hidden_layers"]
    kv = as_list(meta("attention.head_count_kv"))
    kv = kv * n if len(kv) == 1 else kv
    return {**fields, "norm_eps": fields["rms_norm_eps"], "num_experts": int(meta("expert_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "num_dense_layers": int(meta("leading_dense_block_count", 0) or 0),
            "conv_L_cache": int(meta("shortconv.l_cache")),
            "layer_types": ["full_attention" if heads else "conv" for heads in kv[:n]],
            "use_expert_bias": any(has(f"blk.{i}.exp_probs_b.bias") for i in range(n))}


def _olmoe(meta: Meta, has: Has) -> dict[str, Any]:
    # OLMoE's experts are intermediate_size wide; it does not renormalise the top-k weights.
    fields = {**common_fields(meta), "num_experts": int(meta("expert_count")), "norm_topk_prob": False}
    if meta("attention.clamp_kqv") is not None:
        fields["clip_qkv"] = float(meta("attention.clamp_kqv"))
    return fields


def _glm4_moe(meta: Meta, has: Has) -> dict[str, Any]:
    """GLM-4.5/4.6/4.7: the DeepSeek-style router (sigmoid, groups, correction bias, scaled weights),
    leading dense layers, a shared expert, partial rotary; q/k/v biases and q/k norms where the file
    holds them (the converter writes no flag for either)."""
    fields = common_fields(meta)
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    return {**fields, **deepseek_router(meta),
            "partial_rotary_factor": int(meta("rope.dimension_count", head_dim)) / head_dim,
            "attention_bias": has("blk.0.attn_q.bias"), "use_qk_norm": has("blk.0.attn_q_norm.weight")}


def _dots1(meta: Meta, has: Has) -> dict[str, Any]:
    """dots.llm1: Qwen3's attention with DeepSeek-V3's router and shared experts. The converter
    writes no sliding window (the released checkpoints attend fully in every layer)."""
    return {**common_fields(meta), **deepseek_router(meta), "sliding_window": None}


def _ernie4_5_moe(meta: Meta, has: Has) -> dict[str, Any]:
    """ERNIE-4.5 MoE under the original config's names (transformers maps ``num_experts`` and
    ``num_experts_per_tok`` onto them): the leading dense layers, the MoE step, the shared experts."""
    fields = {**common_fields(meta), "moe_num_experts": int(meta("expert_count")),
              "moe_k": int(meta("expert_used_count")), "moe_intermediate_size": int(meta("expert_feed_forward_length")),
              "moe_layer_start_index": int(meta("leading_dense_block_count", 0) or 0),
              "moe_layer_interval": int(meta("interleave_moe_layer_step", 1) or 1),
              "moe_num_shared_experts": int(meta("expert_shared_count", 0) or 0)}
    fields.pop("num_experts_per_tok")
    return fields


def _exaone_moe(meta: Meta, has: Has) -> dict[str, Any]:
    """EXAONE-MoE: DeepSeek-V3's router (groups, correction bias, scaled weights), leading dense layers,
    sliding-window layers by the pattern (the others turn no rotary)."""
    fields = {**common_fields(meta), "num_experts": int(meta("expert_count")),
              "moe_intermediate_size": int(meta("expert_feed_forward_length")),
              "num_shared_experts": int(meta("expert_shared_count", 0) or 0),
              "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
              "norm_topk_prob": bool(meta("expert_weights_norm", True)),
              "n_group": int(meta("expert_group_count", 1) or 1),
              "topk_group": int(meta("expert_group_used_count", 1) or 1)}
    n, dense = fields["num_hidden_layers"], int(meta("leading_dense_block_count", 0) or 0)
    fields |= {"first_k_dense_replace": dense,
               "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)]}
    if meta("attention.sliding_window") is not None:
        pattern = list(meta("attention.sliding_window_pattern", [True] * n))[:n]
        fields |= {"sliding_window": int(meta("attention.sliding_window")),
                   "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}
    return fields


def _cohere2moe(meta: Meta, has: Has) -> dict[str, Any]:
    """Cohere2-MoE: the experts' and the dense layers' widths, shared experts (averaged: llama.cpp
    knows no other way), the gating (sigmoid where the file names none, as llama.cpp takes it), the
    window's pattern, the logit scale. llama.cpp turns the rotary on the leading dense layers, which
    transformers does with ``prefix_dense_sliding_window_pattern`` 1."""
    n_ff = meta("feed_forward_length")
    fields = {**common_fields(meta), "num_experts": int(meta("expert_count")),
              "intermediate_size": int(meta("expert_feed_forward_length") or n_ff),
              "prefix_dense_intermediate_size": int(n_ff),
              "num_shared_experts": int(meta("expert_shared_count", 0) or 0),
              "shared_expert_combination_strategy": "average", "prefix_dense_sliding_window_pattern": 1,
              "expert_selection_fn": "softmax" if int(meta("expert_gating_func", 2) or 2) == 1 else "sigmoid",
              "norm_topk_prob": bool(meta("expert_weights_norm", False)),
              "logit_scale": float(meta("logit_scale", 1.0))}
    n, dense = fields["num_hidden_layers"], int(meta("leading_dense_block_count", 0) or 0)
    pattern = list(meta("attention.sliding_window_pattern", [False] * n))[:n]
    return fields | {"mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
                     "sliding_window": int(meta("attention.sliding_window", 0) or 0) or None,
                     "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}


def _llama4(meta: Meta, has: Has) -> dict[str, Any]:
    """Llama 4: the experts' and the dense layers' widths, the MoE layers' step, and what llama.cpp
    holds as constants: chunks of 8192 tokens on the rotary layers, every fourth layer global without
    rotary and its queries scaled (floor 8192, scale 0.1), q/k norms unless 128 experts (Maverick); a
    window of 0 turns chunks and NoPE layers off."""
    fields = {**common_fields(meta), "num_local_experts": int(meta("expert_count")),
              "intermediate_size": int(meta("expert_feed_forward_length")),
              "intermediate_size_mlp": int(meta("feed_forward_length")),
              "interleave_moe_layer_step": int(meta("interleave_moe_layer_step", 1) or 1),
              "use_qk_norm": int(meta("expert_count")) != 128, "attention_chunk_size": 8192, "floor_scale": 8192,
              "attn_scale": 0.1, "attn_temperature_tuning": True, "no_rope_layer_interval": 4}
    if meta("attention.sliding_window") is not None and int(meta("attention.sliding_window")) == 0:
        n = fields["num_hidden_layers"]
        fields |= {"no_rope_layers": [1] * n, "layer_types": ["full_attention"] * n}
    return fields


def _afmoe(meta: Meta, has: Has) -> dict[str, Any]:
    """AfMoE: the experts, shared experts, leading dense layers and routed scale; sliding layers by the
    file's pattern or, as llama.cpp assumes, every fourth layer global (those turn no rotary); muP's
    embedding scale always, as llama.cpp applies it (the file has no key for it)."""
    fields = {**common_fields(meta), "num_experts": int(meta("expert_count")),
              "moe_intermediate_size": int(meta("expert_feed_forward_length")),
              "num_shared_experts": int(meta("expert_shared_count", 0) or 0),
              "num_dense_layers": int(meta("leading_dense_block_count", 0) or 0),
              "route_scale": float(meta("expert_weights_scale", 1.0) or 1.0), "mup_enabled": True}
    n = fields["num_hidden_layers"]
    if meta("attention.sliding_window") is not None:
        pattern = meta("attention.sliding_window_pattern") or [bool((i + 1) % 4) for i in range(n)]
        fields |= {"sliding_window": int(meta("attention.sliding_window")),
                   "layer_types": ["sliding_attention" if p else "full_attention" for p in list(pattern)[:n]]}
    return fields


def _granitemoe(meta: Meta, has: Has) -> dict[str, Any]:
    """Granite MoE: Mixtral's layout (experts ``feed_forward_length`` wide) with Granite's four scalars,
    which the converter writes only where they are set (transformers' defaults are 1)."""
    fields = {**common_fields(meta), "num_local_experts": int(meta("expert_count", 0) or 0)}
    scalars = (("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
               ("attention_multiplier", "attention.scale"), ("logits_scaling", "logit_scale"))
    fields |= {name: float(meta(key)) for name, key in scalars if meta(key) is not None}
    if meta("expert_shared_feed_forward_length") is not None:
        fields["shared_intermediate_size"] = int(meta("expert_shared_feed_forward_length"))
    return fields


def _granitehybrid(meta: Meta, has: Has) -> dict[str, Any]:
    """Granite 4: Granite MoE's fields, the Mamba-2 shapes under ``ssm.*`` (heads as the time-step rank),
    the layers without KV heads its Mamba layers; rotary only where the converter flags it (its
    ``rope.scaling.finetuned``: the released models have none)."""
    fields = _granitemoe(meta, has)
    n, heads, inner = fields["num_hidden_layers"], int(meta("ssm.time_step_rank")), int(meta("ssm.inner_size"))
    kv = as_list(meta("attention.head_count_kv"))
    kv = kv * n if len(kv) == 1 else kv
    fields.setdefault("num_local_experts", 0)
    mamba = {"mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": int(meta("ssm.state_size")),
             "mamba_n_groups": int(meta("ssm.group_count")), "mamba_d_conv": int(meta("ssm.conv_kernel")),
             "mamba_expand": inner // fields["hidden_size"],
             "mamba_conv_bias": any(has(f"blk.{i}.ssm_conv1d.bias") for i in range(n))}
    return {**fields, **mamba, "layer_types": ["attention" if h else "linear_attention" for h in kv[:n]],
            "position_embedding_type": "rope" if meta("rope.scaling.finetuned") else None}


def _granitemoe_variant(meta: Meta, has: Has) -> tuple[str, str]:
    """One GGUF architecture for both Granite MoE classes: the shared form has shared-expert tensors."""
    if has("blk.0.ffn_up_shexp.weight"):
        return "granitemoeshared", "GraniteMoeSharedForCausalLM"
    return "granitemoe", "GraniteMoeForCausalLM"


def _gpt_oss(meta: Meta, has: Has) -> dict[str, Any]:
    """GPT-OSS: experts ``expert_feed_forward_length`` wide, sliding and full attention alternating,
    YaRN. llama.cpp keeps the experts' SwiGLU clamp as a constant, 7.0 (every GPT-OSS checkpoint's
    ``swiglu_limit``), not in the file."""
    fields = common_fields(meta)
    fields.update(num_local_experts=int(meta("expert_count")),
                  intermediate_size=int(meta("expert_feed_forward_length")),
                  sliding_window=int(meta("attention.sliding_window")), swiglu_limit=7.0)
    if meta("rope.scaling.type") == "yarn":
        fields["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": float(meta("rope.freq_base")),
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    return fields


def _qwen_hybrid(meta: Meta) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5-MoE: gated DeltaNet layers (``attention.recurrent_layers``) between
    gated attention ones, partial rotary, routed and shared experts."""
    fields = common_fields(meta)
    keys, values, key_dim, value_dim = linear_heads(meta)
    recurrent = list(meta("attention.recurrent_layers") or [])[: fields["num_hidden_layers"]]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_parameters"]["partial_rotary_factor"] = int(meta("rope.dimension_count", head_dim)) / head_dim
    fields.update(num_experts=int(meta("expert_count")), moe_intermediate_size=int(meta("expert_feed_forward_length")),
                  shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0) or 0),
                  linear_num_key_heads=keys, linear_num_value_heads=values, linear_key_head_dim=key_dim,
                  linear_value_head_dim=value_dim, linear_conv_kernel_dim=int(meta("ssm.conv_kernel")),
                  layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
                  norm_topk_prob=True)
    return fields


ARCHITECTURES: Mapping[str, GGUFArchitecture] = MappingProxyType({
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM"),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM"),
    "llama": GGUFArchitecture("MixtralForCausalLM"),  # llama with experts, as llama.cpp writes Mixtral
    "olmoe": GGUFArchitecture("OlmoeForCausalLM", "olmoe", _olmoe),
    "minimax-m2": GGUFArchitecture("MiniMaxM2ForCausalLM"),
    "glm4moe": GGUFArchitecture("Glm4MoeForCausalLM", "glm4_moe", _glm4_moe),
    "gpt-oss": GGUFArchitecture("GptOssForCausalLM", "gpt_oss", _gpt_oss),
    "dots1": GGUFArchitecture("Dots1ForCausalLM", "dots1", _dots1),
    "ernie4_5-moe": GGUFArchitecture("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", _ernie4_5_moe),
    "exaone-moe": GGUFArchitecture("ExaoneMoeForCausalLM", "exaone_moe", _exaone_moe),
    "lfm2moe": GGUFArchitecture("Lfm2MoeForCausalLM", "lfm2_moe", _lfm2_moe),
    "granitehybrid": GGUFArchitecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", _granitehybrid),
    "afmoe": GGUFArchitecture("AfmoeForCausalLM", "afmoe", _afmoe),
    "llama4": GGUFArchitecture("Llama4ForCausalLM", "llama4_text", _llama4),
    "cohere2moe": GGUFArchitecture("Cohere2MoeForCausalLM", "cohere2_moe", _cohere2moe),
    "granitemoe": GGUFArchitecture("GraniteMoeForCausalLM", "granitemoe", _granitemoe, _granitemoe_variant),
    "deepseek2": GGUFArchitecture("DeepseekV3ForCausalLM", "deepseek_v3", deepseek2, deepseek2_variant),
    "deepseek32": GGUFArchitecture("DeepseekV32ForCausalLM", "deepseek_v32", sparse_deepseek),
    "glm-dsa": GGUFArchitecture("GlmMoeDsaForCausalLM", "glm_moe_dsa", sparse_deepseek),
    "kimi-linear": GGUFArchitecture("KimiLinearForCausalLM", "kimi_linear", kimi_linear),
    "dbrx": GGUFArchitecture("DbrxForCausalLM", "dbrx", dbrx),
    "hy_v3": GGUFArchitecture("HYV3ForCausalLM", "hy_v3", hy_v3),
    "mellum": GGUFArchitecture("MellumForCausalLM", "mellum", mellum),
    "laguna": GGUFArchitecture("LagunaForCausalLM", "laguna", laguna),
    "qwen3next": GGUFArchitecture("Qwen3NextForCausalLM", "qwen3_next", lambda meta, has: _qwen_hybrid(meta)),
    "qwen35moe": GGUFArchitecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", lambda meta, has: _qwen_hybrid(meta)),
})


# The architectures whose q/k rows the converter writes in llama.cpp's rotary order (LlamaModel's
# permutation: each head's two halves interleaved).
# Architectures llama.cpp's converter writes that the released gguf package does not list yet:
# member name -> (the GGUF name, a listed architecture whose tensor kinds cover theirs). llama.cpp's
# tensor names are one table for all; an architecture only selects from it.
UNLISTED = MappingProxyType({"COHERE2MOE": ("cohere2moe", "DOTS1"), "DEEPSEEK32": ("deepseek32", "GLM_DSA"),
                             "HY_V3": ("hy_v3", "DOTS1"), "MELLUM": ("mellum", "QWEN3MOE"),
                             "LAGUNA": ("laguna", "DOTS1")})
# Tensors an architecture's converter names without the ``.weight``/``.bias`` suffix (Hunyuan V3's
# correction bias: its checkpoint's ``mlp.expert_bias`` has none).
UNSUFFIXED = MappingProxyType({"hy_v3": ("exp_probs_b",)})


def tensor_name_map(architecture: str, layers: int) -> Any:
    """llama.cpp's tensor-name table (``gguf.TensorNameMap``) for the GGUF ``architecture`` name."""
    import gguf  # deferred: the gguf package is needed for GGUF files only

    stand_in = {name: listed for name, listed in UNLISTED.values()}.get(architecture)
    member = getattr(gguf.MODEL_ARCH, stand_in) if stand_in else \
        next((m for m, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if member is None:
        raise ValueError(f"the gguf package knows no architecture '{architecture}'")
    names = gguf.TensorNameMap(member, layers)
    for kind, param in ALIASES.get(architecture, ()):
        for layer in range(layers):
            tensor = getattr(gguf.MODEL_TENSOR, kind)
            names.mapping[param.format(bid=layer)] = (tensor, gguf.TENSOR_NAMES[tensor].format(bid=layer))
    return names


# Parameters whose transformers names llama.cpp's table does not give for an architecture: DBRX's
# norm after attention (its checkpoints' ``norm_2``), and its q, k and v, which the file holds as one
# ``attn_qkv`` (split on reading: :func:`split_tensors`); Laguna's output gate (its stand-in's table
# has no gate).
ALIASES = MappingProxyType({"dbrx": (("ATTN_OUT_NORM", "model.layers.{bid}.post_attention_layernorm"),
                                     ("ATTN_Q", "model.layers.{bid}.self_attn.q_proj"),
                                     ("ATTN_K", "model.layers.{bid}.self_attn.k_proj"),
                                     ("ATTN_V", "model.layers.{bid}.self_attn.v_proj")),
                     "laguna": (("ATTN_GATE", "model.layers.{bid}.self_attn.g_proj"),)})


def split_tensors(architecture: str, names: set[str], meta: Meta) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Tensors the converter wrote fused that a model reads as parts: name -> (the parts, their rows).
    DBRX's ``attn_qkv`` [q + 2 kv, H] is its q, k and v (rows of blocks split as they are stored)."""
    if architecture != "dbrx":
        return {}
    heads, kv_heads = int(meta("attention.head_count")), max(as_list(meta("attention.head_count_kv")))
    width = int(meta("embedding_length"))
    rows = (width, width // heads * kv_heads, width // heads * kv_heads)
    return {f"blk.{layer}.attn_qkv.weight": (tuple(f"blk.{layer}.attn_{p}.weight" for p in "qkv"), rows)
            for layer in range(int(meta("block_count"))) if f"blk.{layer}.attn_qkv.weight" in names}


ROPE_PERMUTED = frozenset({"llama", "granitemoe", "granitehybrid"})
# The architectures with DeepSeek's latent attention (``kv_b`` split into ``attn_k_b`` / ``attn_v_b``).
LATENT = frozenset({"deepseek2", "deepseek32", "glm-dsa", "kimi-linear"})


def metadata_config(architecture: str, meta: Meta, has: Has, vocab_size: int,
                    special: Mapping[str, int | None]) -> Any:
    """transformers' config of ``architecture`` from the metadata (``special``: the bos/eos/pad ids)."""
    from transformers import AutoConfig  # deferred: transformers is heavy to import; only configs need it

    spec = ARCHITECTURES[architecture]
    model_type, hf_architecture = (spec.model_type, spec.hf_architecture) if spec.variant is None else \
        spec.variant(meta, has)
    fields = {**spec.fields(meta, has), "vocab_size": vocab_size}
    fields.update({f"{name}_token_id": value for name, value in special.items() if value is not None})
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [hf_architecture]
    return config


def composed_tensors(architecture: str, names: set[str], meta: Meta) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """Tensors a model reads that the converter wrote as parts: name -> (the parts, a function of
    their float values giving it). DeepSeek-V2/V3's ``kv_b_proj`` [heads x (nope + v), rank] is
    split into ``attn_k_b`` [heads, rank, nope] (transposed) and ``attn_v_b`` [heads, v, rank];
    Qwen3-Next's ``in_proj_qkvz`` (q, k, v, z per key head) into ``attn_qkv`` (all q, all k, all v)
    and ``attn_gate`` (z)."""
    out: dict[str, tuple[tuple[str, ...], Callable]] = {}
    layers = int(meta("block_count", 0) or 0)
    for layer in range(layers):
        if architecture in LATENT:
            parts = (f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight")
            if all(part in names for part in parts):
                out[f"blk.{layer}.attn_kv_b.weight"] = (parts, _kv_b)
        elif architecture == "qwen3next":
            parts = (f"blk.{layer}.attn_qkv.weight", f"blk.{layer}.attn_gate.weight")
            if all(part in names for part in parts):
                out[f"blk.{layer}.ssm_in.weight"] = (parts, lambda qkv, z: _qkvz(qkv, z, *linear_heads(meta)))
    return out


def linear_heads(meta: Meta) -> tuple[int, int, int, int]:
    """A gated-DeltaNet layer's (key heads, value heads, key head width, value head width)."""
    keys, values = int(meta("ssm.group_count")), int(meta("ssm.time_step_rank"))
    return keys, values, int(meta("ssm.state_size")), int(meta("ssm.inner_size")) // values


def _qkvz(qkv: Any, z: Any, keys: int, values: int, key_dim: int, value_dim: int) -> Any:
    import torch  # deferred: this module's tables need no torch

    hidden, per = qkv.shape[1], values // keys * value_dim
    q, k, v = qkv.split([keys * key_dim, keys * key_dim, keys * per])
    grouped = [t.reshape(keys, -1, hidden) for t in (q, k, v, z)]
    return torch.cat(grouped, dim=1).reshape(-1, hidden)


def _kv_b(k_b: Any, v_b: Any) -> Any:
    import torch  # deferred: this module's tables need no torch

    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def gguf_name(names: Any, param: str, architecture: str = "") -> str | None:
    """The GGUF tensor of a model parameter (its transformers name), by llama.cpp's name table (the
    ``gguf`` package's ``TensorNameMap``), or None. As the converter does, a router's
    ``e_score_correction_bias`` is the ``.bias`` of ``e_score_correction`` (``exp_probs_b.bias``;
    without the suffix where ``UNSUFFIXED`` names it for ``architecture``)."""
    name = _gguf_name(names, param)
    if name is not None and name.rsplit(".", 2)[-2] in UNSUFFIXED.get(architecture, ()):
        return name.rsplit(".", 1)[0]
    return name


def _gguf_name(names: Any, param: str) -> str | None:
    if param.endswith("e_score_correction_bias"):
        param = param[: -len("_bias")] + ".bias"
    if param.endswith((".linear_attn.A_log", ".linear_attn.dt_bias", ".mamba.A_log", ".mamba.dt_bias", ".mamba.D",
                       ".self_attn.A_log", ".self_attn.dt_bias")):  # (the last two: Kimi's delta attention)
        layer, name = param.split(".")[2], param.rsplit(".", 1)[1]  # the hybrids' bare parameters
        return {"A_log": f"blk.{layer}.ssm_a", "D": f"blk.{layer}.ssm_d"}.get(name, f"blk.{layer}.ssm_dt.bias")
    base, suffix = param.rsplit(".", 1)
    target = names.get_name(base)
    if target is None and base == "model.norm":  # (LFM2's final norm: llama.cpp names it by its checkpoint name)
        target = names.get_name("model.embedding_norm")
    if target is None and names.get_name(param) is not None:  # a bare parameter (GPT-OSS's sinks)
        return f"{names.get_name(param)}.weight"
    return f"{target}.{suffix}" if target is not None else None


# RMSNorm weights the hybrids centre on zero (the converter stores them plus one).
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                 "model.norm.weight")


def restore(architecture: str, param: str, read: Callable[[], Any], meta: Meta) -> Any | None:
    """A parameter's values from the file's (float) where the converter changed them, else None.
    The hybrids (Qwen3-Next, Qwen3.5): zero-centred RMSNorm weights stored plus one, ``A_log``
    stored as ``-exp(A_log)``, and for Qwen3.5 with more value than key heads, the value heads of
    the DeltaNet tensors reordered from grouped by key head to tiled (llama.cpp broadcasts them).
    ``read()`` decodes the file's values; it is called only for such a parameter."""
    import torch  # deferred: this module's tables need no torch

    if architecture == "kimi-linear":
        return torch.log(-read()) if param.endswith(".self_attn.A_log") else None
    if architecture == "granitehybrid":
        if param.endswith(".mamba.A_log"):
            return torch.log(-read()).reshape(-1)
        return read().reshape(-1) if param.endswith(".mamba.norm.weight") else None
    if architecture not in ("qwen3next", "qwen35moe"):
        return None
    if param.endswith(ZERO_CENTRED):
        return read() - 1
    if ".linear_attn." not in param:
        return None
    values = read()
    out = torch.log(-values) if param.endswith("A_log") else values
    keys, heads, key_dim, value_dim = linear_heads(meta)
    if architecture == "qwen35moe" and heads != keys:
        out = reorder_value_heads(param, out, keys, heads // keys, key_dim, value_dim, to_tiled=False)
    return out if out is not values else None


def reorder_value_heads(param: str, t: Any, keys: int, per_key: int, key_dim: int, value_dim: int, *,
                        to_tiled: bool) -> Any:
    """The value heads of a Qwen3.5 DeltaNet tensor between grouped by key head [keys, per_key, width]
    (transformers') and tiled [per_key, keys, width] (llama.cpp's, which broadcasts the key heads):
    ``to_tiled`` as the converter writes them, else back."""
    import torch  # deferred: this module's tables need no torch

    def swap(x: Any, dim: int, width: int) -> Any:
        outer, inner = (keys, per_key) if to_tiled else (per_key, keys)
        shape = list(x.shape)
        split = x.reshape(*shape[:dim], outer, inner, width, *shape[dim + 1:])
        return split.transpose(dim, dim + 1).reshape(shape)

    if param.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q and k rows as they are, then v
        qk = 2 * keys * key_dim
        return torch.cat([t[:qk], swap(t[qk:], 0, value_dim)])
    if param.endswith("in_proj_z.weight"):
        return swap(t, 0, value_dim)
    if param.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return swap(t, 0, 1)
    if param.endswith("out_proj.weight"):
        return swap(t, 1, value_dim)
    return t
