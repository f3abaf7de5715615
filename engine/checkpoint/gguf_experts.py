"""A GGUF file's experts into the pool. llama.cpp stacks each MoE layer's experts per projection,
``blk.L.ffn_{gate,up,down}_exps.weight`` [E, out, in], and where the experts have biases (GPT-OSS)
``blk.L.ffn_{gate,up,down}_exps.bias`` [E, out]. In the pool an expert is one row of each bank:
gate then up rows in ``gate_up``, and a bias as one more column (float experts) or as fp32 after
the row's blocks (experts kept in their blocks; see :class:`~hearth.engine.experts.pool.ExpertBlocks`)."""

from __future__ import annotations

from pathlib import Path

import torch

from hearth.engine.checkpoint.gguf_tensors import GGUFError, kernel_format, stored_rows
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool

EXPERT_PARTS = ("gate", "up", "down")


def expert_tensors(cfg, layers) -> dict[str, tuple[int, str]]:
    """The expert tensors of ``layers``: name -> (layer, part), a part being gate, up or down, or
    ``gate_bias``, ``up_bias``, ``down_bias`` where the experts have biases."""
    names = {f"blk.{layer}.ffn_{part}_exps.weight": (layer, part) for layer in layers for part in EXPERT_PARTS}
    if cfg.expert_bias:
        names |= {f"blk.{layer}.ffn_{part}_exps.bias": (layer, f"{part}_bias") for layer in layers
                  for part in EXPERT_PARTS}
    return names


def expert_blocks(f, cfg) -> dict[int, ExpertBlocks] | None:
    """Each MoE layer's expert formats, when every layer's can stay in blocks (gate and up in one
    format, each with a kernel); otherwise None (the experts are decoded)."""
    blocks = {}
    for layer in cfg.moe_layer_ids:
        gate, up, down = (kernel_format(f.tensors[f"blk.{layer}.ffn_{p}_exps.weight"]) for p in EXPERT_PARTS)
        if gate is None or down is None or gate != up:
            return None
        blocks[layer] = ExpertBlocks(gate, down, cfg.hidden_size, cfg.moe_intermediate_size, bias=cfg.expert_bias)
    return blocks


def fill_experts(path: Path, name: str, t, pool: ExpertPool, cfg, layer: int, part: str) -> None:
    """One stacked expert tensor ``t`` (``name`` in the file at ``path``) into the pool's banks."""
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    out = h if part.startswith("down") else i
    want = (e, out) if part.endswith("_bias") else (e, out, i if part == "down" else h)
    if tuple(t.shape) != want:
        raise GGUFError(f"{path}: tensor '{name}' has shape {list(t.shape)}, expected {list(want)}")
    rows = slice(pool.layer_rows(layer), pool.layer_rows(layer) + e)
    blocks = pool.layer_blocks(layer)
    if part.endswith("_bias"):
        _fill_bias(pool, blocks, rows, part, t.dequantized(), i, h)
    elif blocks is not None:  # as stored: each expert's rows of blocks at the start of its bank row
        raw = stored_rows(t).reshape(e, -1)  # [E, rows * row bytes]
        if part == "down":
            pool.down[rows, : raw.shape[1]].copy_(raw)
        else:  # gate rows first, then up rows
            start = 0 if part == "gate" else raw.shape[1]
            pool.gate_up[rows, start : start + raw.shape[1]].copy_(raw)
    elif part == "down":
        pool.down[rows, :, :i].copy_(t.dequantized())
    else:  # gate rows first, then up rows
        first = 0 if part == "gate" else i
        pool.gate_up[rows, first : first + i, :h].copy_(t.dequantized())


def _fill_bias(pool: ExpertPool, blocks: ExpertBlocks | None, rows: slice, part: str, values: torch.Tensor,
               i: int, h: int) -> None:
    """A bias [E, out]: the last column of float experts, or fp32 after each row's blocks (the gate
    bias, then the up bias, after the gate and up blocks; the down bias after the down blocks)."""
    if blocks is None:
        if part == "down_bias":
            pool.down[rows, :, i].copy_(values)
        else:
            first = 0 if part == "gate_bias" else i
            pool.gate_up[rows, first : first + i, h].copy_(values)
        return
    data = values.float().contiguous().view(torch.uint8)  # [E, 4 * out]
    if part == "down_bias":
        pool.down[rows, blocks.down_bytes : blocks.down_bytes + data.shape[1]].copy_(data)
    else:
        start = blocks.gate_up_bytes + (0 if part == "gate_bias" else 4 * i)
        pool.gate_up[rows, start : start + data.shape[1]].copy_(data)
