"""Q2_K (GGML type 10). 256 elements a block (84 bytes): 16 bytes of sub-block scales (per 16
elements: a 4-bit scale, low nibble, and a 4-bit min, high nibble), 64 bytes of 2-bit values, then
``d`` and ``dmin`` fp16; x = d·scale·q − dmin·min. The values of element 128n + 32j + l (l < 32) are
bits 2j, 2j + 1 of byte 32n + l. Used by llama.cpp's low-bit mixes (Q2_K, the Unsloth-style XL
mixes) for experts. Read only (decoded at load)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at
from hearth.engine.quant.block import BlockFormat


def two_bit_values(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 64] -> the 256 two-bit values (0..3) as int32 [n, 256], in element order."""
    shifts = torch.arange(0, 8, 2, dtype=torch.int32).view(1, 1, 4, 1)
    q = (qs.to(torch.int32).view(-1, 2, 1, 32) >> shifts) & 3  # [n, half, j, l]
    return q.reshape(-1, 256)


def decode(b: torch.Tensor) -> torch.Tensor:
    sc = b[:, :16].to(torch.int32)
    dl = (f16_at(b, 80) * (sc & 0xF).float()).repeat_interleave(16, dim=1)
    ml = (f16_at(b, 82) * (sc >> 4).float()).repeat_interleave(16, dim=1)
    return dl * two_bit_values(b[:, 16:80]).float() - ml


FORMAT = BlockFormat("q2_k", 256, 84, 10, decode=decode)
