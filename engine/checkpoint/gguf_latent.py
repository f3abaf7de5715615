"""The GGUF architectures with DeepSeek's latent attention and router (``deepseek2``, ``deepseek32``,
``glm-dsa``, ``kimi-linear``): their transformers config fields from the metadata llama.cpp's
converter writes (see ``gguf_families.py``, which lists them)."""

from __future__ import annotations

from typing import Any

from hearth.engine.checkpoint.gguf_meta import Has, Meta, as_list, common_fields


def deepseek_router(meta: Meta) -> dict[str, Any]:
    """The routed and shared experts and the group-limited router, as DeepSeek-V2/V3 and GLM name them."""
    return dict(n_routed_experts=int(meta("expert_count")),
                moe_intermediate_size=int(meta("expert_feed_forward_length")),
                n_shared_experts=int(meta("expert_shared_count", 0) or 0),
                first_k_dense_replace=int(meta("leading_dense_block_count", 0) or 0),
                n_group=int(meta("expert_group_count", 1) or 1),
                topk_group=int(meta("expert_group_used_count", 1) or 1),
                routed_scaling_factor=float(meta("expert_weights_scale", 1.0) or 1.0),
                norm_topk_prob=bool(meta("expert_weights_norm", False)))


def deepseek2_variant(meta: Meta, has: Has) -> tuple[str, str]:
    """llama.cpp writes DeepSeek-V2 and V3 as one architecture; V3's router has a correction bias."""
    first_moe = int(meta("leading_dense_block_count", 0) or 0)
    if has(f"blk.{first_moe}.exp_probs_b.bias"):
        return "deepseek_v3", "DeepseekV3ForCausalLM"
    return "deepseek_v2", "DeepseekV2ForCausalLM"


def deepseek2(meta: Meta, has: Has) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-head latent attention (the converter writes one KV head and the latent
    widths), the group-limited router; V2 softmax routing (greedy with one group), V3 sigmoid with a
    correction bias; YaRN with DeepSeek's attention scale (``yarn_log_multiplier`` = 0.1 x mscale)."""
    fields = common_fields(meta)
    fields.pop("head_dim", None)
    rope_dim, key_dim = int(meta("rope.dimension_count")), int(meta("attention.key_length_mla"))
    fields.update(deepseek_router(meta), num_key_value_heads=fields["num_attention_heads"],
                  q_lora_rank=meta("attention.q_lora_rank"), kv_lora_rank=int(meta("attention.kv_lora_rank")),
                  qk_rope_head_dim=rope_dim, qk_nope_head_dim=key_dim - rope_dim,
                  v_head_dim=int(meta("attention.value_length_mla")))
    if deepseek2_variant(meta, has)[0] == "deepseek_v3":
        fields["topk_method"] = "noaux_tc"
    else:
        fields["topk_method"] = "group_limited_greedy" if fields["n_group"] > 1 else "greedy"
    if meta("rope.scaling.type") == "yarn":
        mscale = float(meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        fields["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": float(meta("rope.freq_base")),
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)), "mscale": mscale, "mscale_all_dim": mscale}
    return fields


def sparse_deepseek(meta: Meta, has: Has) -> dict[str, Any]:
    """DeepSeek-V3.2 and GLM-5: DeepSeek-V3's fields (their routers always sigmoid with a correction
    bias), the indexer's shape, the dense leading layers as ``mlp_layer_types``, and GLM-5's
    indexer layers (``attention.indexer.types``: True where a layer runs its own)."""
    fields = deepseek2(meta, has)
    fields.pop("topk_method")
    n, dense = fields["num_hidden_layers"], fields["first_k_dense_replace"]
    fields.update(index_n_heads=int(meta("attention.indexer.head_count")),
                  index_head_dim=int(meta("attention.indexer.key_length")),
                  index_topk=int(meta("attention.indexer.top_k")),
                  mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)])
    types = meta("attention.indexer.types")
    if types is not None:
        fields["indexer_types"] = ["full" if own else "shared" for own in list(types)[:n]]
    return fields


def kimi_linear(meta: Meta, has: Has) -> dict[str, Any]:
    """Kimi-Linear: the layers without KV heads are its delta attention, as many heads as attention
    (llama.cpp's assumption) of ``kda.head_dim``; latent attention widths as DeepSeek's; llama.cpp's
    router renormalises and has no groups, whatever the file says."""
    fields = common_fields(meta)
    fields.pop("head_dim", None)
    n, heads, dense = fields["num_hidden_layers"], fields["num_attention_heads"], int(
        meta("leading_dense_block_count", 0) or 0)
    kv = as_list(meta("attention.head_count_kv"))
    kv = kv * n if len(kv) == 1 else kv
    rope_dim, key_dim = int(meta("rope.dimension_count")), int(meta("attention.key_length_mla"))
    return {**fields, "num_key_value_heads": heads, "num_local_experts": int(meta("expert_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "n_shared_experts": int(meta("expert_shared_count", 0) or 0),
            "routed_scaling_factor": float(meta("expert_weights_scale", 1.0) or 1.0), "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "q_lora_rank": meta("attention.q_lora_rank"),
            "kv_lora_rank": int(meta("attention.kv_lora_rank")), "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": key_dim - rope_dim, "v_head_dim": int(meta("attention.value_length_mla")),
            "linear_head_dim": int(meta("kda.head_dim")), "linear_num_heads": heads,
            "linear_conv_kernel_dim": int(meta("ssm.conv_kernel")),
            "layer_types": ["full_attention" if h else "linear_attention" for h in kv[:n]],
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)]}
