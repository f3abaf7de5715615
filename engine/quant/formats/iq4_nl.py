"""IQ4_NL (GGML type 20). 32 elements a block: ``d`` fp16, 16 bytes of 4-bit indices (low nibbles are
elements 0–15, high nibbles 16–31) into a fixed non-linear table; x = d·table[q]. llama.cpp's
quantizer writes it where Q2_K, Q3_K or IQ4_XS do not fit a row. Read only (decoded at load)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, nibbles
from hearth.engine.quant.block import BlockFormat

# The levels, as ggml defines them (kvalues_iq4nl).
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def decode(b: torch.Tensor) -> torch.Tensor:
    low, high = nibbles(b[:, 2:])
    table = torch.tensor(LEVELS, dtype=torch.float32)
    return f16_at(b, 0) * table[torch.cat([low, high], 1)]


FORMAT = BlockFormat("iq4_nl", 32, 18, 20, decode=decode)
