"""Q4_1 (GGML type 3). 32 elements a block: ``d`` and ``m`` fp16, 16 bytes of 4-bit ``q`` (low nibbles
are elements 0–15, high nibbles 16–31); x = d·q + m. Read only (decoded at load: no kernel)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, nibbles
from hearth.engine.quant.block import BlockFormat


def decode(b: torch.Tensor) -> torch.Tensor:
    low, high = nibbles(b[:, 4:])
    return f16_at(b, 0) * torch.cat([low, high], 1).float() + f16_at(b, 2)


FORMAT = BlockFormat("q4_1", 32, 20, 3, decode=decode)
