"""Q3_K (GGML type 11). 256 elements a block (110 bytes): 32 bytes ``hmask`` (the values' third
bits), 64 bytes of 2-bit values (Q2_K's order), 12 bytes of sixteen 6-bit sub-block scales (low
nibbles of bytes 0–7 for scales 0–7, high nibbles for 8–15; bits 2k, 2k + 1 of bytes 8–11 for the
high bits, k = scale // 4 and byte 8 + scale % 4), then ``d`` fp16; x = d·(scale − 32)·(q − 4·(1 −
h)), h bit 4n + j of hmask byte l for element 128n + 32j + l. Used by llama.cpp's Q3_K mixes for
experts. Read only (decoded at load)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.formats.q2_k import two_bit_values


def scales(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 12] -> the sixteen signed scales (scale − 32) as float32 [n, 16]."""
    p = packed.to(torch.int32)
    low = torch.cat([p[:, :8] & 0xF, p[:, :8] >> 4], dim=1)  # [n, 16]
    high = (p[:, 8:12].unsqueeze(1) >> torch.arange(0, 8, 2, dtype=torch.int32).view(1, 4, 1)) & 3  # [n, k, byte]
    return (low | (high.reshape(-1, 16) << 4)).float() - 32


def decode(b: torch.Tensor) -> torch.Tensor:
    hm = b[:, :32].to(torch.int32).view(-1, 1, 32) >> torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    high = (hm & 1).view(-1, 256)  # bit 4n + j of byte l: element 128n + 32j + l
    q = two_bit_values(b[:, 32:96]) - 4 * (1 - high)
    dl = (f16_at(b, 108) * scales(b[:, 96:108])).repeat_interleave(16, dim=1)
    return dl * q.float()


FORMAT = BlockFormat("q3_k", 256, 110, 11, decode=decode)
