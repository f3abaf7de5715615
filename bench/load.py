"""Load throughput: FTW (with and without checksums) and Hugging Face safetensors, against the raw
read speed of the same bytes, warm (page cache) and cold (pages dropped with posix_fadvise).
Raw reads go into an already-touched buffer (pure read speed) and into fresh memory (what a
loader's new buffers cost, page faults included); loads are compared with the latter.

    python bench/load.py --model HF_DIR [--ftw DIR] [--runs 3]
    python bench/load.py --build-random /tmp/qwen3-1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import emit  # noqa: E402
from hearth.engine.checkpoint.dispatch import convert  # noqa: E402
from hearth.engine.checkpoint.ftw import is_ftw, load_ftw, read_index  # noqa: E402
from hearth.engine.checkpoint.hf import load_model  # noqa: E402

CHUNK = 64 << 20


def drop_from_page_cache(files: list[Path]) -> None:
    """Ask the kernel to forget the files' clean pages, so the next read comes from disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path], threads: int, buf: memoryview | None = None) -> float:
    """Seconds to read every byte of ``files`` with parallel positional reads into one buffer:
    ``buf`` when given (already touched: pure read speed), else fresh memory (which, like any
    loader's fresh buffers, pays the kernel's page faults while it is filled)."""
    total = sum(f.stat().st_size for f in files)
    start = time.perf_counter()
    if buf is None:
        fresh = torch.empty(total, dtype=torch.uint8)  # untouched pages, as a loader's buffers are
        buf = memoryview(fresh.numpy())
    jobs, at = [], 0
    for f in files:
        size = f.stat().st_size
        jobs += [(f, off, at + off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
        at += size
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda j: os.preadv(fds[j[0]], [buf[j[2] : j[2] + j[3]]], j[1]), jobs))
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return seconds


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="Hugging Face checkpoint directory")
    ap.add_argument("--build-random", type=Path, help="create the ~1B random Qwen3-MoE here (if absent) and use it")
    ap.add_argument("--ftw", type=Path, help="FTW directory (default: MODEL-ftw, converted if absent)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(8, 2 * (os.cpu_count() or 1)))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.build_random:
        from bench.decode import build_random

        build_random(args.build_random, "bfloat16")
        args.model = args.build_random
    if args.model is None:
        ap.error("give --model or --build-random")
    ftw = args.ftw or args.model.with_name(args.model.name + "-ftw")
    if not is_ftw(ftw):
        print(f"converting {args.model} -> {ftw} …", file=sys.stderr)
        convert(args.model, ftw)
    shards = [ftw / s["file"] for s in read_index(ftw)["shards"]]
    hf_files = sorted(args.model.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in shards)
    touched = memoryview(bytearray(nbytes))
    touched[:] = b"\1" * nbytes
    cases = {  # name: (run, files it reads)
        "raw read, touched buffer": (lambda: raw_read(shards, args.threads, touched), shards),
        "raw read, fresh buffer": (lambda: raw_read(shards, args.threads), shards),
        "FTW load, verified": (lambda: timed(lambda: load_ftw(ftw)), shards),
        "FTW load, --no-verify": (lambda: timed(lambda: load_ftw(ftw, verify=False)), shards),
        "HF safetensors load": (lambda: timed(lambda: load_model(args.model)), hf_files),
    }
    results: dict[str, dict[str, list[float]]] = {name: {"warm": [], "cold": []} for name in cases}
    for fn, _ in cases.values():
        fn()  # first-use costs (imports, kernel loading) out of the way
    for _ in range(args.runs):
        for name, (fn, files) in cases.items():
            raw_read(files, args.threads)  # make sure the files are in the page cache
            results[name]["warm"].append(fn())
            drop_from_page_cache(files)
            results[name]["cold"].append(fn())
    out = {"model": str(args.model), "ftw": str(ftw), "bytes": nbytes, "threads": args.threads,
           "torch_threads": torch.get_num_threads(), "runs": args.runs, "cases": {}}
    print(f"\n{nbytes / 2**30:.2f} GiB of weights, {args.threads} reader threads, median of {args.runs}\n")
    print("| path                     | warm GB/s | cold GB/s | warm vs raw fresh | cold vs raw fresh |")
    print("|--------------------------|-----------|-----------|-------------------|-------------------|")
    raw_warm = statistics.median(results["raw read, fresh buffer"]["warm"])
    raw_cold = statistics.median(results["raw read, fresh buffer"]["cold"])
    for name, r in results.items():
        warm, cold = statistics.median(r["warm"]), statistics.median(r["cold"])
        out["cases"][name] = {"warm_s": warm, "cold_s": cold, "warm_GBps": nbytes / warm / 1e9,
                              "cold_GBps": nbytes / cold / 1e9, "warm_all": r["warm"], "cold_all": r["cold"]}
        print(f"| {name:<24} | {nbytes / warm / 1e9:9.2f} | {nbytes / cold / 1e9:9.2f} | {raw_warm / warm:17.0%} | "
              f"{raw_cold / cold:17.0%} |")
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
