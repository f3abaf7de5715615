"""Q6_K (GGML type 14). 256 elements a block: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
16 int8 scales (one per 16 elements), ``d`` fp16; x = d·sc·(q − 32). Encoded with 8-bit sub-block
scales fitted to each sub-block's largest magnitude. The format of the tensors that get more bits in
both K mixes (``q4_k_m``, ``q5_k_m``)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, f16_bytes, inverse, roundf
from hearth.engine.quant.block import BlockFormat, KernelEntry


def decode(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].to(torch.int32).reshape(n, 2, 64)  # two halves of 128 elements
    qh = b[:, 128:192].to(torch.int32).reshape(n, 2, 32)
    scales = b[:, 192:208].view(torch.int8).float().reshape(n, 2, 8)
    d = f16_at(b, 208)
    low = torch.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)  # [n, 2, 4, 32]
    q = ((low | (high << 4)) - 32).float()  # [n, half, quarter, 32]: element 128·half + 32·quarter + l
    sc = scales.reshape(n, 2, 4, 2).repeat_interleave(16, 3)  # one scale per 16 elements
    return (d[:, :, None, None] * sc * q).reshape(n, 256)


def encode(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    peak = torch.gather(sub, 2, sub.abs().argmax(2, keepdim=True))[:, :, 0]  # [n, 16], signed
    scale = peak / -32
    d = (scale.abs().amax(1, keepdim=True) / 127).to(torch.float16).float()
    sc = roundf(scale * inverse(d)).clamp(-128, 127)
    step = (d * sc)[:, :, None]
    q = (roundf(sub * inverse(step)).clamp(-32, 31) + 32).to(torch.int32)  # [n, 16, 16]
    q = q.reshape(n, 2, 4, 32)  # element 128·half + 32·quarter + l
    ql = torch.cat([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                    (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], 2)  # [n, 2, 64]
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4))  # [n, 2, 32]
    return torch.cat([ql.reshape(n, 128).to(torch.uint8), qh.reshape(n, 64).to(torch.uint8),
                      sc.to(torch.int8).view(torch.uint8), f16_bytes(d)], 1)


FORMAT = BlockFormat("q6_k", 256, 210, 14, decode=decode, encode=encode, kernel=KernelEntry(4, "Q6_K"),
                     int8_activations=True, mixes=(("q4_k_m", "more"), ("q5_k_m", "more")))
