"""Q4_K (GGML type 12). 256 elements a block: ``d``, ``dmin`` fp16, 12 bytes packing 8 six-bit scales
and mins (one pair per 32 elements), 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block,
high nibbles the next); x = d·sc·q − dmin·m. The reference has no quantizer for it in Python: it is
encoded with a min/max fit per sub-block (``quant/kquant.py``). The base format of ``q4_k_m``."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_bytes, nibbles, pack_nibbles
from hearth.engine.quant.block import BlockFormat, KernelEntry
from hearth.engine.quant.kquant import fit_sub_blocks, k_apply, pack_k_scales


def decode(b: torch.Tensor) -> torch.Tensor:
    low, high = nibbles(b[:, 16:144].reshape(-1, 4, 32))  # 4 chunks of 64 elements
    return k_apply(b, torch.stack([low, high], 2).reshape(-1, 8, 32))


def encode(b: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, q = fit_sub_blocks(b, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high
    qs = pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), pack_k_scales(sc, m), qs], 1)


FORMAT = BlockFormat("q4_k", 256, 144, 12, decode=decode, encode=encode, kernel=KernelEntry(2, "Q4_K"),
                     int8_activations=True, mixes=(("q4_k_m", "base"),))
