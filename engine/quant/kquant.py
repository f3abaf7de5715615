"""The super-block scales that Q4_K and Q5_K share: 8 six-bit scales and mins in 12 bytes, one pair
per 32 elements, with x = d·sc·q − dmin·m (decoded and fitted with torch)."""

from __future__ import annotations

import torch

from hearth.engine.quant.bits import f16_at, inverse, roundf


def k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a K-quant super-block, from its 12 bytes [n, 12]."""
    p = packed.to(torch.int32)
    sc_lo, m_lo = p[:, 0:4] & 63, p[:, 4:8] & 63  # sub-blocks 0-3
    sc_hi = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)  # sub-blocks 4-7
    m_hi = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()  # [n, 8] each


def k_apply(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d·sc·q − dmin·m for q [n, 8, 32] of a Q4_K / Q5_K super-block."""
    sc, m = k_scales(b[:, 4:16])
    x = (f16_at(b, 0) * sc)[:, :, None] * q.float() - (f16_at(b, 2) * m)[:, :, None]
    return x.reshape(b.shape[0], 256)


def fit_sub_blocks(b: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: per 32-element sub-block x ≈ d·sc·q − dmin·m with 6-bit sc, m and q in
    [0, levels]. Returns (d, dmin) float32 [n, 1] (fp16-rounded), (sc, m) int [n, 8], q int [n, 8, 32]."""
    sub = b.reshape(-1, 8, 32)
    low = sub.amin(-1).clamp(max=0)  # x ≥ low; the offset is kept non-negative, as the format needs
    scale = (sub.amax(-1) - low) / levels  # [n, 8]
    offset = -low
    d = (scale.amax(1, keepdim=True) / 63).to(torch.float16).float()
    dmin = (offset.amax(1, keepdim=True) / 63).to(torch.float16).float()
    sc = roundf(scale * inverse(d)).clamp(0, 63)
    m = roundf(offset * inverse(dmin)).clamp(0, 63)
    step = (d * sc)[:, :, None]
    q = roundf((sub + (dmin * m)[:, :, None]) * inverse(step)).clamp(0, levels)
    return d, dmin, sc.to(torch.int32), m.to(torch.int32), q.to(torch.int32)


def pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins [n, 8] -> the 12 bytes of a K-quant super-block."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([first, second, third], 1).to(torch.uint8)
