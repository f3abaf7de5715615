"""The integer block kernels of every decode library this CPU runs, side by side: ``linear_blocks``
for the GGML formats at 1, 4 and 8 tokens, exact (fp32 activations in three int8 pieces) and in the
int8-activation mode, in rounds that interleave the libraries. Two weight sizes: one that the caches
hold (arithmetic decides) and one that no cache holds (``--mib``, from DRAM). Reports the weight
bytes read per second (GB/s) and weights per second; medians over the rounds.

    python bench/kernels.py [--rounds 5] [--mib 256] [--json bench/out/kernels.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hearth  # noqa: E402,F401 - before torch: hearth's OpenMP defaults apply to the process

# isort: split
import torch  # noqa: E402

from bench.common import emit, machine_facts, read_rate  # noqa: E402
from hearth.engine.kernels import cpu as kernels  # noqa: E402
from hearth.engine.quant.registry import REGISTRY, quantize  # noqa: E402

FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4")
COLS = 2048


def libraries() -> dict[str, kernels.NativeKernels]:
    """Every decode library this CPU runs, loaded side by side."""
    base = kernels.cpu_decode_ops()
    if base is None:
        raise SystemExit("no native kernels on this machine")
    loaded = {isa: kernels.decode_library(isa) for isa in kernels.runnable_isas(base.features)}
    return {isa: ops for isa, ops in loaded.items() if ops is not None}


def weights(fmt: str, rows: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of ``fmt``: one quantized random block of rows, repeated (quantizing
    hundreds of MiB would take minutes; the kernels' speed does not depend on the values)."""
    block = quantize(torch.randn(min(rows, 256), COLS, generator=torch.Generator().manual_seed(0)) * 0.02, fmt)
    return block.repeat((rows + block.shape[0] - 1) // block.shape[0], 1)[:rows].contiguous()


def time_call(ops: kernels.NativeKernels, x: torch.Tensor, w: torch.Tensor, fmt: str, int8: bool, reps: int) -> float:
    """Seconds per call, best of ``reps`` (after one warm call)."""
    ops.linear_blocks(x, w, fmt, int8)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        ops.linear_blocks(x, w, fmt, int8)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="the weight no cache holds, per format (MiB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = libraries()
    sizes = {"cache": 1024, "dram": None}
    results: dict[tuple, list[float]] = {}
    for fmt in FORMATS:
        row_bytes = REGISTRY.get(fmt).row_bytes(COLS)
        sizes["dram"] = args.mib * 2**20 // row_bytes
        for where, rows in sizes.items():
            w = weights(fmt, rows)
            for m in (1, 4, 8):
                x = torch.randn(m, COLS)
                for _ in range(args.rounds):
                    for isa, ops in libs.items():
                        for mode in ("exact", "int8"):
                            t = time_call(ops, x, w, fmt, mode == "int8", 20 if where == "cache" else 3)
                            results.setdefault((fmt, where, m, mode, isa), []).append(w.numel() / t / 1e9)
    rows_out = [{"format": f, "weights": where, "tokens": m, "mode": mode, "library": isa,
                 "gb_s": statistics.median(v),
                 "g_weights_s": statistics.median(v) * COLS / REGISTRY.get(f).row_bytes(COLS)}
                for (f, where, m, mode, isa), v in results.items()]
    rate = read_rate()
    print(f"{args.threads} threads, {args.rounds} interleaved rounds, medians; memory read rate {rate / 1e9:.1f} GB/s")
    print("| format | weights | tokens | mode | " + " | ".join(libs) + " |")
    print("|---|---|---:|---|" + "---:|" * len(libs))
    for fmt in FORMATS:
        for where in sizes:
            for m in (1, 4, 8):
                for mode in ("exact", "int8"):
                    cells = [f"{statistics.median(results[(fmt, where, m, mode, isa)]):.1f}" for isa in libs]
                    print(f"| {fmt} | {where} | {m} | {mode} | " + " | ".join(cells) + " |")
    emit({"machine": machine_facts(), "threads": args.threads, "rounds": args.rounds, "read_rate_gb_s": rate / 1e9,
          "unit": "GB/s of weight bytes (g_weights_s: billions of weights a second)", "rows": rows_out}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
