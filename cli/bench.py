"""``hearth bench``: prompt-processing and generation throughput in the spirit of llama-bench.

Tests: ``pp<P>`` (P prompt tokens after ``depth`` tokens already in context; tok/s of that chunk),
``tg<N>`` (N generated tokens after ``depth`` tokens; tok/s of the decode steps) and the TTFT of
the pp request. Each runs ``repetitions`` times after a warm-up; the median and the standard
deviation are reported. Backends: this engine in-process (optionally at several expert-cache
fractions), Hugging Face transformers on the same checkpoint (``--transformers``), or a running
hearth server (``--url``, which reads the server's llama.cpp-style ``timings``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchRow:
    """One (backend, test, depth) cell: its samples in tok/s (and ms for TTFT)."""

    model: str
    backend: str
    test: str
    depth: int
    samples: list[float] = field(default_factory=list)
    unit: str = "t/s"

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def spread(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "median": round(self.median, 3), "stdev": round(self.spread, 3)}


# A runner takes (depth, pp, tg) and returns {"pp": tok/s, "tg": tok/s, "ttft": ms} for one repetition.
Runner = Callable[[int, int, int], dict[str, float]]


def run_backend(name: str, model: str, runner: Runner, args: argparse.Namespace) -> list[BenchRow]:
    """Warm up once, then ``repetitions`` runs per depth."""
    runner(0, min(args.n_prompt, 16) or 1, min(args.n_gen, 4))
    rows = []
    for depth in args.depth:
        pp = BenchRow(model, name, f"pp{args.n_prompt}", depth)
        tg = BenchRow(model, name, f"tg{args.n_gen}", depth)
        ttft = BenchRow(model, name, f"ttft{args.n_prompt}", depth, unit="ms")
        # Streamed prefill (expert hierarchy): the share of the pp chunk's copy time hidden behind compute.
        hidden = BenchRow(model, name, f"pp{args.n_prompt} copy hidden", depth, unit="%")
        for _ in range(args.repetitions):
            result = runner(depth, args.n_prompt, args.n_gen)
            if args.n_prompt:
                pp.samples.append(result["pp"])
                ttft.samples.append(result["ttft"])
                if "copy_hidden" in result:
                    hidden.samples.append(100 * result["copy_hidden"])
            if args.n_gen:
                tg.samples.append(result["tg"])
        rows += [r for r in (pp, tg, ttft, hidden) if r.samples]
        print(f"  {name} depth {depth}: " + ", ".join(f"{r.test} {r.median:.1f} {r.unit}" for r in (pp, tg, ttft)
                                                      if r.samples), file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[BenchRow]) -> str:
    """A llama-bench-style table, with each row's ratio to the first backend's same test."""
    base = {(r.test, r.depth): r.median for r in rows if r.backend == rows[0].backend}
    lines = ["| model | backend | test | depth | median | ± sd | vs " + rows[0].backend + " |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        ref = base.get((r.test, r.depth))
        ratio = f"{r.median / ref:.2f}×" if ref and r.backend != rows[0].backend else ""
        lines.append(f"| {r.model} | {r.backend} | {r.test} | {r.depth} | {r.median:.2f} {r.unit} "
                     f"| {r.spread:.2f} | {ratio} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput benchmark (pp/tg/TTFT) in-process, against transformers, "
                                     "or against a running server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--url", default=None, help="benchmark a running hearth server instead (e.g. http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="the server's key (--url)")
    p.add_argument("-p", "--n-prompt", type=int, default=512,
                   help="prompt tokens of the pp test (default 512; 0: skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128,
                   help="generated tokens of the tg test (default 128; 0: skip)")
    p.add_argument("-d", "--depth", type=int, nargs="+", default=[0],
                   help="tokens already in context before each test (a sweep; multiples of -p)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="runs per test (default 5)")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint's), float32 or bfloat16")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--cache-fraction", type=float, nargs="+", default=None, metavar="F",
                   help="also run with the expert hierarchy at these cache fractions (virtual device "
                        "without a GPU)")
    p.add_argument("--virtual-link-gbps", type=float, default=None, help="rate-limit the virtual device's link")
    p.add_argument("--no-double-buffer", action="store_true",
                   help="with --cache-fraction: stream prefill through one buffer (ablation)")
    p.add_argument("--stream-min-tokens", type=int, default=None, metavar="N",
                   help="with --cache-fraction: steps of at least N tokens stream whole layers "
                        "(default: from measured costs)")
    p.add_argument("--transformers", action="store_true", help="also run Hugging Face transformers on the checkpoint")
    p.add_argument("--json", type=Path, default=None, help="write all rows and samples here")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="what to print (default md)")


def validate(args: argparse.Namespace) -> None:
    if args.n_prompt < 0 or args.n_gen < 0 or args.repetitions < 1 or not (args.n_prompt or args.n_gen):
        raise ValueError("--n-prompt and --n-gen must be >= 0 (not both 0) and --repetitions >= 1")
    if any(d < 0 for d in args.depth) or (args.n_prompt and any(d % args.n_prompt for d in args.depth)):
        raise ValueError(f"--depth values must be non-negative multiples of --n-prompt ({args.n_prompt}), so that "
                         f"the pp test is exactly one prefill chunk")
    if args.url and (args.cache_fraction or args.transformers):
        raise ValueError("--url benchmarks a running server; --cache-fraction and --transformers are in-process")
