"""The block formats hearth knows: one list (:data:`REGISTRY`), and the calls that go through it.

A new format is a module under ``quant/formats/`` and one entry in the list below (plus its kernel in
``kernels/cpu/blocks.h``, where it has one). Everything the engine keeps per format is derived from
this list: :data:`FORMATS` and :data:`HEARTH_FORMATS` here, the GGUF types ``checkpoint/gguf_file.py``
reads, the mixes ``checkpoint/gguf_writer.py`` writes, the native kernels' codes
(``kernels/cpu: BLOCK_CODES``) and the int8-activation set (``kernels/cpu/int8_mode.py``).
:func:`block_format`, :func:`dequantize` and :func:`quantize` read the list when called.
"""

from __future__ import annotations

import torch

from hearth.engine.quant.block import BlockFormat, Registry
from hearth.engine.quant.formats import (
    bf16,
    fp8_e4m3,
    iq4_nl,
    iq4_xs,
    mxfp4,
    q2_k,
    q3_k,
    q4_0,
    q4_1,
    q4_k,
    q5_0,
    q5_1,
    q5_k,
    q6_k,
    q8_0,
)

REGISTRY = Registry((q8_0.FORMAT, q4_0.FORMAT, q4_k.FORMAT, q5_k.FORMAT, q6_k.FORMAT, mxfp4.FORMAT,
                     fp8_e4m3.FORMAT, bf16.FORMAT,
                     # read only, decoded at load: what llama.cpp's quantizer writes where a K format
                     # does not fit a row (Q5_0, Q5_1, IQ4_NL), the older Q4_1, and the low-bit experts
                     # of its Q2_K / Q3_K / IQ4_XS files and the Unsloth-style mixes
                     q4_1.FORMAT, q5_0.FORMAT, q5_1.FORMAT, iq4_nl.FORMAT, q2_k.FORMAT, q3_k.FORMAT,
                     iq4_xs.FORMAT))

# GGML's formats (the ones GGUF files hold), and hearth's own layouts, by name: fixed at import.
FORMATS = REGISTRY.ggml()
HEARTH_FORMATS = REGISTRY.own()


def block_format(name: str) -> BlockFormat:
    """The registered format named ``name`` (KeyError when there is none)."""
    return REGISTRY.get(name)


def dequantize(data: torch.Tensor, fmt: str | BlockFormat, cols: int) -> torch.Tensor:
    """``data`` uint8 [rows, row_bytes] of format ``fmt`` -> float32 [rows, cols]."""
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    rows = data.shape[0]
    if data.dtype != torch.uint8 or data.shape[-1] != fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name}: expected uint8 rows of {fmt.row_bytes(cols)} bytes for {cols} "
                         f"elements, got {tuple(data.shape)} {data.dtype}")
    blocks = data.reshape(-1, fmt.block_bytes)  # [rows * cols / block_elems, block_bytes]
    out = fmt.decode(blocks)  # [n_blocks, block_elems]
    return out.reshape(rows, cols)


def quantize(x: torch.Tensor, fmt: str | BlockFormat) -> torch.Tensor:
    """``x`` [rows, cols] (any float dtype) -> uint8 [rows, row_bytes] in format ``fmt`` (one with an
    encoder; KeyError for one without)."""
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.encode is None:
        raise KeyError(f"block format '{fmt.name}' has no encoder")
    rows, cols = x.shape
    fmt.row_bytes(cols)  # refuses a row that is not whole blocks
    blocks = x.float().reshape(-1, fmt.block_elems)
    return fmt.encode(blocks).reshape(rows, -1)
