"""Expert computation from weight banks: the fp32 partial sum of routed (token, expert) pairs, and the
plain backend that runs every routed expert straight from the pool (no device cache).

Both the device slots and the CPU workers compute their share with :func:`routed_partial_sum`, so
the parts add up to what one path computes, up to fp32 summation order.
"""

from __future__ import annotations

import os

import torch

from hearth.engine.experts.contract import StepContext
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool
from hearth.engine.kernels.cpu import BLOCK_KERNELS, cpu_decode_ops
from hearth.engine.ops import SMALL_BATCH, activation, activation_name, decode_blocks, gated, linear


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
    blocks: ExpertBlocks | None = None,  # the layer's block formats (uint8 banks), None for float banks
) -> torch.Tensor:  # [T, H] fp32, unrounded
    """Weighted sum of the routed experts whose row is >= 0, kept in fp32 so that partial sums of
    different paths (device slots, CPU workers) add up to what one path computes, up to fp32
    rounding order."""
    if blocks is not None:
        return _block_partial_sum(x, gate_up, down, rows, weights, act, blocks)
    t, k = rows.shape
    h = x.shape[1]
    biased = gate_up.shape[-1] == h + 1  # experts with biases (GPT-OSS), in each bank row's last column
    native = act is torch.nn.functional.silu and gate_up.device.type == "cpu" and not biased
    ops = cpu_decode_ops() if native else None
    if ops is not None and t <= SMALL_BATCH:
        # A few tokens (decode steps): each token's experts through the native kernel, exactly as
        # when the token is alone; reading t*k experts beats upcasting the shared ones for a GEMM.
        return torch.cat([_token_experts(ops, x[i : i + 1], gate_up, down, rows[i], weights[i]) for i in range(t)])
    parts = torch.zeros((t, k, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    for row, tokens, kpos in group_by_row(rows):
        if row < 0:
            continue
        if biased:  # the bias added after the product, as transformers does
            w_gu, w_dn = gate_up[row], down[row]
            gate, up = (x[tokens] @ w_gu[:, :h].T + w_gu[:, h]).chunk(2, dim=-1)
            out = gated(act, gate, up) @ w_dn[:, :-1].T + w_dn[:, -1]
        else:
            gate, up = linear(x[tokens], gate_up[row]).chunk(2, dim=-1)
            out = linear(gated(act, gate, up), down[row])
        parts[tokens, kpos] = out * weights[tokens, kpos, None]
    return parts.sum(dim=1, dtype=torch.float32)


def routed_experts_node(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                        weights: torch.Tensor, act, blocks: ExpertBlocks | None = None) -> torch.Tensor:
    """:func:`routed_partial_sum` as one custom-op node (``torch.ops.hearth.routed_experts``, registered
    by ``engine/executor/graph_ops.py``), for fixed-shape steps that compile whole."""
    gate_up_fmt, down_fmt, inter, int8 = ("", "", 0, False) if blocks is None else \
        (blocks.gate_up.name, blocks.down.name, blocks.inter, blocks.int8_activations)
    return torch.ops.hearth.routed_experts(x, gate_up, down, rows, weights, activation_name(act), gate_up_fmt,
                                           down_fmt, inter, int8)


def _block_partial_sum(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                       weights: torch.Tensor, act, blocks: ExpertBlocks) -> torch.Tensor:  # [T, H] fp32
    """routed_partial_sum over block-quantized banks (uint8 [rows, bytes], one expert a row): a few
    tokens through the native kernel, which reads each routed expert in its blocks once for all of
    them; otherwise (many tokens, no kernel) each routed expert decoded once and multiplied in fp32."""
    t, hidden, inter = x.shape[0], blocks.hidden, blocks.inter
    on_cpu = act is torch.nn.functional.silu and x.dtype == torch.float32 and gate_up.device.type == "cpu"
    ops = cpu_decode_ops() if on_cpu and not blocks.bias else None  # (the native kernel adds no biases)
    few = t <= SMALL_BATCH or blocks.int8_activations  # (the int8 mode at any token count: see ops._block_linear)
    if ops is not None and few and {blocks.gate_up.name, blocks.down.name} <= BLOCK_KERNELS:
        return ops.experts_blocks(x, gate_up, down, rows, weights, blocks.gate_up.name, blocks.down.name, inter,
                                  blocks.int8_activations)
    # Many tokens: each expert's rows decoded a few at a time where the products read them, experts
    # shared out whole between the threads (1.5-2.3x decoding each expert for a BLAS product at a ~5B
    # layer's shapes on a 2-core Zen 3; HEARTH_EXPERTS_GEMM=0 keeps the BLAS path).
    if ops is not None and {blocks.gate_up.name, blocks.down.name} <= BLOCK_KERNELS \
            and os.environ.get("HEARTH_EXPERTS_GEMM", "1") != "0":
        return ops.experts_gemm(x, gate_up, down, rows, weights, blocks.gate_up.name, blocks.down.name, inter)
    gu_bytes, dn_bytes = blocks.gate_up_bytes, blocks.down_bytes
    parts = torch.zeros((t, rows.shape[1], hidden), dtype=torch.float32, device=x.device)
    xf = x.float()
    for row, tokens, kpos in group_by_row(rows):
        if row < 0:
            continue
        w_gu = decode_blocks(gate_up[row, :gu_bytes].view(2 * inter, -1), blocks.gate_up, hidden)
        w_dn = decode_blocks(down[row, :dn_bytes].view(hidden, -1), blocks.down, inter)
        gu, dn = xf[tokens] @ w_gu.T, None
        if blocks.bias:  # fp32 biases after the blocks, added after the products
            gu = gu + gate_up[row, gu_bytes : gu_bytes + 8 * inter].view(torch.float32)
            dn = down[row, dn_bytes : dn_bytes + 4 * hidden].view(torch.float32)
        gate, up = gu.chunk(2, dim=-1)
        out = gated(act, gate, up) @ w_dn.T
        parts[tokens, kpos] = (out if dn is None else out + dn) * weights[tokens, kpos, None]
    return parts.sum(dim=1)


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

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor,
                step: StepContext | None = None) -> torch.Tensor:
        # Each (token, slot) product is kept apart and the k of them are summed with fp32
        # accumulation and rounded once, as the reference does; low-precision results match it.
        host = self.pool.row_table.device  # the pool's; the model may run elsewhere (the GPU executor)
        rows = self.pool.row_table[expert_ids.to(host)]  # [T, k] pool rows
        out = routed_partial_sum(x.to(host), self.pool.gate_up, self.pool.down, rows, topk_weights.to(host),
                                 self.act, self.pool.blocks_of_ids(expert_ids))
        return out.to(device=x.device, dtype=x.dtype)

    def forward_static(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor,
                       layer: int) -> torch.Tensor:
        host = self.pool.row_table.device
        rows = self.pool.row_table[expert_ids.to(host)]
        out = routed_experts_node(x.to(host), self.pool.gate_up, self.pool.down, rows, topk_weights.to(host),
                                  self.act, self.pool.layer_blocks(layer))
        return out.to(device=x.device, dtype=x.dtype)
