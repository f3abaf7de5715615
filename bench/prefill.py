"""Prefill through whole-layer double buffering against the one-buffer ablation and the bounds.

For each prompt length, on the same checkpoint and in one process, it times the prompt's prefill
(the time to its first token):

- ``compute``: the plain engine, every expert already in host memory: no copies at all;
- ``double``: the expert hierarchy streaming whole layers through two buffers over a link limited
  to ``--link-gbps`` (the virtual device here, or ``--device cuda`` with the real PCIe link);
- ``single``: the same with one buffer, so every layer waits for its copy (the ablation);

and reports the copy time the link needed (from the engine's stats), ``double`` against
``max(copy, compute)`` (what perfect overlap reaches) and ``single`` against ``copy + compute``
(no overlap). On CUDA it also reports prefill tok/s against the PCIe bound: the expert bytes
streamed per chunk over the measured B_P.

    python bench/prefill.py --model /tmp/qwen3-1b --lengths 1024 4096 16384 --link-gbps 0.5
    python bench/prefill.py --build-random /tmp/qwen3-1b ...   # build the ~1B random model first
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, synthetic_prompt  # noqa: E402
from hearth.engine import LLM, SamplingParams  # noqa: E402
from hearth.engine.checkpoint.dispatch import load_config  # noqa: E402


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    return out.metrics.first_token - out.metrics.arrival


def measure(model: Path, prompt: list[int], mode: str, args: argparse.Namespace) -> dict:
    """Median prefill seconds of one configuration, with its prefill stats from the last run."""
    options = dict(prefill_chunk=args.chunk, max_num_batched_tokens=args.chunk, max_model_len=len(prompt) + 8,
                   max_num_seqs=1)
    if mode == "compute":
        options.update(expert_device="none")
    else:
        options.update(expert_device=args.device, expert_cache=args.cache, double_buffer=mode == "double",
                       stream_min_tokens=1)
        if args.device == "virtual":  # no B_P to measure against: a forced table skips the start-up profile
            options.update(virtual_link_gbps=args.link_gbps, q_mode="all")
    llm = LLM(model, **options)
    try:
        prefill_seconds(llm, prompt[: args.chunk])  # warm-up: kernels, allocator, first copies
        times, before = [], None
        for _ in range(args.repeats):
            before = llm.engine.stats().get("experts", {})
            times.append(prefill_seconds(llm, prompt))
        after = llm.engine.stats().get("experts", {})
        row = {"mode": mode, "tokens": len(prompt), "seconds": statistics.median(times), "samples": times}
        if after:
            for key in ("prefill_copy_seconds", "prefill_wait_seconds", "prefill_compute_seconds",
                        "prefill_copy_bytes"):
                row[key] = after[key] - before.get(key, 0)
            row["hidden_share"] = 1 - min(row["prefill_wait_seconds"] / max(row["prefill_copy_seconds"], 1e-12), 1)
            row["b_p"] = after.get("b_p")
        return row
    finally:
        llm.engine.close()


def summarize(rows: list[dict]) -> dict:
    """Per length: copy and compute bounds, and both streamed modes against them."""
    out = {}
    for n in dict.fromkeys(r["tokens"] for r in rows):
        by = {r["mode"]: r for r in rows if r["tokens"] == n}
        compute, double, single = by["compute"]["seconds"], by["double"], by["single"]
        copy = double["prefill_copy_seconds"] / len(double["samples"])  # per prefill
        out[n] = {"compute_s": compute, "copy_s": copy, "double_s": double["seconds"], "single_s": single["seconds"],
                  "double_vs_max": double["seconds"] / max(copy, compute),
                  "single_vs_sum": single["seconds"] / (copy + compute),
                  "double_vs_single": double["seconds"] / single["seconds"],
                  "hidden_share_double": double["hidden_share"], "hidden_share_single": single["hidden_share"]}
        if double.get("b_p"):
            streamed = double["prefill_copy_bytes"] / len(double["samples"])
            out[n]["pcie_bound_tok_s"] = n / (streamed / double["b_p"])
            out[n]["tok_s"] = n / double["seconds"]
    return out


def markdown(summary: dict) -> str:
    lines = ["| tokens | compute only | copy (link) | double buffer | one buffer | double / max(copy, compute) "
             "| one / (copy + compute) | copy hidden (double, one) |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n, s in summary.items():
        lines.append(f"| {n} | {s['compute_s']:.2f} s | {s['copy_s']:.2f} s | {s['double_s']:.2f} s | "
                     f"{s['single_s']:.2f} s | {s['double_vs_max']:.2f} | {s['single_vs_sum']:.2f} | "
                     f"{s['hidden_share_double']:.0%}, {s['hidden_share_single']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/qwen3-1b"))
    p.add_argument("--build-random", action="store_true", help="build the ~1B random model at --model if absent")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="virtual", choices=["virtual", "cuda"])
    p.add_argument("--link-gbps", type=float, default=0.5, help="the virtual device's link rate")
    p.add_argument("--cache", default="0.25", help="expert cache size (must hold two layers)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.build_random:
        from bench.decode import build_random

        build_random(args.model, "bfloat16")
    vocab = load_config(args.model, None)[1].vocab_size
    rows = []
    for n in args.lengths:
        prompt = synthetic_prompt(vocab, n)
        for mode in ("compute", "double", "single"):
            rows.append(measure(args.model, prompt, mode, args))
            print(f"{n} tokens, {mode}: {rows[-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    summary = summarize(rows)
    print(markdown(summary))
    emit({"device": args.device, "link_gbps": args.link_gbps, "chunk": args.chunk, "rows": rows,
          "summary": {str(k): v for k, v in summary.items()}}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
