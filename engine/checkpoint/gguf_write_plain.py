"""What ``hearth convert --quant`` writes for the families whose GGUF files hold a plain decoder (DBRX,
Hunyuan V3, Mellum, Laguna), as llama.cpp's converter writes them (``gguf_write_families.py`` lists them)."""

from __future__ import annotations

import re

import torch

from hearth.engine.checkpoint.gguf_write_common import GATING, ConvertError, Fields, rope_of, rope_scaling_fields


def hy_v3(cfg: dict, fields: Fields) -> None:
    """Hunyuan V3: the shared experts' width, the renormalised weights' scale, sigmoid gating (the dense
    layers are told by their tensors). llama.cpp's hy_v3 has no biases: a checkpoint with them is refused."""
    biased = [key for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    if biased:
        raise ConvertError(f"Hunyuan V3 with {' and '.join(biased)}: llama.cpp's hy_v3 computes no biases")
    fields.update(expert_shared_feed_forward_length=cfg["moe_intermediate_size"] * (cfg.get("num_shared_experts") or 1),
                  expert_weights_norm=True, expert_weights_scale=float(cfg.get("router_scaling_factor", 1.0)),
                  expert_gating_func=GATING["sigmoid"])


def mellum(cfg: dict, fields: Fields) -> None:
    """Mellum: each layer type's rotary base, the window and its pattern. llama.cpp's converter maps no
    dense MLP and its mellum renormalises the top-k weights: checkpoints otherwise are refused."""
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    if "dense" in (cfg.get("mlp_layer_types") or []) or cfg.get("norm_topk_prob") is False:
        raise ConvertError("Mellum with dense layers or unnormalised top-k weights: llama.cpp's mellum has neither")
    ropes = cfg.get("rope_parameters") or {}
    theta = {kind: float((ropes.get(kind) or {}).get("rope_theta", fields["rope_freq_base"])) for kind in set(kinds)}
    fields["rope_freq_base"] = theta.get("full_attention", fields["rope_freq_base"])
    if cfg.get("sliding_window") and "sliding_attention" in kinds:
        fields.update(rope_freq_base_swa=theta["sliding_attention"], sliding_window=cfg["sliding_window"],
                      sliding_window_pattern=[kind == "sliding_attention" for kind in kinds])


def dbrx_config(cfg: dict) -> dict:
    """DBRX's config.json in the common names (its widths, heads and experts under ``attn_config`` and
    ``ffn_config``; the rotary base from ``attn_config``, as the converter reads it)."""
    attn, ffn = cfg["attn_config"], cfg["ffn_config"]
    return {**cfg, "hidden_size": cfg["d_model"], "num_hidden_layers": cfg["n_layers"],
            "num_attention_heads": cfg["n_heads"], "num_key_value_heads": attn["kv_n_heads"],
            "max_position_embeddings": cfg["max_seq_len"], "intermediate_size": ffn["ffn_hidden_size"],
            "moe_num_experts": ffn["moe_num_experts"], "num_experts_per_tok": ffn["moe_top_k"],
            "rope_parameters": {"rope_type": "default", "rope_theta": attn.get("rope_theta", 10000.0)},
            "layer_norm_eps": 1e-5}


def dbrx(cfg: dict, fields: Fields) -> None:
    """DBRX: the converter's keys only, with the clip (0: none); llama.cpp divides the top-k weights by
    their sum, so another norm of them (``moe_normalize_expert_weights``) is refused."""
    p = cfg["ffn_config"].get("moe_normalize_expert_weights", 1.0)
    if p != 1:
        raise ConvertError(f"DBRX with moe_normalize_expert_weights={p}: llama.cpp divides the top-k weights by "
                           "their sum (a 1-norm) only")
    for key in ("key_length", "value_length", "rope_dimension_count", "vocab_size"):
        fields.pop(key)
    fields["clamp_kqv"] = float(cfg["attn_config"].get("clip_qkv") or 0.0)


def dbrx_experts(tensors: dict, cfg: dict) -> dict:
    """DBRX's experts ``w1``, ``v1``, ``w2`` (each [E * I, H], ``w2`` down's transpose) as the standard
    fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    shape = (cfg["moe_num_experts"], cfg["intermediate_size"], cfg["hidden_size"])  # [E, I, H]
    out, parts = {}, {}
    for name, load in tensors.items():
        m = re.match(r"^transformer\.blocks\.(\d+)\.ffn\.experts\.mlp\.(w1|v1|w2)$", name)
        if m is None:
            out[name] = load
        else:
            parts.setdefault(int(m.group(1)), {})[m.group(2)] = load
    for layer, loads in parts.items():
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = lambda w1=loads["w1"], v1=loads["v1"]: torch.cat(
            [w1().view(shape), v1().view(shape)], dim=1)
        out[prefix + "down_proj"] = lambda w2=loads["w2"]: w2().view(shape).transpose(1, 2).contiguous()
    return out


def laguna(cfg: dict, fields: Fields) -> None:
    """Laguna: query heads per layer, the window and its pattern (written out: llama.cpp otherwise takes
    every fourth layer from the first as the global ones), each layer type's rotary base and width, YaRN
    on the global layers where configured, leading dense layers, the shared experts' width, the routed
    scale; a router soft-cap, dense layers after MoE ones and a sliding-layer rotary other than plain are
    refused (llama.cpp has none of them)."""
    n, dim = cfg["num_hidden_layers"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kinds, mlp = cfg.get("layer_types") or ["full_attention"] * n, cfg.get("mlp_layer_types") or ["sparse"] * n
    dense = next((i for i, kind in enumerate(mlp) if kind != "dense"), n)
    ropes = cfg.get("rope_parameters") or {}
    full, swa = ropes.get("full_attention") or {}, ropes.get("sliding_attention") or {}
    plain_swa = swa.get("rope_type", "default") == "default"
    if cfg.get("moe_router_logit_softcapping") or "dense" in mlp[dense:] or not plain_swa:
        raise ConvertError("Laguna with a router soft-cap, dense layers after MoE ones or a scaled rotary on its "
                           "sliding layers: llama.cpp's laguna has none of them")
    fields.update(head_count=list(cfg.get("num_attention_heads_per_layer") or [cfg["num_attention_heads"]] * n),
                  expert_shared_feed_forward_length=cfg["shared_expert_intermediate_size"],
                  expert_weights_norm=True, expert_weights_scale=float(cfg.get("moe_routed_scaling_factor", 1.0)),
                  expert_gating_func=GATING["sigmoid"], leading_dense_block_count=dense,
                  rope_freq_base=float(full.get("rope_theta", 500000.0)),
                  rope_dimension_count=int(dim * float(full.get("partial_rotary_factor", 1.0))),
                  **rope_scaling_fields(rope_of({"rope_parameters": full})))
    if cfg.get("sliding_window") and "sliding_attention" in kinds:
        fields.update(sliding_window=cfg["sliding_window"], rope_freq_base_swa=float(swa.get("rope_theta", 10000.0)),
                      rope_dimension_count_swa=int(dim * float(swa.get("partial_rotary_factor", 1.0))),
                      sliding_window_pattern=[kind == "sliding_attention" for kind in kinds])
