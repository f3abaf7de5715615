"""Random block-quantized rows for the format and kernel tests."""

from __future__ import annotations

import numpy as np
import torch

from hearth.engine.quant.registry import FORMATS, block_format, dequantize


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator, extremes: bool = True) -> np.ndarray:
    """Random bytes with sane scale fields (fp16 scales in a small range, E8M0 near 127; with
    ``extremes``, MXFP4's first two blocks take the smallest and largest exponents, 0 and 255, whose
    products may overflow)."""
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, size=(rows * cols // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    scale = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if name in ("q8_0", "q4_0"):
        blocks[:, 0:2] = scale[:, 0:2]
    elif name in ("q4_k", "q5_k"):
        blocks[:, 0:4] = np.abs(scale.view(np.float16)).view(np.uint8)  # d and dmin
    elif name == "q6_k":
        blocks[:, 208:210] = scale[:, 0:2]
    elif name == "q2_k":
        blocks[:, 80:84] = np.abs(scale.view(np.float16)).view(np.uint8)  # d and dmin
    elif name == "q3_k":
        blocks[:, 108:110] = scale[:, 0:2]
    elif name == "iq4_xs":
        blocks[:, 0:2] = scale[:, 0:2]
    else:  # mxfp4: exponents near 1, and the extremes
        blocks[:, 0] = rng.integers(117, 137, size=blocks.shape[0])
        if extremes:
            blocks[:2, 0] = (0, 255)
    return blocks.reshape(rows, -1)


def reference_experts(x, gu, dn, rows, weights, gu_fmt, dn_fmt, hidden, inter):
    """The routed experts of x [T, H] by the torch decoders: each expert's rows decoded from its bank
    row (gate and up rows first, in ``gu_fmt``; down rows in ``dn_fmt``), SiLU-gated, weighted, summed;
    rows < 0 are left out."""
    out = torch.zeros(x.shape[0], hidden)
    gu_bytes = 2 * inter * block_format(gu_fmt).row_bytes(hidden)
    dn_bytes = hidden * block_format(dn_fmt).row_bytes(inter)
    for t in range(x.shape[0]):
        for j, r in enumerate(rows[t].tolist()):
            if r < 0:
                continue
            g_u = dequantize(gu[r, :gu_bytes].reshape(2 * inter, -1), gu_fmt, hidden)
            d = dequantize(dn[r, :dn_bytes].reshape(hidden, -1), dn_fmt, inter)
            gate, up = (x[t] @ g_u.T).chunk(2)
            out[t] += (torch.nn.functional.silu(gate) * up) @ d.T * weights[t, j]
    return out


def expert_banks(gate_up_rows: torch.Tensor, down_rows: torch.Tensor,
                 experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bank tensors [experts, bytes] holding each expert's gate/up rows and down rows of blocks, wider
    than one expert (as a pool whose widest layer uses a larger format)."""
    gu_bytes, dn_bytes = gate_up_rows.numel() // experts, down_rows.numel() // experts
    gu = torch.zeros(experts, gu_bytes + 64, dtype=torch.uint8)
    dn = torch.zeros(experts, dn_bytes + 96, dtype=torch.uint8)
    gu[:, :gu_bytes] = gate_up_rows.reshape(experts, -1)
    dn[:, :dn_bytes] = down_rows.reshape(experts, -1)
    return gu, dn


def routed_tokens(hidden: int, experts: int, seed: int = 4):
    """(x [T, H], bank rows [T, 3], weights [T, 3]) for 1, 4 and 11 tokens, one pair computed elsewhere (-1)."""
    g = torch.Generator().manual_seed(seed)
    for t in (1, 4, 11):
        x = torch.randn(t, hidden, generator=g)
        rows = torch.randint(0, experts, (t, 3), generator=g)
        rows[0, 1] = -1  # computed elsewhere
        yield x, rows, torch.rand(t, 3, generator=g)
