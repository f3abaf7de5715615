"""Q5_0 (GGML type 6). 32 elements a block: ``d`` fp16, 4 bytes ``qh`` holding each element's fifth
bit (bit j for element j), 16 bytes of low nibbles (elements 0–15 low, 16–31 high); x = d·(q − 16).
llama.cpp's quantizer writes it where Q4_K does not fit a row (a row that is not whole 256-element
blocks). Read only (decoded at load: no kernel)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, nibbles
from hearth.engine.quant.block import BlockFormat


def fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> each of its 32 bits as int32 [n, 32], bit j at j."""
    bits = torch.arange(8, dtype=torch.int32)
    return ((qh.to(torch.int32).unsqueeze(-1) >> bits) & 1).reshape(qh.shape[0], 32)


def values(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit values 0..31 of blocks whose ``qh`` starts at byte ``qh_at`` (the nibbles follow)."""
    low, high = nibbles(b[:, qh_at + 4 :])
    return torch.cat([low, high], 1) | (fifth_bits(b[:, qh_at : qh_at + 4]) << 4)


def decode(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * (values(b, 2) - 16).float()


FORMAT = BlockFormat("q5_0", 32, 22, 6, decode=decode)
