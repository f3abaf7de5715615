"""Byte-level helpers the block formats' torch encoders and decoders share (fp16 fields, nibbles, the
reference quantizer's rounding)."""

from __future__ import annotations

import torch


def f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high nibbles of every byte, as int32."""
    return (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf, as the reference quantizer rounds)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 bytes [n, 2]."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def pack_nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte, ``low`` in the low nibble."""
    return (low.to(torch.uint8) & 0x0F) | (high.to(torch.uint8) << 4)
