"""The metadata readers of GGUF architectures whose files hold a plain decoder (attention and experts,
nothing recurrent or latent): DBRX, Hunyuan V3, Mellum and Laguna, as llama.cpp's converter writes them
(``gguf_families.py`` lists them)."""

from __future__ import annotations

from typing import Any

from hearth.engine.checkpoint.gguf_meta import Has, Meta, as_list, common_fields


def dbrx(meta: Meta, has: Has) -> dict[str, Any]:
    """DBRX: its sub-configs from the common keys, the clip (0: none), and the top-k weights divided
    by their sum, as llama.cpp always divides them (the 1-norm of DBRX's checkpoints)."""
    fields = common_fields(meta)
    clip = float(meta("attention.clamp_kqv", 0) or 0)
    attn = {"kv_n_heads": fields["num_key_value_heads"], "clip_qkv": clip or None,
            "rope_theta": fields["rope_parameters"]["rope_theta"]}
    ffn = {"ffn_hidden_size": fields["intermediate_size"], "moe_num_experts": int(meta("expert_count")),
           "moe_top_k": fields["num_experts_per_tok"], "moe_normalize_expert_weights": 1.0}
    return {"d_model": fields["hidden_size"], "n_heads": fields["num_attention_heads"],
            "n_layers": fields["num_hidden_layers"], "max_seq_len": fields["max_position_embeddings"],
            "attn_config": attn, "ffn_config": ffn, "rope_parameters": fields["rope_parameters"]}


def hy_v3(meta: Meta, has: Has) -> dict[str, Any]:
    """Hunyuan V3: the dense layers are those without a router (the converter writes no count of them),
    the shared experts' count from their width, the weights renormalised and scaled, biases where the
    file holds them."""
    fields = common_fields(meta)
    width, n = int(meta("expert_feed_forward_length")), fields["num_hidden_layers"]
    return {**fields, "num_experts": int(meta("expert_count")), "moe_intermediate_size": width,
            "num_shared_experts": int(meta("expert_shared_feed_forward_length", 0) or 0) // width,
            "router_scaling_factor": float(meta("expert_weights_scale", 1.0) or 1.0),
            "mlp_layer_types": ["sparse" if has(f"blk.{i}.ffn_gate_inp.weight") else "dense" for i in range(n)],
            "attention_bias": has("blk.0.attn_q.bias"), "mlp_bias": any(
                has(f"blk.{i}.ffn_up.bias") or has(f"blk.{i}.ffn_up_shexp.bias") for i in range(n))}


def mellum(meta: Meta, has: Has) -> dict[str, Any]:
    """Mellum: sliding layers where ``sliding_window_pattern`` says, turning by ``rope.freq_base_swa``,
    the others by ``rope.freq_base``; every layer MoE (llama.cpp's converter writes no dense MLP), the
    top-k weights renormalised (llama.cpp always renormalises them)."""
    fields = common_fields(meta)
    n, base = fields["num_hidden_layers"], fields["rope_parameters"]["rope_theta"]
    window = int(meta("attention.sliding_window", 0) or 0)
    pattern = [bool(v) for v in (meta("attention.sliding_window_pattern") or [])][:n] if window else []
    rope = {"full_attention": {"rope_type": "default", "rope_theta": base},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", base))}}
    return {**fields, "num_experts": int(meta("expert_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")), "norm_topk_prob": True,
            "sliding_window": window or None, "rope_parameters": rope, "mlp_layer_types": ["sparse"] * n,
            "layer_types": ["sliding_attention" if i < len(pattern) and pattern[i] else "full_attention"
                            for i in range(n)],
            "attention_bias": has("blk.0.attn_q.bias")}


def _yarn(meta: Meta, theta: float) -> dict[str, Any]:
    """A layer type's rotary parameters where the file scales them by YaRN (``rope.scaling.*``), else the
    default ones with base ``theta``."""
    if meta("rope.scaling.type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    keys = (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
            ("attention_factor", "rope.scaling.yarn_attn_factor"))
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            **{name: float(meta(key)) for name, key in keys if meta(key) is not None}}


def laguna(meta: Meta, has: Any) -> dict[str, Any]:
    """Laguna: query heads per layer; sliding layers from ``sliding_window_pattern`` where the file has
    one, else every layer but each fourth from the first (llama.cpp's rule for Laguna); each layer type's
    rotary base and width (``*_swa`` for the sliding ones), YaRN on the global ones where the file says;
    leading dense layers; the output gate per head or per channel by ``attn_gate``'s rows; the routed sum
    scaled by ``expert_weights_scale`` (llama.cpp has no router soft-cap: none)."""
    heads = [int(h) for h in as_list(meta("attention.head_count"))]
    fields = common_fields(lambda key, default=None: heads[0] if key == "attention.head_count" else meta(key, default))
    n, dim = fields["num_hidden_layers"], fields["head_dim"]
    heads = heads * n if len(heads) == 1 else heads[:n]
    window = int(meta("attention.sliding_window", 0) or 0)
    pattern = [bool(v) for v in as_list(meta("attention.sliding_window_pattern") or [])] or \
        [i % 4 != 0 for i in range(n)]
    base = fields["rope_parameters"]["rope_theta"]
    full = {**_yarn(meta, base), "partial_rotary_factor": int(meta("rope.dimension_count", dim)) / dim}
    swa = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", base)),
           "partial_rotary_factor": int(meta("rope.dimension_count_swa", dim)) / dim}
    dense = int(meta("leading_dense_block_count", 0) or 0)
    return {**fields, "num_attention_heads": heads[0], "num_attention_heads_per_layer": heads,
            "num_experts": int(meta("expert_count")), "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0) or 0),
            "sliding_window": window or 512, "rope_parameters": {"full_attention": full, "sliding_attention": swa},
            "layer_types": ["sliding_attention" if window and pattern[i] else "full_attention" for i in range(n)],
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
            "gating": "per-head" if has.rows("blk.0.attn_gate.weight") == heads[0] else "per-element",
            "moe_routed_scaling_factor": float(meta("expert_weights_scale", 1.0) or 1.0),
            "moe_router_logit_softcapping": 0.0, "attention_bias": has("blk.0.attn_q.bias")}
