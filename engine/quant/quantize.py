"""Quantize float weights into the block formats of :mod:`hearth.engine.quant.formats` (the
tests' GGUF writer uses it; ``hearth convert --quant`` will).

Q8_0, Q4_0 and MXFP4 follow the rounding of the reference quantizer in the ``gguf`` package, so
the bytes are the same as llama.cpp's Python tools write. The K-quants (which the reference does
not quantize in Python) use a min/max fit per sub-block with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K)
sub-block scales; the tests bound their error and check that the reference dequantizer reads
them as :func:`~hearth.engine.quant.formats.dequantize` does.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from hearth.engine.quant.formats import _FP4_VALUES, FORMATS, BlockFormat


def quantize(x: torch.Tensor, fmt: str | BlockFormat) -> torch.Tensor:
    """``x`` [rows, cols] (any float dtype) -> uint8 [rows, row_bytes] in format ``fmt``."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    rows, cols = x.shape
    fmt.row_bytes(cols)  # refuses a row that is not whole blocks
    blocks = x.float().reshape(-1, fmt.block_elems)
    return _ENCODERS[fmt.name](blocks).reshape(rows, -1)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf, as the reference quantizer rounds)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 bytes [n, 2]."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _pack_nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (low.to(torch.uint8) & 0x0F) | (high.to(torch.uint8) << 4)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(1, keepdim=True) / 127
    q = _roundf(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    peak = torch.gather(b, 1, b.abs().argmax(1, keepdim=True))  # the largest magnitude, with its sign
    d = peak / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    amax = b.abs().amax(1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2 + 127,
                    torch.zeros_like(amax)).clamp(0, 255)
    scale = torch.exp2(e - 127)
    values = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    q = (scale[:, :, None] * values - b[:, :, None]).abs().argmin(-1)  # [n, 32]: the nearest code
    return torch.cat([e.to(torch.uint8), _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _fit_sub_blocks(b: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: per 32-element sub-block x ≈ d·sc·q − dmin·m with 6-bit sc, m and q in
    [0, levels]. Returns (d, dmin) float32 [n, 1] (fp16-rounded), (sc, m) int [n, 8], q int [n, 8, 32]."""
    sub = b.reshape(-1, 8, 32)
    low = sub.amin(-1).clamp(max=0)  # x ≥ low; the offset is kept non-negative, as the format needs
    scale = (sub.amax(-1) - low) / levels  # [n, 8]
    offset = -low
    d = (scale.amax(1, keepdim=True) / 63).to(torch.float16).float()
    dmin = (offset.amax(1, keepdim=True) / 63).to(torch.float16).float()
    sc = _roundf(scale * _inverse(d)).clamp(0, 63)
    m = _roundf(offset * _inverse(dmin)).clamp(0, 63)
    step = (d * sc)[:, :, None]
    q = _roundf((sub + (dmin * m)[:, :, None]) * _inverse(step)).clamp(0, levels)
    return d, dmin, sc.to(torch.int32), m.to(torch.int32), q.to(torch.int32)


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins [n, 8] -> the 12 bytes of a K-quant super-block."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([first, second, third], 1).to(torch.uint8)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, q = _fit_sub_blocks(b, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high
    qs = _pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qs], 1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, q = _fit_sub_blocks(b, 31)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = _pack_nibbles(pairs[:, :, 0] & 0x0F, pairs[:, :, 1] & 0x0F).reshape(-1, 128)
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 4, 2, 1)  # fifth bit of sub-block k at bit k
    qh = ((pairs >> 4) << shifts).sum((1, 2)).to(torch.uint8)  # [n, 32]
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, qs], 1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    peak = torch.gather(sub, 2, sub.abs().argmax(2, keepdim=True))[:, :, 0]  # [n, 16], signed
    scale = peak / -32
    d = (scale.abs().amax(1, keepdim=True) / 127).to(torch.float16).float()
    sc = _roundf(scale * _inverse(d)).clamp(-128, 127)
    step = (d * sc)[:, :, None]
    q = (_roundf(sub * _inverse(step)).clamp(-32, 31) + 32).to(torch.int32)  # [n, 16, 16]
    q = q.reshape(n, 2, 4, 32)  # element 128·half + 32·quarter + l
    ql = torch.cat([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                    (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], 2)  # [n, 2, 64]
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4))  # [n, 2, 32]
    return torch.cat([ql.reshape(n, 128).to(torch.uint8), qh.reshape(n, 64).to(torch.uint8),
                      sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], 1)


_ENCODERS = MappingProxyType({"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
                              "mxfp4": _mxfp4})
