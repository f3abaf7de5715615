"""Grouped-query attention with RoPE over the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch, SequenceSlice
from engine.config import ModelConfig
from engine.layers.norm import RMSNorm
from engine.layers.rope import apply_rotary


def _linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    layer.requires_grad_(False)
    return layer


def attention_mask(seq: SequenceSlice, window: int | None) -> torch.Tensor | None:
    """Boolean [query_len, context_len] mask (True = attend), or None when plain causal attention
    (``is_causal``, or a single query that sees every key) is enough."""
    first_q = seq.context_len - seq.query_len
    windowed = window is not None and seq.context_len > window
    if not windowed and (seq.query_len == 1 or first_q == 0):
        return None
    q_pos = torch.arange(first_q, seq.context_len)[:, None]
    k_pos = torch.arange(seq.context_len)[None, :]
    mask = k_pos <= q_pos
    if windowed:
        mask &= k_pos > q_pos - window
    return mask


class Attention(nn.Module):
    """Self-attention of one decoder layer; writes this step's K/V into the paged cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.window = cfg.sliding_windows[layer_idx]
        self.q_proj = _linear(h, cfg.num_heads * d, cfg.qkv_bias, cfg.dtype)
        self.k_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, cfg.dtype)
        self.v_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, cfg.dtype)
        self.o_proj = _linear(cfg.num_heads * d, h, False, cfg.dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [slots, kv_heads, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)

        out = torch.empty_like(q)
        for seq in batch.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = k_cache.index_select(0, seq.context_slots)  # [ctx, kv_heads, D]
            vals = v_cache.index_select(0, seq.context_slots)
            mask = attention_mask(seq, self.window)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],  # [1, heads, q, D]
                keys.transpose(0, 1)[None],  # [1, kv_heads, ctx, D]
                vals.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None and seq.query_len > 1,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[rows] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
