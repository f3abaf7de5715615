"""``hearth inspect`` and ``hearth convert``: a checkpoint's architecture and sizes, and its
conversion to FTW or to a quantized GGUF file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hearth.config import parse_bytes
from hearth.engine.checkpoint.dispatch import convert, load_config
from hearth.engine.checkpoint.ftw import read_index
from hearth.engine.checkpoint.gguf_writer import ConvertError, WriteSummary, write_gguf
from hearth.engine.checkpoint.inspect import human_bytes, human_count, stored_summary, summarize
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.quant.registry import FORMATS


def cmd_inspect(args: argparse.Namespace) -> int:
    """``hearth inspect``: what the checkpoint holds, as a table or JSON."""
    _, cfg = load_config(args.model)
    s = summarize(cfg)
    stored = stored_summary(args.model, cfg)  # GGUF, FTW, FP8 / MXFP4: the formats as stored
    ops = cpu_decode_ops()
    kernels = None if ops is None else {"library": ops.isa, "integer_products": ops.q8_kernel,
                                        "why": ops.choice.reason}
    if args.json:
        print(json.dumps({**s.as_dict(), **({"stored": stored} if stored else {}), "cpu_kernels": kernels},
                         indent=2))
        return 0
    rows = [
        ("architecture", s.architecture),
        ("dtype", s.dtype),
        ("layers (MoE)", f"{s.num_layers} ({s.num_moe_layers})"),
        ("experts per layer / top-k", f"{s.num_experts} / {s.top_k}"),
        ("parameters", f"{human_count(s.total_params)} total, {human_count(s.expert_params)} in experts"),
        ("active per token", human_count(s.active_params_per_token)),
        ("expert size", human_bytes(s.expert_bytes)),
        ("expert pool", human_bytes(s.expert_pool_bytes)),
        ("bytes per decode token", human_bytes(s.bytes_per_decode_token)),
        ("KV cache per token", human_bytes(s.kv_bytes_per_token) + (
            f" (latent; expanded K/V would take {human_bytes(s.expanded_kv_bytes_per_token)})"
            if s.expanded_kv_bytes_per_token else "")),
    ]
    if stored is not None:  # the formats as stored, and what a token reads in them
        rows[1] = ("dtype", f"{s.dtype} ({_blocks_note(stored['in_blocks'], s.dtype)})")
        rows += [(f"stored {group}", ", ".join(f"{fmt} {human_bytes(n)}" for fmt, n in sorted(fmts.items())))
                 for group, fmts in sorted(stored["formats"].items())]
        rows.append(("bytes per decode token, as stored", human_bytes(stored["bytes_per_decode_token"])))
    rows.append(("CPU kernels", "none native (PyTorch kernels)" if kernels is None else
                 f"{kernels['library']}, {kernels['integer_products']} integer products ({kernels['why']})"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _blocks_note(in_blocks: list[str], dtype: str) -> str:
    """What stays in its quantized blocks at run time, for the dtype line of ``hearth inspect``
    (``in_blocks`` is empty where no native kernels run: see ``stored_summary``)."""
    if not in_blocks:
        if cpu_decode_ops() is None:
            return "compute; no weight stays in its blocks here (no native kernels: blocks are decoded at load)"
        return "compute; no weight stays in its blocks here"
    groups = in_blocks[0] if len(in_blocks) == 1 else f"{', '.join(in_blocks[:-1])} and {in_blocks[-1]}"
    return (f"compute; the block-quantized matrices of {groups} stay in their blocks, "
            f"everything else is {dtype}")


def cmd_convert(args: argparse.Namespace) -> int:
    """``hearth convert``: to an FTW directory, or with ``--quant`` to one GGUF file."""
    start = time.perf_counter()
    if args.quant is not None:
        return _convert_gguf(args, start)
    path = convert(args.src, args.dst, None if args.dtype == "auto" else args.dtype,
                   shard_bytes=parse_bytes(args.shard_size), show_progress=True)
    index = read_index(path.parent)
    total = sum(s["bytes"] for s in index["shards"])
    blocks = {e["format"] for e in index["tensors"].values() if "format" in e}
    blocks |= {f for b in (index["banks"].get("blocks") or {}).values() for f in b.values()}
    kept = f" (quantized weights in their blocks: {', '.join(sorted(blocks))})" if blocks else ""
    print(f"wrote {path.parent}: {len(index['shards'])} shard(s), {total / 2**30:.2f} GiB, "
          f"{index['dtype']}{kept}, in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def _convert_gguf(args: argparse.Namespace, start: float) -> int:
    dst = Path(args.dst)
    if dst.suffix != ".gguf":
        print(f"hearth convert: with --quant the output is one GGUF file; name it FILE.gguf, not {dst}",
              file=sys.stderr)
        return 2
    summary = WriteSummary()
    try:
        write_gguf(args.src, dst, args.quant.lower(), show_progress=True, summary=summary)
    except (ConvertError, FileNotFoundError) as exc:
        dst.unlink(missing_ok=True)
        print(f"hearth convert: {exc}", file=sys.stderr)
        return 2
    for (asked, got), n in sorted(summary.fallbacks.items()):
        print(f"hearth convert: warning: {args.quant} not honoured for {n} tensor(s) whose rows are not whole "
              f"{asked} blocks ({FORMATS[asked].block_elems} values): written as {got}", file=sys.stderr)
    print(f"wrote {dst}: {dst.stat().st_size / 2**30:.2f} GiB, {args.quant} (tensors: {summary.describe()}), in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
