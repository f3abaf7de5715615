"""MXFP4 (GGML type 39). 32 elements a block: one E8M0 exponent byte ``e``, 16 bytes of E2M1 nibbles
(low nibbles are elements 0–15); x = 2^(e − 127) · fp4(q). Encoded with the reference quantizer's
rounding."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import nibbles, pack_nibbles
from hearth.engine.quant.block import BlockFormat, KernelEntry

# E2M1 values: sign bit 3, then 1 exponent bit pair and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode(b: torch.Tensor) -> torch.Tensor:
    # E8M0 as the reference computes it: half the scale times doubled E2M1 values (so that the
    # largest exponent, 2^128, stays finite where the value allows).
    half = torch.exp2(b[:, :1].float() - 128)
    low, high = nibbles(b[:, 1:])
    doubled = 2 * torch.tensor(FP4_VALUES, dtype=torch.float32)
    return half * doubled[torch.cat([low, high], 1)]


def encode(b: torch.Tensor) -> torch.Tensor:
    amax = b.abs().amax(1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2 + 127,
                    torch.zeros_like(amax)).clamp(0, 255)
    scale = torch.exp2(e - 127)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    q = (scale[:, :, None] * values - b[:, :, None]).abs().argmin(-1)  # [n, 32]: the nearest code
    return torch.cat([e.to(torch.uint8), pack_nibbles(q[:, :16], q[:, 16:])], 1)


FORMAT = BlockFormat("mxfp4", 32, 17, 39, decode=decode, encode=encode, kernel=KernelEntry(5, "Mxfp4"),
                     int8_activations=True)
