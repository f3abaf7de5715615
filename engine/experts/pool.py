"""The expert pool: every expert's weights, addressed by global expert id ``g = layer * E + expert``.

Model files never touch expert weights: an MoE block routes tokens and hands the (token, expert,
weight) triples to an expert backend (``contract.ExpertBackend``), which reads them from here.
"""

from __future__ import annotations

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.quant.formats import BlockFormat


class ExpertPool:
    """Every expert's weights, stored contiguously and addressed by global id.

    ``gate_up[row]`` is [2I, H] (gate rows first, then up rows, the transformers fused layout) and
    ``down[row]`` is [H, I]; ``row_table[g]`` maps a global id to its row (dense layers own no rows).
    With a block format ``fmt`` the banks hold each row in its quantized blocks: uint8 [rows, 2I,
    fmt.row_bytes(H)] and [rows, H, fmt.row_bytes(I)] (see :mod:`hearth.engine.quant.formats`).
    """

    def __init__(self, cfg: ModelConfig, storage: tuple[torch.Tensor, torch.Tensor] | None = None,
                 fmt: BlockFormat | None = None) -> None:
        """``storage``: existing (gate_up, down) tensors to use, e.g. views of a shared-memory
        segment (see :mod:`hearth.engine.experts.mechanism.host_pool`); by default fresh host memory."""
        self.num_experts = cfg.num_experts
        self.moe_layer_ids = cfg.moe_layer_ids
        self.num_global_ids = cfg.num_layers * cfg.num_experts
        self.fmt = fmt
        shapes = self.bank_shapes(cfg, fmt)
        if storage is None:
            dtype = torch.uint8 if fmt is not None else cfg.dtype
            storage = (torch.empty(shapes[0], dtype=dtype), torch.empty(shapes[1], dtype=dtype))
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
    def bank_shapes(cfg: ModelConfig, fmt: BlockFormat | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the two expert banks: gate_up [rows, 2I, H] and down [rows, H, I] (the last
        dimension in bytes of blocks with a block format)."""
        n = len(cfg.moe_layer_ids) * cfg.num_experts
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        if fmt is not None:
            return (n, 2 * i, fmt.row_bytes(h)), (n, h, fmt.row_bytes(i))
        return (n, 2 * i, h), (n, h, i)

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
