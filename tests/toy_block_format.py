"""A toy block format, whole in this one module, as a new format would be written under
``engine/quant/formats/``: 16 elements a block, an fp32 scale ``d`` (little-endian) and 16 int8
``q``; x = d·q, with d the block's largest magnitude over 127. No GGML type, no native kernel, no
int8-activation kernel, no mix: the torch encode and decode are all it brings."""

from __future__ import annotations

import torch

from hearth.engine.quant.block import BlockFormat


def decode(b: torch.Tensor) -> torch.Tensor:
    return b[:, :4].contiguous().view(torch.float32) * b[:, 4:].view(torch.int8).float()


def encode(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
    q = torch.round(b * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([d.contiguous().view(torch.uint8), q], 1)


FORMAT = BlockFormat("toy_i8x16", 16, 20, -1, decode=decode, encode=encode)
