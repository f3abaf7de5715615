"""The expert pool: every expert's weights, addressed by global expert id ``g = layer * E + expert``.

Model files never touch expert weights: an MoE block routes tokens and hands the (token, expert,
weight) triples to an expert backend (``contract.ExpertBackend``), which reads them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hearth.engine import hugepages
from hearth.engine.config import ModelConfig
from hearth.engine.quant.block import BlockFormat


@dataclass(frozen=True)
class ExpertBlocks:
    """How one MoE layer's experts are stored in blocks: gate and up rows (2I of H elements) share
    one format, the down rows (H of I elements) have their own (a Q4_K_M file keeps some layers'
    down projections in Q6_K)."""

    gate_up: BlockFormat
    down: BlockFormat
    hidden: int
    inter: int
    int8_activations: bool = False  # the opt-in int8-activation mode (see engine/kernels/cpu/int8_mode.py)
    bias: bool = False  # experts with biases (GPT-OSS): fp32 after each row's blocks, 2I of them, H of them

    @property
    def gate_up_bytes(self) -> int:
        """Bytes of an expert's gate and up blocks (its bias, if any, follows them)."""
        return 2 * self.inter * self.gate_up.row_bytes(self.hidden)

    @property
    def down_bytes(self) -> int:
        """Bytes of an expert's down blocks (its bias, if any, follows them)."""
        return self.hidden * self.down.row_bytes(self.inter)

    @property
    def gate_up_row_bytes(self) -> int:
        return self.gate_up_bytes + (8 * self.inter if self.bias else 0)

    @property
    def down_row_bytes(self) -> int:
        return self.down_bytes + (4 * self.hidden if self.bias else 0)


class ExpertPool:
    """Every expert's weights, stored contiguously and addressed by global id.

    ``gate_up[row]`` is [2I, H] (gate rows first, then up rows, the transformers fused layout) and
    ``down[row]`` is [H, I]; ``row_table[g]`` maps a global id to its row (dense layers own no rows).
    Experts with biases (``expert_bias``: GPT-OSS) keep them as one more column: [2I, H + 1] and
    [H, I + 1], so that every copy of a row (fills, streaming, shared memory, files) carries them.

    With ``blocks`` (each MoE layer's :class:`ExpertBlocks`) the banks hold every expert in its
    quantized blocks, one expert per row: uint8 [rows, bytes], the expert's 2I gate and up rows (or H
    down rows) first, in its layer's format. A row is as wide as the widest layer's expert; a
    narrower expert leaves the tail of its row unused (pages never written are never resident).
    """

    def __init__(self, cfg: ModelConfig, storage: tuple[torch.Tensor, torch.Tensor] | None = None,
                 blocks: Mapping[int, ExpertBlocks] | None = None) -> None:
        """``storage``: existing (gate_up, down) tensors to use, e.g. views of a shared-memory
        segment (see :mod:`hearth.engine.experts.mechanism.host_pool`); by default fresh host memory."""
        self.num_experts = cfg.num_experts
        self.hidden, self.dtype = cfg.hidden_size, cfg.dtype  # the activations' width and dtype
        self.moe_layer_ids = cfg.moe_layer_ids
        self.num_global_ids = cfg.num_layers * cfg.num_experts
        self.blocks = dict(blocks) if blocks else None
        if self.blocks is not None and set(self.blocks) != set(cfg.moe_layer_ids):
            raise ValueError("block formats must be given for every MoE layer")
        shapes = self.bank_shapes(cfg, self.blocks)
        if storage is None:
            dtype = torch.uint8 if self.blocks is not None else cfg.dtype
            storage = (hugepages.empty(*shapes[0], dtype=dtype), hugepages.empty(*shapes[1], dtype=dtype))
        self.gate_up, self.down = storage
        if tuple(self.gate_up.shape) != shapes[0] or tuple(self.down.shape) != shapes[1]:
            raise ValueError(f"expert storage has shapes {list(self.gate_up.shape)}, {list(self.down.shape)}; "
                             f"expected {list(shapes[0])}, {list(shapes[1])}")
        self._layer_base = {layer: rank * cfg.num_experts for rank, layer in enumerate(self.moe_layer_ids)}
        # row_table[g] = pool row of global id g (-1 for the ids of dense layers).
        self.row_table = torch.full((cfg.num_layers * cfg.num_experts,), -1, dtype=torch.long)
        for layer, base in self._layer_base.items():
            start = layer * cfg.num_experts
            self.row_table[start : start + cfg.num_experts] = torch.arange(base, base + cfg.num_experts)

    @staticmethod
    def bank_shapes(cfg: ModelConfig, blocks: Mapping[int, ExpertBlocks] | None = None
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the two expert banks: gate_up [rows, 2I, H] and down [rows, H, I], or with
        ``blocks`` [rows, bytes of the widest expert] each."""
        n = len(cfg.moe_layer_ids) * cfg.num_experts
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        if blocks:
            if any((b.hidden, b.inter) != (h, i) for b in blocks.values()):
                raise ValueError("expert blocks of another expert shape than the model's")
            return ((n, max(b.gate_up_row_bytes for b in blocks.values())),
                    (n, max(b.down_row_bytes for b in blocks.values())))
        bias = int(cfg.expert_bias)  # a bias column after each row's weights
        return (n, 2 * i, h + bias), (n, h, i + bias)

    def layer_blocks(self, layer: int) -> ExpertBlocks | None:
        """The block formats of ``layer``'s experts (None for float banks)."""
        return self.blocks[layer] if self.blocks is not None else None

    def blocks_of_ids(self, expert_ids: torch.Tensor) -> ExpertBlocks | None:
        """The block formats of the layer that global ids ``expert_ids`` (one layer's) belong to."""
        if self.blocks is None:
            return None
        return self.blocks[int(expert_ids.reshape(-1)[0]) // self.num_experts]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (its gate, up and down projections)."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    def layer_rows(self, layer: int) -> int:
        """Row of expert 0 of ``layer``."""
        return self._layer_base[layer]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes
