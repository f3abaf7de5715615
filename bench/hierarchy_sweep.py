"""The cache-fraction sweep of ``bench/decode.py --cache-fraction``: plain engine vs expert hierarchy."""

from __future__ import annotations

import argparse
import statistics

from bench.common import emit, synthetic_prompt
from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.dispatch import load_config
from hearth.engine.experts.measure import measure_host_path
from hearth.engine.ops import activation

_COUNTERS = ("hits", "misses", "fills", "cpu", "cpu_bytes", "cpu_seconds", "fill_seconds", "fill_bytes")


def _decode_run(llm: LLM, prompt: list[int], gen: int) -> dict:
    """Decode tok/s of one request, and the hierarchy's counters over its decode steps only."""
    experts = llm.engine.experts
    first = last = None
    at_first: dict = {}
    for out in llm.stream(prompt, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)):
        if first is None:
            first = out
            at_first = experts.stats() if experts is not None else {}
        last = out
    m = last.metrics
    run = {"decode_tok_s": (gen - 1) / (m.finished - m.first_token), "prefill_s": m.first_token - m.arrival}
    if experts is not None:
        after = experts.stats()
        run.update({k: after[k] - at_first[k] for k in _COUNTERS})
    return run


def run_sweep(args: argparse.Namespace) -> int:
    _, cfg = load_config(args.model, args.dtype)
    prompt = synthetic_prompt(cfg.vocab_size, args.prompt_len)
    common = dict(dtype=args.dtype, max_num_seqs=1, max_model_len=args.prompt_len + args.gen + 16)
    engines = {"plain": LLM(args.model, expert_device="none", **common)}
    for f in args.cache_fraction:
        engines[f"cache {f:g}"] = LLM(args.model, expert_device="virtual", expert_cache=str(f),
                                      virtual_link_gbps=args.virtual_link_gbps, **common)
    pool = engines["plain"].engine.pool
    for llm in engines.values():
        _decode_run(llm, prompt[:16], 4)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    b_h: list[float] = []
    for _ in range(args.runs):  # interleaved: every configuration sees the same machine state
        for name, llm in engines.items():
            runs[name].append(_decode_run(llm, prompt, args.gen))
        b_h.append(measure_host_path(pool, activation(cfg.hidden_act), cfg.top_k, repeats=15).bytes_per_s)
    host_bw = statistics.median(b_h)
    result = {"model": str(args.model), "dtype": args.dtype, "prompt_len": args.prompt_len, "gen": args.gen,
              "runs": args.runs, "virtual_link_gbps": args.virtual_link_gbps, "B_H_GBps": host_bw / 1e9,
              "B_H_GBps_all": [b / 1e9 for b in b_h], "expert_bytes": pool.expert_bytes, "configs": {}}
    for name, rs in runs.items():
        row = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
               "decode_tok_s_all": [r["decode_tok_s"] for r in rs]}
        if "hits" in rs[0]:
            last = rs[-1]
            tokens = args.gen - 1  # decode steps after the first token
            cpu_bytes, cpu_s = sum(r["cpu_bytes"] for r in rs), sum(r["cpu_seconds"] for r in rs)
            cpu_per_token = last["cpu"] / tokens
            # Reported when the CPU path really streams experts (at least one per token on average).
            cpu_bw = cpu_bytes / cpu_s if cpu_bytes and cpu_per_token >= 1 else None
            row.update({
                "slots": engines[name].engine.experts.tables.num_slots,
                "hit_rate": last["hits"] / max(last["hits"] + last["misses"], 1),
                "fills_per_token": last["fills"] / tokens, "cpu_experts_per_token": last["cpu"] / tokens,
                "cpu_path_GBps": cpu_bw / 1e9 if cpu_bw else None,
                "cpu_share_of_B_H": cpu_bw / host_bw if cpu_bw else None,
            })
        result["configs"][name] = row
    _print(result)
    emit(result, args.json)
    for llm in engines.values():
        llm.engine.close()
    return 0


def _print(r: dict) -> None:
    print(f"\nmodel {r['model']} ({r['dtype']}), prompt {r['prompt_len']}, generate {r['gen']}, median of "
          f"{r['runs']}; virtual link {r['virtual_link_gbps'] or 'unlimited'} GB/s; "
          f"B_H {r['B_H_GBps']:.1f} GB/s (CPU expert kernel, median of one measurement per round)\n")
    header = ["config    ", "slots", "decode tok/s", "hit rate", "fills/tok", "CPU experts/tok", "CPU path GB/s",
              "share of B_H"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for name, c in r["configs"].items():
        if "slots" not in c:
            print(f"| {name:<10} |     - | {c['decode_tok_s']:12.2f} |        - |         - |               - |"
                  "             - |            - |")
            continue
        print(f"| {name:<10} | {c['slots']:5d} | {c['decode_tok_s']:12.2f} | {c['hit_rate']:8.1%} | "
              f"{c['fills_per_token']:9.1f} | {c['cpu_experts_per_token']:15.1f} | "
              + (f"{c['cpu_path_GBps']:13.2f} | {c['cpu_share_of_B_H']:12.1%} |" if c["cpu_path_GBps"] else
                 f"{'-':>13} | {'-':>12} |"))
