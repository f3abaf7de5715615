"""The hybrids' (Qwen3-Next, Qwen3.5-MoE) tensors back from a llama.cpp GGUF file to transformers'
parameters, for the test reference: the converter's own transforms (``conversion/qwen.py`` in
llama.cpp) applied to index vectors give each stored row's source, and ``argsort`` inverts them;
the value changes (norms stored plus one, ``A_log`` as ``-exp(A_log)``) are undone directly."""

from __future__ import annotations

from typing import Any

import torch

HYBRIDS = ("qwen3next", "qwen35moe")
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
             "model.norm.weight")


def _tiled(index: torch.Tensor, keys: int, per_key: int, width: int) -> torch.Tensor:
    """The converter's ``_reorder_v_heads`` on a vector: grouped by key head to tiled."""
    return index.reshape(keys, per_key, width).transpose(0, 1).reshape(-1)


def _qkvz_sources(keys: int, key_dim: int, per_key_v: int) -> torch.Tensor:
    """For Qwen3-Next: the row of ``in_proj_qkvz`` each row of cat(attn_qkv, attn_gate) comes from."""
    sizes = [key_dim, key_dim, per_key_v, per_key_v]
    index = torch.arange(keys * sum(sizes)).view(1, keys, sum(sizes))
    q, k, v, z = torch.split(index, sizes, dim=-1)
    return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1), z.reshape(-1)])


def hybrid_weight(arch: str, name: str, tensors: dict[str, torch.Tensor], config: Any) -> torch.Tensor | None:
    """transformers' parameter ``name`` from the file's tensors, or None where nothing differs."""
    if arch not in HYBRIDS:
        return None
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    if ".linear_attn." not in name:  # (norms are read by name, then less one: see `adjusted`)
        return None
    keys, heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    per_key = heads // keys
    if name.endswith("in_proj_qkvz.weight"):
        stored = torch.cat([tensors[f"blk.{layer}.attn_qkv.weight"], tensors[f"blk.{layer}.attn_gate.weight"]])
        return stored[torch.argsort(_qkvz_sources(keys, key_dim, per_key * value_dim))]
    if name.endswith("A_log"):
        stored = torch.log(-tensors[f"blk.{layer}.ssm_a"])
    elif name.endswith("dt_bias"):
        stored = tensors[f"blk.{layer}.ssm_dt.bias"]
    else:
        return None
    return _untiled(arch, stored, keys, per_key)


def _untiled(arch: str, stored: torch.Tensor, keys: int, per_key: int) -> torch.Tensor:
    if arch != "qwen35moe" or per_key == 1:
        return stored
    return stored[torch.argsort(_tiled(torch.arange(stored.shape[0]), keys, per_key, 1))]


def untile_qwen35(name: str, stored: torch.Tensor, config: Any) -> torch.Tensor:
    """Qwen3.5's DeltaNet tensors found by name: their value heads back from tiled to grouped."""
    keys, heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim, per_key = config.linear_key_head_dim, config.linear_value_head_dim, heads // keys
    if per_key == 1 or ".linear_attn." not in name:
        return stored
    qk = 2 * keys * key_dim
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        rows = torch.cat([torch.arange(qk), qk + _tiled(torch.arange(stored.shape[0] - qk), keys, per_key, value_dim)])
        return stored[torch.argsort(rows)]
    if name.endswith("in_proj_z.weight"):
        return stored[torch.argsort(_tiled(torch.arange(stored.shape[0]), keys, per_key, value_dim))]
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return stored[torch.argsort(_tiled(torch.arange(stored.shape[0]), keys, per_key, 1))]
    if name.endswith("out_proj.weight"):
        return stored[:, torch.argsort(_tiled(torch.arange(stored.shape[1]), keys, per_key, value_dim))]
    return stored


def adjusted(arch: str, name: str, stored: torch.Tensor, config: Any) -> torch.Tensor:
    """A tensor found by name, less what the converter changed: zero-centred norms stored plus one,
    and Qwen3.5's reordered value heads."""
    if arch not in HYBRIDS:
        return stored
    if name.endswith(_PLUS_ONE) and ".linear_attn." not in name:
        return stored - 1
    return untile_qwen35(name, stored, config) if arch == "qwen35moe" else stored
