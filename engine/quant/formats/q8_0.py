"""Q8_0 (GGML type 8). 32 elements a block: ``d`` fp16, 32 × int8 ``q``; x = d·q. Encoded with the
rounding of the reference quantizer in the ``gguf`` package (the same bytes as llama.cpp's tools)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, f16_bytes, inverse, roundf
from hearth.engine.quant.block import BlockFormat, KernelEntry


def decode(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * b[:, 2:].view(torch.int8).float()


def encode(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(1, keepdim=True) / 127
    q = roundf(b * inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([f16_bytes(d), q], 1)


FORMAT = BlockFormat("q8_0", 32, 34, 8, decode=decode, encode=encode, kernel=KernelEntry(0, "Q8_0"),
                     int8_activations=True)
