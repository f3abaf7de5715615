"""Rotary position embeddings, including the checkpoint's rope scaling.

Supported ``rope_type`` values: ``default``, ``linear``, ``llama3``, ``yarn`` and ``longrope``
(Phi's: per-channel factors and a cos/sin scale, short ones up to ``original_max_position_embeddings``
and long ones past it, chosen by each token's position as LongRoPE and llama.cpp do), and ``dynamic``
with HunYuan's fixed ``alpha``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hearth.engine.config import ConfigError, ModelConfig, RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope(theta: float, dim: int, p: dict, max_pos: int, which: str) -> tuple[torch.Tensor, float]:
    """LongRoPE's ``which`` ("short" or "long") frequencies, ``1 / (factor_i * theta^(2i/dim))``, and
    its scale: ``{which}_mscale`` where the config gives one (Phi-3.5-MoE), else ``attention_factor``,
    else sqrt(1 + ln(s) / ln(original)) for the extension s = max / original."""
    orig = p["original_max_position_embeddings"]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(p[f"{which}_factor"], dtype=torch.float32) * theta**shape)
    scale = p.get(f"{which}_mscale") or p.get("attention_factor")
    if scale is None:
        factor = p.get("factor") or max_pos / orig
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq, float(scale)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale for the checkpoint's rope type."""
    return inverse_frequencies(cfg.rope, rotary_dim(cfg), cfg.max_position_embeddings)


def inverse_frequencies(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale of ``rope`` over ``dim`` rotating channels."""
    if rope.params.get("freq_factors"):  # (a GGUF file's rope_freqs: divisors per channel pair, llama.cpp's form)
        return _base_inv_freq(rope.theta, dim) / torch.tensor(rope.params["freq_factors"], dtype=torch.float32), 1.0
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.params["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(_base_inv_freq(rope.theta, dim), rope.params), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope.theta, dim, rope.params, max_positions)
    if rope.rope_type == "longrope":
        return _longrope(rope.theta, dim, rope.params, max_positions, "short")
    if rope.rope_type == "dynamic" and rope.params.get("alpha"):
        # HunYuan's NTK-alpha: a fixed, larger base theta * alpha^(d / (d - 2)), the same at every length.
        return _base_inv_freq(rope.theta * rope.params["alpha"] ** (dim / (dim - 2)), dim), 1.0
    raise ConfigError(f"rope_type '{rope.rope_type}' is not supported (default, linear, llama3, yarn, longrope, "
                      "and dynamic with a fixed alpha are)")


def rotary_dim(cfg: ModelConfig) -> int:
    """Channels of each head that rotate (``partial_rotary_factor`` of the head; the rest pass)."""
    dim = int(cfg.head_dim * float(cfg.rope.params.get("partial_rotary_factor", 1.0)))
    if dim <= 0 or dim % 2:
        raise ConfigError(f"partial_rotary_factor gives {dim} rotary channels of {cfg.head_dim} "
                          "(need a positive even count)")
    return dim


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (non-contiguous) positions of a flattened batch. LongRoPE's
    tokens at ``original_max_position_embeddings`` and past it take the long frequencies and scale
    (both tables computed, then chosen per token: no branch on the data, so a captured graph holds)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.scale = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.switch_at: int | None = None
        if cfg.rope.rope_type == "longrope":
            long, self.long_scale = _longrope(cfg.rope.theta, rotary_dim(cfg), cfg.rope.params,
                                              cfg.max_position_embeddings, "long")
            self.register_buffer("long_inv_freq", long, persistent=False)
            self.switch_at = int(cfg.rope.params["original_max_position_embeddings"])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = _table(positions, self.inv_freq, self.scale, dtype)
        if self.switch_at is None:
            return cos, sin
        long_cos, long_sin = _table(positions, self.long_inv_freq, self.long_scale, dtype)
        beyond = (positions >= self.switch_at)[:, None]
        return torch.where(beyond, long_cos, cos), torch.where(beyond, long_sin, sin)


def _table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R] with R <= D (the first R channels rotate)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)
