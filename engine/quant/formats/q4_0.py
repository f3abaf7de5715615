"""Q4_0 (GGML type 2). 32 elements a block: ``d`` fp16, 16 bytes of 4-bit ``q`` (low nibbles are
elements 0–15, high nibbles 16–31); x = d·(q − 8). Encoded with the reference quantizer's rounding."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, f16_bytes, inverse, nibbles, pack_nibbles
from hearth.engine.quant.block import BlockFormat, KernelEntry


def decode(b: torch.Tensor) -> torch.Tensor:
    low, high = nibbles(b[:, 2:])
    return f16_at(b, 0) * (torch.cat([low, high], 1) - 8).float()


def encode(b: torch.Tensor) -> torch.Tensor:
    peak = torch.gather(b, 1, b.abs().argmax(1, keepdim=True))  # the largest magnitude, with its sign
    d = peak / -8
    q = torch.trunc(b * inverse(d) + 8.5).clamp(0, 15)
    return torch.cat([f16_bytes(d), pack_nibbles(q[:, :16], q[:, 16:])], 1)


FORMAT = BlockFormat("q4_0", 32, 18, 2, decode=decode, encode=encode, kernel=KernelEntry(1, "Q4_0"),
                     int8_activations=True)
