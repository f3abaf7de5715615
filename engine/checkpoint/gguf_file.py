"""GGUF files (llama.cpp's and Ollama's format), read with the ``gguf`` package, checked up front.

:class:`GGUFFile` opens one file, refuses what hearth cannot run with a one-line error naming
the file and the problem (an architecture it does not serve, a tensor type it has no kernel for,
a row that is not whole blocks, a file cut short), and gives each tensor as its raw bytes in
torch layout: a block-quantized ``[rows…, cols]`` weight is ``uint8 [rows…, row_bytes]`` (see
:mod:`hearth.engine.quant.formats`), a float one its values. Nothing is read until asked for:
the tensors are views of a memory map.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import FORMATS, REGISTRY, dequantize

# GGUF architecture -> the Hugging Face architecture hearth builds for it.
# GGUF architecture -> the transformers class hearth serves it as ("llama" with experts is Mixtral).
ARCHITECTURES = MappingProxyType({"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                                  "llama": "MixtralForCausalLM"})
_FLOAT_TYPES = MappingProxyType({0: torch.float32, 1: torch.float16, 30: torch.bfloat16})  # GGML type ids
_BLOCK_TYPES = REGISTRY.by_ggml_type()


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
            return _readonly(values.view(np.uint8)).reshape(*self.shape[:-1], self.format.row_bytes(self.shape[-1]))
        if self.format == torch.bfloat16:  # numpy has no bfloat16: the bytes are read as int16
            return _readonly(values.view(np.int16)).view(torch.bfloat16).reshape(self.shape)
        return _readonly(values).reshape(self.shape)

    def dequantized(self) -> torch.Tensor:
        """float32 values ``[rows…, cols]`` (block formats decoded, see ``registry.dequantize``)."""
        if not self.quantized:
            return self.raw().float()
        rows = self.raw().reshape(-1, self.format.row_bytes(self.shape[-1]))
        return dequantize(rows, self.format, self.shape[-1]).reshape(self.shape)


def _readonly(values: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only memory map (torch warns that it cannot write it; nothing does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


class GGUFFile:
    """An opened, checked GGUF file."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, OSError) as exc:  # the reader maps past the end of a cut file
            raise GGUFError(f"{self.path}: not a complete GGUF file (truncated or corrupt: {exc})") from None
        self._fields = reader.fields
        self.architecture = str(self.metadata("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise GGUFError(f"{self.path}: GGUF architecture '{self.architecture}' is not supported "
                            f"(supported: {known})")
        if self.architecture == "llama" and not self.metadata("llama.expert_count"):
            raise GGUFError(f"{self.path}: a dense llama model (no llama.expert_count); hearth serves "
                            "mixture-of-experts models (llama with experts: Mixtral)")
        size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the innermost dimension first
            fmt = self._format(t.name, int(t.tensor_type), t.tensor_type.name, shape[-1])
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise GGUFError(f"{self.path}: truncated: tensor '{t.name}' ends past the end of the file")
            self.tensors[t.name] = GGUFTensor(t.name, shape, fmt, t.data)

    def _format(self, name: str, type_id: int, type_name: str, cols: int) -> BlockFormat | torch.dtype:
        if type_id in _FLOAT_TYPES:
            return _FLOAT_TYPES[type_id]
        fmt = _BLOCK_TYPES.get(type_id)
        if fmt is None:
            supported = ", ".join(["F32", "F16", "BF16", *(f.name.upper() for f in FORMATS.values())])
            raise GGUFError(f"{self.path}: tensor '{name}' has type {type_name}, which hearth has no kernel for "
                            f"(supported: {supported})")
        if cols % fmt.block_elems:
            raise GGUFError(f"{self.path}: tensor '{name}': rows of {cols} elements are not whole "
                            f"{fmt.block_elems}-element {type_name} blocks")
        return fmt

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings decoded, arrays as lists), or ``default``."""
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents()

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def formats(self) -> dict[str, int]:
        """Bytes stored per format name (``q4_k``, ``float32``, …)."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            key = t.format.name if t.quantized else str(t.format).removeprefix("torch.")
            out[key] = out.get(key, 0) + t.nbytes
        return out
