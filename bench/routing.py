"""What prefix-aware routing adds to each request at the router: hashing the prompt's blocks and
choosing among replicas that each publish a full summary (4,096 block hashes), by prompt length.

    python bench/routing.py [--replicas 2] [--repeats 200] [--json out.json]

Prints the median and 99th percentile per prompt length, with and without prefix routing (the
plain choice by load), and the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, synthetic_prompt  # noqa: E402
from hearth.cluster.routing import ReplicaLoad, choose_replica  # noqa: E402
from hearth.proto.prefix import block_hashes  # noqa: E402

BLOCK = 16
SUMMARY = 4096  # hashes a replica publishes at most


def replicas(count: int, prompt: list[int]) -> list[ReplicaLoad]:
    """Replicas with full summaries; the last holds the prompt's first half."""
    out = []
    for i in range(count):
        other = block_hashes(synthetic_prompt(30000, SUMMARY * BLOCK, salt=i + 1), BLOCK)
        held = block_hashes(prompt, BLOCK)[: len(prompt) // BLOCK // 2] if i == count - 1 else []
        cached = frozenset((held + other)[:SUMMARY])
        out.append(ReplicaLoad(f"m@{i}", "m", True, in_flight=i % 2, decode_tok_s=20.0, cached=cached,
                               block_size=BLOCK))
    return out


def timed(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for length in (512, 4096, 32768):
        prompt = synthetic_prompt(30000, length)
        loads = replicas(args.replicas, prompt)

        def with_prefix(prompt=prompt, loads=loads):
            assert choose_replica(loads, "m", prompt_hashes={BLOCK: block_hashes(prompt, BLOCK)}) is not None

        def plain(loads=loads):
            assert choose_replica(loads, "m") is not None

        (med, p99), (plain_med, plain_p99) = timed(with_prefix, args.repeats), timed(plain, args.repeats)
        rows.append({"prompt_tokens": length, "prefix_median_ms": med * 1e3, "prefix_p99_ms": p99 * 1e3,
                     "plain_median_ms": plain_med * 1e3, "plain_p99_ms": plain_p99 * 1e3})
    print(f"\nrouter choice, {args.replicas} replicas with {SUMMARY} published block hashes each, "
          f"{args.repeats} repeats\n")
    print("| prompt tokens | prefix routing median | p99 | load only median | p99 |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['prefix_median_ms']:.3f} ms | {r['prefix_p99_ms']:.3f} ms "
              f"| {r['plain_median_ms']:.4f} ms | {r['plain_p99_ms']:.4f} ms |")
    emit({"replicas": args.replicas, "summary_hashes": SUMMARY, "block_size": BLOCK, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
