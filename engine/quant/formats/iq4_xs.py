"""IQ4_XS (GGML type 23). 256 elements a block (136 bytes): ``d`` fp16, ``scales_h`` (uint16: bits 2i,
2i + 1 are sub-block i's high scale bits), 4 bytes ``scales_l`` (sub-block i's low four bits in
nibble i % 2 of byte i // 2), 128 bytes of 4-bit indices into IQ4_NL's non-linear table (per
32-element sub-block, 16 bytes: low nibbles elements 0–15, high 16–31); x = d·(scale − 32)·table[q].
Used by llama.cpp's IQ4_XS files and the Unsloth-style mixes for experts. Read only (decoded at load)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, nibbles
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.formats.iq4_nl import LEVELS


def decode(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    low_lo, low_hi = nibbles(b[:, 4:8])  # [n, 4] each: sub-blocks 0, 2, 4, 6 and 1, 3, 5, 7
    low = torch.stack([low_lo, low_hi], dim=2).reshape(n, 8)
    ls = low | (((high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3) << 4)  # [n, 8]
    lo, hi = nibbles(b[:, 8:].reshape(n, 8, 16))
    q = torch.cat([lo, hi], dim=2).reshape(n, 256)
    table = torch.tensor(LEVELS, dtype=torch.float32)
    dl = (f16_at(b, 0) * (ls - 32).float()).repeat_interleave(32, dim=1)
    return dl * table[q]


FORMAT = BlockFormat("iq4_xs", 256, 136, 23, decode=decode)
