"""What a block format declares (:class:`BlockFormat`), and the list type that registers formats
(:class:`Registry`).

A block-quantized weight row of ``cols`` elements is ``cols / block_elems`` blocks of ``block_bytes``
bytes each; a tensor of them is ``uint8 [rows, cols / block_elems * block_bytes]``. A format is one
module under ``quant/formats/`` that builds one :class:`BlockFormat`; ``quant/registry.py`` lists
them, and every table the engine keeps per format (the native kernels' codes, the int8-activation
set, GGUF types, the mixes ``hearth convert`` writes) is derived from that list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

# blocks uint8 [n, block_bytes] -> float32 [n, block_elems], and back (float32 in, uint8 out).
Decode = Callable[[torch.Tensor], torch.Tensor]
Encode = Callable[[torch.Tensor], torch.Tensor]
# A mix's roles (``hearth convert --quant q4_k_m``): its base format, and the format of the tensors
# that get more bits (see ``checkpoint/gguf_writer.py: tensor_format``).
MIX_ROLES = ("base", "more")


@dataclass(frozen=True)
class KernelEntry:
    """Where the native CPU kernels take a format: its code (``kCode``, the ``by_format`` switch) and
    the struct that unpacks its blocks, both in ``kernels/cpu/blocks.h``."""

    code: int
    struct: str


@dataclass(frozen=True)
class BlockFormat:
    """One block-quantized format: elements and bytes per block, its GGML type id (-1 for hearth's own
    layouts, which GGUF files do not hold), its torch decoder (the reference and the fallback kernel)
    and encoder (None: hearth never writes it), the native kernels' entry (None: torch only), whether
    the opt-in int8-activation mode has a kernel for it, and the mixes it takes part in, as
    (mix, role) pairs with a role of :data:`MIX_ROLES`."""

    name: str
    block_elems: int
    block_bytes: int
    ggml_type: int
    decode: Decode = field(kw_only=True, compare=False, repr=False)
    encode: Encode | None = field(default=None, kw_only=True, compare=False, repr=False)
    kernel: KernelEntry | None = field(default=None, kw_only=True)
    int8_activations: bool = field(default=False, kw_only=True)
    mixes: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` elements (a multiple of the block)."""
        if cols % self.block_elems:
            raise ValueError(f"{self.name}: a row of {cols} elements is not a whole number of "
                             f"{self.block_elems}-element blocks")
        return cols // self.block_elems * self.block_bytes

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems


class Registry:
    """An ordered, immutable list of block formats and the per-format tables derived from it. Names,
    kernel codes and GGML types are unique; every mix has one format of each role."""

    __slots__ = ("_by_name", "formats")

    def __init__(self, formats: Iterable[BlockFormat]) -> None:
        self.formats = tuple(formats)
        self._by_name = MappingProxyType({f.name: f for f in self.formats})
        for what, keys in (("name", [f.name for f in self.formats]),
                           ("kernel code", [f.kernel.code for f in self.formats if f.kernel is not None]),
                           ("GGML type", [f.ggml_type for f in self.formats if f.ggml_type >= 0])):
            if len(set(keys)) != len(keys):
                raise ValueError(f"block formats: a {what} is declared twice in {keys}")
        self.mixes()  # refuses a mix without its two roles

    def __iter__(self) -> Iterator[BlockFormat]:
        return iter(self.formats)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def adding(self, fmt: BlockFormat) -> Registry:
        """This list with ``fmt`` appended (a new registry; this one is unchanged)."""
        return Registry((*self.formats, fmt))

    def get(self, name: str) -> BlockFormat:
        """The format named ``name``; KeyError when none is registered."""
        fmt = self._by_name.get(name)
        if fmt is None:
            raise KeyError(f"unknown block format '{name}'")
        return fmt

    def ggml(self) -> Mapping[str, BlockFormat]:
        """GGML's formats (those with a GGML type), by name."""
        return MappingProxyType({f.name: f for f in self.formats if f.ggml_type >= 0})

    def own(self) -> Mapping[str, BlockFormat]:
        """hearth's own layouts (no GGML type), by name."""
        return MappingProxyType({f.name: f for f in self.formats if f.ggml_type < 0})

    def by_ggml_type(self) -> Mapping[int, BlockFormat]:
        return MappingProxyType({f.ggml_type: f for f in self.formats if f.ggml_type >= 0})

    def kernel_codes(self) -> Mapping[str, int]:
        """The native kernels' code of each format they compute in its blocks, by name."""
        return MappingProxyType({f.name: f.kernel.code for f in self.formats if f.kernel is not None})

    def int8_formats(self) -> frozenset[str]:
        """The formats with an int8-activation kernel."""
        return frozenset(f.name for f in self.formats if f.int8_activations)

    def mixes(self) -> Mapping[str, tuple[str, str]]:
        """Each mix's (base format, format of the tensors that get more bits), mixes by name."""
        roles: dict[str, dict[str, str]] = {}
        for f in self.formats:
            for mix, role in f.mixes:
                if role not in MIX_ROLES or role in roles.setdefault(mix, {}):
                    raise ValueError(f"block format {f.name}: mix {mix} role '{role}' is unknown or taken")
                roles[mix][role] = f.name
        incomplete = sorted(mix for mix, taken in roles.items() if len(taken) != len(MIX_ROLES))
        if incomplete:
            raise ValueError(f"block formats: mixes {incomplete} lack a base or a 'more' format")
        return MappingProxyType({mix: (roles[mix]["base"], roles[mix]["more"]) for mix in sorted(roles)})
