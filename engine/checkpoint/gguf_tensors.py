"""One GGUF tensor in torch terms (shape, format, the file's bytes), and the blocks a tensor stays in
where a kernel computes its format."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hearth.engine.kernels.cpu import BLOCK_KERNELS
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import HEARTH_FORMATS, dequantize

BF16_BLOCKS = HEARTH_FORMATS["bf16"]  # a bf16 tensor kept as stored when computed in fp32


class GGUFError(ValueError):
    """A GGUF file hearth cannot load; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its torch shape (``[rows…, cols]``), format and stored data (a memory-map view)."""

    name: str
    shape: tuple[int, ...]
    format: BlockFormat | torch.dtype
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return isinstance(self.format, BlockFormat)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def raw(self) -> torch.Tensor:
        """The stored data as a tensor (uint8 blocks ``[rows…, row_bytes]``, or the float values):
        a read-only view of the file's memory map, to copy from."""
        values = np.ascontiguousarray(self.data)
        if self.quantized:
            return readonly(values.view(np.uint8)).reshape(*self.shape[:-1], self.format.row_bytes(self.shape[-1]))
        if self.format == torch.bfloat16:  # numpy has no bfloat16: the bytes are read as int16
            return readonly(values.view(np.int16)).view(torch.bfloat16).reshape(self.shape)
        return readonly(values).reshape(self.shape)

    def dequantized(self) -> torch.Tensor:
        """float32 values ``[rows…, cols]`` (block formats decoded, see ``formats.dequantize``)."""
        if not self.quantized:
            return self.raw().float()
        rows = self.raw().reshape(-1, self.format.row_bytes(self.shape[-1]))
        return dequantize(rows, self.format, self.shape[-1]).reshape(self.shape)


def readonly(values: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only memory map (torch warns that it cannot write it; nothing does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


def kernel_format(t) -> BlockFormat | None:
    """The blocks a tensor stays in, where a kernel computes them: its own format, or hearth's bf16
    blocks for a bf16 tensor (its bytes as stored; rows of whole 32-element blocks)."""
    fmt = t.format
    if fmt == torch.bfloat16 and t.shape[-1] % BF16_BLOCKS.block_elems == 0:
        fmt = BF16_BLOCKS
    return fmt if isinstance(fmt, BlockFormat) and fmt.name in BLOCK_KERNELS else None


def stored_rows(t, reorder=lambda x: x) -> torch.Tensor:
    """A tensor kept in blocks as uint8 rows of its stored bytes (bf16 values viewed as bytes)."""
    raw = reorder(t.raw())
    return raw.contiguous().view(torch.uint8) if raw.dtype == torch.bfloat16 else raw
