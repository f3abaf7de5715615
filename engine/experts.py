"""Expert weights and expert computation, addressed by global expert id ``g = layer * E + expert``.

Model files never touch expert weights directly: an MoE block routes tokens and hands the
(token, expert, weight) triples to an :class:`ExpertBackend`. The plain backend here computes
straight from the host pool; the expert memory hierarchy (device cache, q* split, CPU workers)
is another backend behind the same interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.config import ModelConfig
from engine.kernels import cpu_decode_ops
from engine.layers.linear import SMALL_BATCH, linear
from engine.layers.mlp import activation


class ExpertPool:
    """Every expert's weights, stored contiguously and addressed by global id.

    ``gate_up[row]`` is [2I, H] (gate rows first, then up rows, the transformers fused layout) and
    ``down[row]`` is [H, I]; ``row_table[g]`` maps a global id to its row (dense layers own no rows).
    """

    def __init__(self, cfg: ModelConfig, storage: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``storage``: existing (gate_up, down) tensors to use, e.g. views of a shared-memory
        segment (see :mod:`engine.hierarchy.host_pool`); by default fresh host memory."""
        self.num_experts = cfg.num_experts
        self.moe_layer_ids = cfg.moe_layer_ids
        self.num_global_ids = cfg.num_layers * cfg.num_experts
        shapes = self.bank_shapes(cfg)
        if storage is None:
            storage = (torch.empty(shapes[0], dtype=cfg.dtype), torch.empty(shapes[1], dtype=cfg.dtype))
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
    def bank_shapes(cfg: ModelConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of the two expert banks: gate_up [rows, 2I, H] and down [rows, H, I]."""
        n = len(cfg.moe_layer_ids) * cfg.num_experts
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
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


class ExpertBackend(Protocol):
    """Computes the weighted sum of routed experts for a batch of tokens."""

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        expert_ids: torch.Tensor,  # [T, k] global ids g = layer * E + expert
        topk_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        ...


def group_by_row(rows: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(pool_row, token_indices, k_positions)] for a [T, k] table of pool rows, in ascending row
    order: one matmul per routed expert."""
    k = rows.shape[1]
    flat = rows.reshape(-1)
    order = torch.argsort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    groups, start = [], 0
    for row, count in zip(uniq.tolist(), counts.tolist(), strict=True):
        sel = order[start : start + count]
        groups.append((row, sel // k, sel % k))
        start += count
    return groups


def routed_partial_sum(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [rows, 2I, H]
    down: torch.Tensor,  # [rows, H, I]
    rows: torch.Tensor,  # [T, k] rows of gate_up/down; -1 = served elsewhere
    weights: torch.Tensor,  # [T, k]
    act,
) -> torch.Tensor:  # [T, H] fp32, unrounded
    """Weighted sum of the routed experts whose row is >= 0, kept in fp32 so that partial sums of
    different paths (device slots, CPU workers) add up to what one path computes, up to fp32
    rounding order."""
    t, k = rows.shape
    ops = cpu_decode_ops() if act is torch.nn.functional.silu and gate_up.device.type == "cpu" else None
    if ops is not None and t <= SMALL_BATCH:
        # A few tokens (decode steps): each token's experts through the native kernel, exactly as
        # when the token is alone; reading t*k experts beats upcasting the shared ones for a GEMM.
        return torch.cat([_token_experts(ops, x[i : i + 1], gate_up, down, rows[i], weights[i]) for i in range(t)])
    parts = torch.zeros((t, k, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    for row, tokens, kpos in group_by_row(rows):
        if row < 0:
            continue
        gate, up = linear(x[tokens], gate_up[row]).chunk(2, dim=-1)
        parts[tokens, kpos] = linear(act(gate) * up, down[row]) * weights[tokens, kpos, None]
    return parts.sum(dim=1, dtype=torch.float32)


def _token_experts(ops, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:  # [1, H] fp32
    row_list = rows.tolist()
    keep = [j for j, r in enumerate(row_list) if r >= 0]
    if not keep:
        return torch.zeros((1, x.shape[1]), dtype=torch.float32)
    w = weights if len(keep) == len(row_list) else weights[keep]
    return ops.experts_decode(x, gate_up, down, [row_list[j] for j in keep], w, fp32_out=True)


class LocalExpertBackend:
    """Runs every routed expert on the pool's own device (the CPU path and the plain engine)."""

    def __init__(self, pool: ExpertPool, hidden_act: str) -> None:
        self.pool = pool
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # Each (token, slot) product is kept apart and the k of them are summed with fp32
        # accumulation and rounded once, as the reference does; low-precision results match it.
        rows = self.pool.row_table[expert_ids]  # [T, k] pool rows
        return routed_partial_sum(x, self.pool.gate_up, self.pool.down, rows, topk_weights, self.act).to(x.dtype)
