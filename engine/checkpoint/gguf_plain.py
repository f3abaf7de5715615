"""The metadata readers of GGUF architectures whose files hold a plain decoder (attention and experts,
nothing recurrent or latent): DBRX, Hunyuan V3 and Mellum, as llama.cpp's converter writes them
(``gguf_families.py`` lists them)."""

from __future__ import annotations

from typing import Any

from hearth.engine.checkpoint.gguf_meta import Has, Meta, common_fields


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
