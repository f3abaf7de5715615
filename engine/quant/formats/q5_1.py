"""Q5_1 (GGML type 7). 32 elements a block: ``d`` and ``m`` fp16, 4 bytes ``qh`` (each element's fifth
bit), 16 bytes of low nibbles; x = d·q + m. llama.cpp's quantizer writes it where Q5_K does not fit a
row. Read only (decoded at load: no kernel)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.formats.q5_0 import values


def decode(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * values(b, 4).float() + f16_at(b, 2)


FORMAT = BlockFormat("q5_1", 32, 24, 7, decode=decode)
