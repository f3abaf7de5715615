"""Block-quantized weight formats as llama.cpp lays them out (GGML), decoded with torch.

A quantized weight row of ``cols`` elements is ``cols / block_elems`` blocks of ``block_bytes``
bytes each; a tensor of them is ``uint8 [rows, cols / block_elems * block_bytes]``. Experts stay
in these bytes from file to kernel; :func:`dequantize` is the torch fallback kernel and the
reference the native kernels are tested against (itself tested against the ``gguf`` package's
own dequantizer, byte for byte the format's definition).

Layouts (per block; fp16 values little-endian):

- ``q8_0``: 32 elements: ``d`` fp16, 32 × int8 ``q``; x = d·q.
- ``q4_0``: 32 elements: ``d`` fp16, 16 bytes of 4-bit ``q`` (low nibbles are elements 0–15, high
  nibbles 16–31); x = d·(q − 8).
- ``q4_k``: 256 elements: ``d``, ``dmin`` fp16, 12 bytes packing 8 six-bit scales and mins (one
  pair per 32 elements), 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block, high
  nibbles the next); x = d·sc·q − dmin·m.
- ``q5_k``: as ``q4_k`` with 32 bytes of fifth bits (bit 2j / 2j+1 of byte l for the two sub-blocks
  of the j-th 64 elements), before the nibbles.
- ``q6_k``: 256 elements: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales
  (one per 16 elements), ``d`` fp16; x = d·sc·(q − 32).
- ``mxfp4``: 32 elements: one E8M0 exponent byte ``e``, 16 bytes of E2M1 nibbles (low nibbles are
  elements 0–15); x = 2^(e − 127) · fp4(q).

hearth's own layouts (:data:`HEARTH_FORMATS`, no GGML type: repacked from Hugging Face checkpoints
at load, never written to GGUF files):

- ``fp8_e4m3``: 128 elements: an fp32 scale ``s`` (little-endian), 128 float8 e4m3fn bytes ``q``;
  x = s·q. A checkpoint's 128×128 tile scales (``weight_scale_inv``) are copied into the blocks of
  every row the tile covers, so the repacking loses nothing and a row of blocks stands alone (rows
  concatenate, as q/k/v fusion and the expert banks need).
- ``bf16``: 32 elements: 32 bfloat16 values (64 bytes), no scale. A bf16 GGUF tensor's bytes as
  stored, so that a bf16 file computed with fp32 activations keeps its weights at their size.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class BlockFormat:
    """One block-quantized format: elements and bytes per block, and its GGML type id."""

    name: str
    block_elems: int
    block_bytes: int
    ggml_type: int  # -1 for hearth's own layouts (HEARTH_FORMATS)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` elements (a multiple of the block)."""
        if cols % self.block_elems:
            raise ValueError(f"{self.name}: a row of {cols} elements is not a whole number of "
                             f"{self.block_elems}-element blocks")
        return cols // self.block_elems * self.block_bytes

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems


FORMATS = MappingProxyType({f.name: f for f in (
    BlockFormat("q8_0", 32, 34, 8),
    BlockFormat("q4_0", 32, 18, 2),
    BlockFormat("q4_k", 256, 144, 12),
    BlockFormat("q5_k", 256, 176, 13),
    BlockFormat("q6_k", 256, 210, 14),
    BlockFormat("mxfp4", 32, 17, 39),
)})
# hearth's own layouts, for checkpoints' formats that GGML has no type for (see the module docstring).
HEARTH_FORMATS = MappingProxyType({f.name: f for f in (
    BlockFormat("fp8_e4m3", 128, 132, -1),
    BlockFormat("bf16", 32, 64, -1),
)})


def block_format(name: str) -> BlockFormat:
    """The format named ``name``, GGML's (:data:`FORMATS`) or hearth's own (:data:`HEARTH_FORMATS`)."""
    fmt = FORMATS.get(name) or HEARTH_FORMATS.get(name)
    if fmt is None:
        raise KeyError(f"unknown block format '{name}'")
    return fmt

# E2M1 values: sign bit 3, then 1 exponent bit pair and 1 mantissa bit.
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(data: torch.Tensor, fmt: str | BlockFormat, cols: int) -> torch.Tensor:
    """``data`` uint8 [rows, row_bytes] of format ``fmt`` -> float32 [rows, cols]."""
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    rows = data.shape[0]
    if data.dtype != torch.uint8 or data.shape[-1] != fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name}: expected uint8 rows of {fmt.row_bytes(cols)} bytes for {cols} "
                         f"elements, got {tuple(data.shape)} {data.dtype}")
    blocks = data.reshape(-1, fmt.block_bytes)  # [rows * cols / block_elems, block_bytes]
    out = _DECODERS[fmt.name](blocks)  # [n_blocks, block_elems]
    return out.reshape(rows, cols)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(b[:, 2:])
    return _f16(b, 0) * (torch.cat([low, high], 1) - 8).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a K-quant super-block, from its 12 bytes [n, 12]."""
    p = packed.to(torch.int32)
    sc_lo, m_lo = p[:, 0:4] & 63, p[:, 4:8] & 63  # sub-blocks 0-3
    sc_hi = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)  # sub-blocks 4-7
    m_hi = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()  # [n, 8] each


def _k_apply(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d·sc·q − dmin·m for q [n, 8, 32] of a Q4_K / Q5_K super-block."""
    sc, m = _k_scales(b[:, 4:16])
    x = (_f16(b, 0) * sc)[:, :, None] * q.float() - (_f16(b, 2) * m)[:, :, None]
    return x.reshape(b.shape[0], 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(b[:, 16:144].reshape(-1, 4, 32))  # 4 chunks of 64 elements
    return _k_apply(b, torch.stack([low, high], 2).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].to(torch.int32)  # [n, 32]
    low, high = _nibbles(b[:, 48:176].reshape(-1, 4, 32))
    shifts = torch.arange(8, dtype=torch.int32).reshape(4, 2)  # chunk j: bits 2j (low), 2j + 1 (high)
    bits = (qh[:, None, None, :] >> shifts[None, :, :, None]) & 1  # [n, 4, 2, 32]
    q = torch.stack([low, high], 2) | (bits << 4)
    return _k_apply(b, q.reshape(-1, 8, 32))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].to(torch.int32).reshape(n, 2, 64)  # two halves of 128 elements
    qh = b[:, 128:192].to(torch.int32).reshape(n, 2, 32)
    scales = b[:, 192:208].view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b, 208)
    low = torch.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)  # [n, 2, 4, 32]
    q = ((low | (high << 4)) - 32).float()  # [n, half, quarter, 32]: element 128·half + 32·quarter + l
    sc = scales.reshape(n, 2, 4, 2).repeat_interleave(16, 3)  # one scale per 16 elements
    return (d[:, :, None, None] * sc * q).reshape(n, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # E8M0 as the reference computes it: half the scale times doubled E2M1 values (so that the
    # largest exponent, 2^128, stays finite where the value allows).
    half = torch.exp2(b[:, :1].float() - 128)
    low, high = _nibbles(b[:, 1:])
    doubled = 2 * torch.tensor(_FP4_VALUES, dtype=torch.float32)
    return half * doubled[torch.cat([low, high], 1)]


def _fp8_e4m3(b: torch.Tensor) -> torch.Tensor:
    scale = b[:, :4].contiguous().view(torch.float32)  # [n, 1]
    return scale * b[:, 4:].contiguous().view(torch.float8_e4m3fn).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


_DECODERS = MappingProxyType({"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
                              "mxfp4": _mxfp4, "fp8_e4m3": _fp8_e4m3, "bf16": _bf16})
