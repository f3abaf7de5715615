"""Q5_K (GGML type 13). As Q4_K, with 32 bytes of fifth bits (bit 2j / 2j+1 of byte l for the two
sub-blocks of the j-th 64 elements) before the nibbles. Encoded with a min/max fit per sub-block
(``quant/kquant.py``). The base format of ``q5_k_m``."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_bytes, nibbles, pack_nibbles
from hearth.engine.quant.block import BlockFormat, KernelEntry
from hearth.engine.quant.kquant import fit_sub_blocks, k_apply, pack_k_scales


def decode(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].to(torch.int32)  # [n, 32]
    low, high = nibbles(b[:, 48:176].reshape(-1, 4, 32))
    shifts = torch.arange(8, dtype=torch.int32).reshape(4, 2)  # chunk j: bits 2j (low), 2j + 1 (high)
    bits = (qh[:, None, None, :] >> shifts[None, :, :, None]) & 1  # [n, 4, 2, 32]
    q = torch.stack([low, high], 2) | (bits << 4)
    return k_apply(b, q.reshape(-1, 8, 32))


def encode(b: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, q = fit_sub_blocks(b, 31)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = pack_nibbles(pairs[:, :, 0] & 0x0F, pairs[:, :, 1] & 0x0F).reshape(-1, 128)
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 4, 2, 1)  # fifth bit of sub-block k at bit k
    qh = ((pairs >> 4) << shifts).sum((1, 2)).to(torch.uint8)  # [n, 32]
    return torch.cat([f16_bytes(d), f16_bytes(dmin), pack_k_scales(sc, m), qh, qs], 1)


FORMAT = BlockFormat("q5_k", 256, 176, 13, decode=decode, encode=encode, kernel=KernelEntry(3, "Q5_K"),
                     int8_activations=True, mixes=(("q5_k_m", "base"),))
