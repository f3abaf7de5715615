"""Each test family's transformers config class and the tiny shape its checkpoints take
(``tests/checkpoints.py`` builds them on a common shape: hidden 64, 3 layers, 4 heads, top-2)."""

from __future__ import annotations

from typing import Any

# family -> the name of transformers' config class of its (text) model
CONFIG_CLASSES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "mixtral": "MixtralConfig",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "olmoe": "OlmoeConfig",
    "glm4_moe": "Glm4MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "deepseek_v2": "DeepseekV2Config",
    "minimax_m2": "MiniMaxM2Config",
    "gpt_oss": "GptOssConfig",
    "deepseek_v4": "DeepseekV4Config",
    "dots1": "Dots1Config",
    "glm4_moe_lite": "Glm4MoeLiteConfig",
    "granitemoe": "GraniteMoeConfig",
    "granitemoe_shared": "GraniteMoeSharedConfig",
    "ernie4_5_moe": "Ernie4_5_MoeConfig",
    "exaone_moe": "ExaoneMoeConfig",
    "lfm2_moe": "Lfm2MoeConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "afmoe": "AfmoeConfig",
    "flex_olmo": "FlexOlmoConfig",
    "cohere2_moe": "Cohere2MoeConfig",
    "phimoe": "PhimoeConfig",
    "hunyuan_v1_moe": "HunYuanMoEV1Config",
    "granitemoe_swa": "GraniteMoeSWAConfig",
    "llama4": "Llama4TextConfig",
    "jetmoe": "JetMoeConfig",
    "deepseek_v32": "DeepseekV32Config",
    "glm_moe_dsa": "GlmMoeDsaConfig",
    "kimi_linear": "KimiLinearConfig",
    "bailing_hybrid": "BailingHybridConfig",
    "solar_open": "SolarOpenConfig",
    "dbrx": "DbrxConfig",
    "hy_v3": "HYV3Config",
    "mellum": "MellumConfig",
    "axk1": "AXK1Config",
    "kolibri1": "Kolibri1Config",
    "flint": "FlintConfig",
    "laguna": "LagunaConfig",
    "mimo_v2_flash": "MiMoV2FlashConfig",
}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16, intermediate_size=96
    ),
    "qwen2_moe": dict(
        num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96
    ),
    "mixtral": dict(num_local_experts=8, intermediate_size=32),
    "olmoe": dict(num_experts=8, intermediate_size=32, norm_topk_prob=False),
    # ERNIE-4.5: interleaved rotary, layer 0 dense, a softmax gate with a correction bias, a shared expert.
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, intermediate_size=96,
                         moe_num_shared_experts=1, moe_layer_start_index=1, head_dim=16),
    # EXAONE-MoE: Qwen3 attention, layers 0-1 in a window and layer 2 global without rotary, layer 0
    # dense, DeepSeek-V3 routing over 2 groups of 4 experts with a shared expert.
    "exaone_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_shared_experts=1,
                       n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16, sliding_window=6,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse", "sparse"]),
    # LFM2-MoE: convolution layers 0 and 2 around attention layer 1, layer 0 dense, sigmoid routing
    # with an expert bias (3 layers: the third a convolution).
    "lfm2_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv"], routed_scaling_factor=1.5),
    # Granite 4: Mamba-2 layers 0 and 2 (4 heads of 32 channels, B and C in 2 groups of 16) around attention
    # layer 1 without rotary; Granite's scalars, 8 experts beside the shared MLP.
    "granitemoehybrid": dict(num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
                             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2,
                             logits_scaling=6.0, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
                             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                             layer_types=["linear_attention", "attention", "linear_attention"]),
    # AfMoE: gated attention, layers 0-1 in a window and layer 2 global without rotary, sandwich norms,
    # layer 0 dense, sigmoid routing with an expert bias and a scale, a shared expert, muP embeddings.
    "afmoe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_dense_layers=1,
                  num_shared_experts=1, route_scale=2.0, head_dim=16, sliding_window=6, global_attn_every_n_layers=3,
                  mup_enabled=True),
    # FlexOlmo: OLMo-2's post-norms and whole-projection q/k norms, OLMoE's router.
    "flex_olmo": dict(num_experts=8, intermediate_size=32, norm_topk_prob=False, pad_token_id=None),
    # Cohere2-MoE: parallel blocks over a LayerNorm, layer 0 dense (rotary, full attention), layers 1-2
    # in a window with rotary and layer 3 global without, top-k-then-softmax routing, one shared
    # expert averaged in, logits scaled.
    "cohere2_moe": dict(num_experts=8, intermediate_size=32, prefix_dense_intermediate_size=96, num_hidden_layers=4,
                        num_shared_experts=1, first_k_dense_replace=1, sliding_window=6, sliding_window_pattern=3,
                        logit_scale=0.25, head_dim=16, pad_token_id=None, bos_token_id=None),
    # Phi-3.5-MoE: Mixtral's layout with biased LayerNorms, attention and output head; SparseMixer routing.
    "phimoe": dict(num_local_experts=8, intermediate_size=32, attention_bias=True, lm_head_bias=True),
    # HunYuan-MoE: q/k norms after the rotary, an fp32 softmax gate, a shared MLP in every layer, NTK alpha.
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2, intermediate_size=32, head_dim=16,
                           rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                            "factor": 1.0}),
    # Granite MoE with sliding windows on layers 1-2, sinks per head, layer 2 without rotary.
    "granitemoe_swa": dict(num_local_experts=8, intermediate_size=32, embedding_multiplier=12.0,
                           residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0, sliding_window=6,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                           layer_rope_theta=[10000.0, 10000.0, 0]),
    # Llama 4: layers 0-2 turn (interleaved pairs) and attend in chunks of 6, layer 3 has no rotary and
    # scales its queries by position; layers 1 and 3 MoE (sigmoid top-1, inputs scaled, a shared expert).
    "llama4": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
                   num_hidden_layers=4, interleave_moe_layer_step=2, head_dim=16, attention_chunk_size=6,
                   floor_scale=4, attn_scale=0.5, pad_token_id=None),
    # JetMoE: attention experts (a query and an output projection each, 2 KV heads of 16) and SwiGLU
    # experts, both top-2 of 8 with biases.
    "jetmoe": dict(num_local_experts=8, intermediate_size=32, kv_channels=16, pad_token_id=None),
    # Mixtral's layout with Granite's four scalars (the embeddings, each residual branch, the
    # attention scores and the logits); the shared form adds an ungated shared expert.
    "granitemoe": dict(num_local_experts=8, intermediate_size=32, embedding_multiplier=12.0, residual_multiplier=0.22,
                       attention_multiplier=0.2, logits_scaling=6.0),
    "granitemoe_shared": dict(num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
                              embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2,
                              logits_scaling=6.0),
    # Qwen3 attention, DeepSeek-V3 routing: layer 0 dense, 2 groups of 4 experts, a shared expert;
    # the last layer attends within a window.
    "dots1": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                  norm_topk_prob=True, sliding_window=6, max_window_layers=2),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention, GLM's routing; layer 0 dense (mlp_layer_types).
    "glm4_moe_lite": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                          n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                          mlp_layer_types=["dense", "sparse", "sparse"]),
    # Layer 0 dense; sigmoid routing over 2 groups of 4 experts with a correction bias; partial rotary.
    "glm4_moe": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                     use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5),
    # DeepSeek-V3's shape with sparse attention: each query keeps the indexer's best 6 tokens, so
    # every prompt past 6 tokens takes the sparse path (16 index heads: a token scores exactly 0, all
    # heads negative, once in 65536, so exact ties that either side may break its own way stay rare).
    "deepseek_v32": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=16),
    # GLM-5: the same with the indexer's rotary on pairs, and layer 1 reusing layer 0's selection.
    "glm_moe_dsa": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=16,
                        indexer_types=["full", "shared", "full"]),
    # Kimi-Linear: delta attention (per-channel decays) around one NoPE latent attention layer;
    # layer 0 dense; DeepSeek-V3's routing over 2 groups of 4 experts.
    "kimi_linear": dict(num_local_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4, linear_head_dim=16,
                        linear_num_heads=4, pad_token_id=None, bos_token_id=None,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"]),
    # Ling 3.0: Kimi-Linear's layout with head-gated, rotary latent attention every second layer and
    # Ling's bounded decays. (The linear heads' width equals the rotary width: transformers reads its own
    # saved config's head_dim, which it overwrote with the rotary width, as the linear heads' width.)
    "bailing_hybrid": dict(num_local_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=16, v_head_dim=16, head_dim=16, num_key_value_heads=4,
                           first_k_dense_replace=1, layer_group_size=2, pad_token_id=None, num_mtp_layers=0),
    # Solar Open: GLM-4.5's network with every layer MoE, q/k/v biases and no q/k norms.
    "solar_open": dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                       routed_scaling_factor=2.5, head_dim=16, attention_bias=True),
    # DBRX: q/k/v clipped at 0.5 (so the clip acts), 2 KV heads, top-2 weights divided by their 1-norm. The
    # width also as d_model (transformers passes d_model to the FFN config, before a hidden_size keyword is
    # read), and the rotary base twice (transformers reads rope_parameters, DBRX ships attn_config.rope_theta).
    "dbrx": dict(d_model=64, attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500000.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Hunyuan V3: q/k norms, biases on q/k/v/o and the MLPs, layer 0 dense, a shared expert, scaled weights.
    "hy_v3": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_shared_experts=1, head_dim=16,
                  router_scaling_factor=2.826, mlp_layer_types=["dense", "sparse", "sparse"], attention_bias=True,
                  mlp_bias=True),
    # Mellum: q/k norms, layers 0 and 2 in a window of 6 turning by base 10000, layer 1 global by 500000
    # (its rotary tables per layer type), layer 0 dense.
    "mellum": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=16, sliding_window=6,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   mlp_layer_types=["dense", "sparse", "sparse"]),
    # A.X K1: DeepSeek-V3's (a query LoRA, 2 groups of 4, layer 0 dense, a shared expert) with the MoE
    # output normed.
    "axk1": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                 n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                 mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None),
    # Kolibri-1: layers 0 and 2 in a window of 6, layer 1 global without rotary, four norms a layer, the
    # correction bias on the logits, an ungated shared expert.
    "kolibri1": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
                     sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Flint: sinks, layers 0 and 2 in a window of 6 (rotary), layer 1 global without it, layer 0 dense,
    # an ungated shared expert.
    "flint": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
                  head_dim=16, sliding_window=6, mlp_only_layers=[0],
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Laguna: layer 1 in a window of 6 with 2 query heads (base 10000, every channel), layers 0 and 2 global
    # (base 500000 on half of each head), a softplus gate per head, layer 0 dense, a soft-capped router, the
    # routed sum scaled, an ungated shared expert.
    "laguna": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
                   head_dim=16, sliding_window=6, layer_types=["full_attention", "sliding_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads_per_layer=[4, 2, 4],
                   gating="per-head", moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=3.0),
    # MiMo-V2-Flash: keys 24 wide, values 16 (scaled), layers 1 and 2 in a window of 6 with twice the KV heads
    # and sinks, layer 0 global and dense; each type's rotary on 8 channels; 2 groups of 4 experts.
    "mimo_v2_flash": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=24,
                          v_head_dim=16, n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=6,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                          mlp_layer_types=["dense", "sparse", "sparse"],
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6,
                                                              "partial_rotary_factor": 0.334},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.334}}),
    # MLA with a low-rank query; layer 0 dense; 2 groups of 4 experts, one group chosen.
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4),
    # DeepSeek-V2 (Lite-like: no query LoRA), softmax routing limited to the best of 2 groups.
    "deepseek_v2": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=2,
                        first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="group_limited_greedy",
                        routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
    "minimax_m2": dict(num_local_experts=8, intermediate_size=32, head_dim=16, rotary_dim=8),
    # Layers alternate sliding (window 8) and full attention; a small swiglu_limit so the clamps act.
    "gpt_oss": dict(num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=8, swiglu_limit=0.5,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 1024,
                                     "rope_theta": 150000.0}),
    # Four layers: sliding, CSA (entries every 4 tokens, the indexer keeping 3), HCA (every 8), CSA;
    # the first MoE layer hash-routed; 4 hyper-connection streams; YaRN on the compressed layers.
    "deepseek_v4": dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], n_routed_experts=8, moe_intermediate_size=32,
        hc_mult=4, partial_rotary_factor=0.25, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    # Hybrids: layers 0-2 gated DeltaNet, layer 3 gated attention (transformers' default 3:1 pattern).
    "qwen3_next": dict(
        num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        intermediate_size=96, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    ),
    "qwen3_5_moe": dict(
        num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
    ),
}
