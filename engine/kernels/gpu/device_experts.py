"""The device share of a captured decode step: the routed (token, expert) pairs served from cache slots,
computed by two Triton kernels with fixed grids, so that no host read or data-dependent launch
happens (the eager path groups pairs by expert on the host).

Pairs are the step's T x k routing; ``pair_slot`` -1 marks a pair served elsewhere (the CPU share),
whose part is zero. The arithmetic rounds where :func:`~hearth.engine.experts.compute.routed_partial_sum`
rounds in the model's dtype (the gate and up projections, SiLU, their product, the down projection,
the routing weight), accumulates in fp32, and sums each token's k parts in order, so its results
equal the eager ones up to fp32 summation order. On a machine without a GPU the kernels run under
Triton's interpreter, which is how CI checks them.
"""

from __future__ import annotations

import functools

import torch

BLOCK_ROWS = (32, 16, 8)  # output rows a program computes: the largest that makes enough programs
BLOCK_K = 128  # reduction chunk
# Programs a launch should have: about two per SM of a 132-SM GPU. A batch-1 step's down projection
# (hidden 2048) in 32-row blocks is 64 programs, which leaves half such a GPU idle while it streams
# the experts' weights.
MIN_PROGRAMS = 256


def build_expert_kernels():
    """(up, down) jitted now, so that the interpreter setting in force then applies (these kernels
    call Triton's own jitted helpers, so the interpreter must be on before Triton is imported)."""
    return _build_up_kernel(), _build_down_kernel()


def _build_up_kernel():
    # deferred: triton is optional
    import triton
    import triton.language as tl

    @triton.jit
    def up_kernel(x, gate_up, pair_slot, h, top_k, hidden, inter, BLOCK_ROWS: tl.constexpr,  # noqa: N803
                  BLOCK_K: tl.constexpr):
        """h[p, i] = round(round(silu(round(x . G[i]))) * round(x . U[i])) for pair p, rows i of a block."""
        p = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        inside = rows < inter
        slot = tl.load(pair_slot + p)
        token = p // top_k
        dtype = h.dtype.element_ty
        gate = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        up = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        if slot >= 0:
            base = gate_up + slot.to(tl.int64) * (2 * inter * hidden)
            for start in range(0, hidden, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                cols_in = cols < hidden
                xv = tl.load(x + token * hidden + cols, mask=cols_in, other=0.0).to(tl.float32)
                both = inside[:, None] & cols_in[None, :]
                g = tl.load(base + rows[:, None] * hidden + cols[None, :], mask=both, other=0.0).to(tl.float32)
                u = tl.load(base + (rows[:, None] + inter) * hidden + cols[None, :], mask=both, other=0.0)
                gate += tl.sum(g * xv[None, :], axis=1)
                up += tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h + p * inter + rows, (act * up).to(dtype), mask=inside)

    return up_kernel


def _build_down_kernel():
    # deferred: triton is optional
    import triton
    import triton.language as tl

    @triton.jit
    def down_kernel(h, down, pair_slot, weights, out, top_k, hidden, inter, BLOCK_ROWS: tl.constexpr,  # noqa: N803
                    BLOCK_K: tl.constexpr):
        """out[t, r] = sum over the token's pairs j (in order) of round(round(D[r] . h[j]) * w[j])."""
        t = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        inside = rows < hidden
        dtype = h.dtype.element_ty
        total = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        for j in range(0, top_k):
            p = t * top_k + j
            slot = tl.load(pair_slot + p)
            if slot >= 0:
                base = down + slot.to(tl.int64) * (hidden * inter)
                acc = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
                for start in range(0, inter, BLOCK_K):
                    cols = start + tl.arange(0, BLOCK_K)
                    cols_in = cols < inter
                    hv = tl.load(h + p * inter + cols, mask=cols_in, other=0.0).to(tl.float32)
                    d = tl.load(base + rows[:, None] * inter + cols[None, :], mask=inside[:, None] & cols_in[None, :],
                                other=0.0)
                    acc += tl.sum(d.to(tl.float32) * hv[None, :], axis=1)
                w = tl.load(weights + p).to(tl.float32)
                part = (acc.to(dtype).to(tl.float32) * w).to(weights.dtype.element_ty).to(tl.float32)
                total += part
        tl.store(out + t * hidden + rows, total, mask=inside)

    return down_kernel


@functools.cache
def expert_kernels():
    return build_expert_kernels()


def slot_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, pair_slot: torch.Tensor,
                 weights: torch.Tensor, kernels=None, min_programs: int = MIN_PROGRAMS) -> torch.Tensor:
    """fp32 [T, H] sum of the pairs served from slots: ``x`` [T, H], float banks gate_up [S, 2I, H]
    and down [S, H, I] (contiguous), ``pair_slot`` and ``weights`` [T, k] (-1: elsewhere). Each
    launch's rows are split into blocks small enough for ``min_programs`` programs where they can be."""
    up, dn = kernels or expert_kernels()
    t, k = pair_slot.shape
    hidden, inter = x.shape[1], down.shape[2]
    x = x.contiguous()
    slots = pair_slot.contiguous().reshape(-1)
    h = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    rows = block_rows(t * k, inter, min_programs)
    up[(t * k, -(-inter // rows))](x, gate_up, slots, h, k, hidden, inter, BLOCK_ROWS=rows, BLOCK_K=BLOCK_K)
    out = torch.empty((t, hidden), dtype=torch.float32, device=x.device)
    rows = block_rows(t, hidden, min_programs)
    dn[(t, -(-hidden // rows))](h, down, slots, weights.contiguous().reshape(-1), out, k, hidden, inter,
                                BLOCK_ROWS=rows, BLOCK_K=BLOCK_K)
    return out


def block_rows(units: int, rows: int, min_programs: int = MIN_PROGRAMS) -> int:
    """Output rows per program for a launch of ``units`` (pairs, tokens) x blocks of ``rows``: the
    largest block that still gives ``min_programs`` programs, else the smallest (small batches).
    Each weight row is read by one program either way; only the small activations are read by more."""
    for block in BLOCK_ROWS:
        if units * -(-rows // block) >= min_programs:
            return block
    return BLOCK_ROWS[-1]
