"""What ``hearth convert --quant`` writes for the families with DeepSeek's latent attention
(DeepSeek-V2/V3, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5, Kimi-Linear), as llama.cpp's converter writes
them; ``gguf_write_families.py`` lists them with the others."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hearth.engine.checkpoint.gguf_write_common import (
    GATING,
    ConvertError,
    Fields,
    deepseek_router,
    nextn_layers,
    rope_of,
)


def deepseek2(cfg: dict, fields: Fields) -> None:
    """DeepSeek-V2/V3: multi-head latent attention written as one KV head of the latent's width (the
    per-head widths under ``*_mla``), the group-limited router, YaRN's attention scale."""
    deepseek_router(cfg, fields)
    rope = rope_of(cfg)
    kv_rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    fields.update(head_count_kv=1, kv_lora_rank=kv_rank, key_length=kv_rank + rope_dim, value_length=kv_rank,
                  key_length_mla=cfg["qk_nope_head_dim"] + rope_dim, value_length_mla=cfg["v_head_dim"],
                  rope_dimension_count=rope_dim, layer_norm_rms_eps=cfg.get("rms_norm_eps", 1e-6))
    if cfg.get("q_lora_rank") is not None:
        fields["q_lora_rank"] = cfg["q_lora_rank"]
    if cfg.get("norm_topk_prob"):
        fields["expert_weights_norm"] = True
    if rope.get("mscale_all_dim") is not None:  # (the converter's convention: 0.1 x mscale_all_dim)
        fields["rope_scaling_yarn_log_mul"] = 0.1 * rope["mscale_all_dim"]


def deepseek3(cfg: dict, fields: Fields) -> None:
    """DeepSeek-V3 routes by sigmoid scores whatever its config says (transformers' class does), and
    llama.cpp takes a file without the gating key for V2's softmax."""
    deepseek2(cfg, fields)
    fields["expert_gating_func"] = GATING["sigmoid"]


def glm4_moe_lite(cfg: dict, fields: Fields) -> None:
    """GLM-4.7-Flash: DeepSeek-V3's layout as the converter writes it, the dense layers counted from
    ``mlp_layer_types`` where the config names them."""
    deepseek3(cfg, fields)
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        fields["leading_dense_block_count"] = _dense_prefix(kinds)


def sparse_deepseek(cfg: dict, fields: Fields) -> None:
    """DeepSeek-V3.2 and GLM-5: DeepSeek-V3's layout plus the indexer's shape, the MTP layers counted
    in ``block_count`` (their converters keep them), GLM-5's indexer layers (True where a layer runs
    its own) and its rotary width; dense layers from ``mlp_layer_types`` where the config names them."""
    glm4_moe_lite(cfg, fields)
    fields.update(indexer_head_count=cfg["index_n_heads"], indexer_key_length=cfg["index_head_dim"],
                  indexer_top_k=cfg["index_topk"])
    if "num_nextn_predict_layers" in cfg:
        fields["block_count"] += nextn_layers(cfg)
        fields["nextn_predict_layers"] = nextn_layers(cfg)
    if cfg.get("indexer_types") is not None:
        fields[".attention.indexer.types"] = [kind == "full" for kind in cfg["indexer_types"]]


def kimi_linear(cfg: dict, fields: Fields) -> None:
    """Kimi-Linear: latent attention as one KV head on its layers and none on the delta attention
    ones (how llama.cpp tells them apart), the delta attention's head width and convolution, the
    DeepSeek-style experts (llama.cpp's Kimi router has no groups)."""
    lac = cfg.get("linear_attn_config") or {}
    n, rope, rank = cfg["num_hidden_layers"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    full = [i + 1 in lac["full_attn_layers"] for i in range(n)] if "full_attn_layers" in lac else \
        [kind == "full_attention" for kind in cfg["layer_types"]]
    fields.update(head_count_kv=[1 if f else 0 for f in full], kv_lora_rank=rank, rope_dimension_count=rope,
                  key_length=rank + rope, key_length_mla=cfg["qk_nope_head_dim"] + rope,
                  value_length_mla=cfg["v_head_dim"],
                  ssm_conv_kernel=lac.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim")),
                  kda_head_dim=lac.get("head_dim", cfg.get("linear_head_dim")),
                  expert_shared_count=cfg.get("num_shared_experts", cfg.get("n_shared_experts")) or 0,
                  leading_dense_block_count=leading_dense(cfg), expert_weights_scale=cfg["routed_scaling_factor"])
    if cfg.get("q_lora_rank") is not None:
        fields["q_lora_rank"] = cfg["q_lora_rank"]
    if cfg.get("topk_group") is not None:
        fields["expert_group_used_count"] = cfg["topk_group"]


def _dense_prefix(kinds: list[str]) -> int:
    """How many layers ``mlp_layer_types`` names before its first MoE ("sparse") one."""
    return next((i for i, kind in enumerate(kinds) if kind == "sparse"), len(kinds))


def leading_dense(cfg: dict) -> int:
    """The dense layers' count, which GGUF holds as a prefix: from ``mlp_layer_types`` where the config
    names them (transformers saves that), else ``first_k_dense_replace``; dense layers elsewhere are
    refused, as a GGUF file cannot say so."""
    kinds = cfg.get("mlp_layer_types")
    if not kinds:
        return cfg.get("first_k_dense_replace") or 0
    count = _dense_prefix(kinds)
    if "dense" in kinds[count:]:
        raise ConvertError(f"dense layers after the first MoE layer ({kinds}): llama.cpp's files hold only a "
                           "leading run of them")
    return count


def kimi_linear_tensors(target: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """As the converter writes them: A as ``-exp(A_log)``, the convolutions [1, C, 1, K], kv_b split."""
    if target.endswith(".ssm_a"):
        yield target, -torch.exp(t.float())
    elif ".ssm_conv1d_" in target:
        yield target, t.reshape(1, t.shape[0], 1, t.shape[-1])
    else:
        yield from split_kv_b(target, t, cfg)


def split_kv_b(target: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """MLA's ``kv_b_proj`` [heads * (nope + v), rank] as llama.cpp absorbs it: ``attn_k_b`` [heads,
    rank, nope] (each head's key part transposed) and ``attn_v_b`` [heads, v, rank]."""
    if ".attn_kv_b." not in target:
        yield target, t
        return
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    k_b, v_b = t.view(heads, nope + v, t.shape[-1]).split([nope, v], dim=1)
    yield target.replace(".attn_kv_b.", ".attn_k_b."), k_b.transpose(1, 2).contiguous()
    yield target.replace(".attn_kv_b.", ".attn_v_b."), v_b.contiguous()
