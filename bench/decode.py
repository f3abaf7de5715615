"""Decode and prefill throughput of hearth's engine against transformers ``generate``.

Both run on the same checkpoint, in the same process, on the same prompt, alternating run by
run; the table reports medians over ``--runs`` repetitions and the ratio hearth / transformers.

    python bench/decode.py --model DIR [--prompt-len 128] [--gen 64] [--runs 3] [--dtype bfloat16]
    python bench/decode.py --build-random /tmp/qwen3-1b   # ~1B random Qwen3-MoE, then benchmark it

With ``--cache-fraction F [F ...]`` it benchmarks the expert hierarchy instead: the plain engine
against a virtual-device expert cache of each size (``--virtual-link-gbps`` rate-limits its copy
path), reporting decode tok/s, hit rate, fills and CPU experts per token, and the share of the
host bandwidth B_H (measured with the real CPU expert kernel) that the CPU expert path reaches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, synthetic_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.inspect import human_bytes, summarize  # noqa: E402
from engine.loader import load_config  # noqa: E402

RANDOM_1B = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=2048,
    norm_topk_prob=True, initializer_range=0.02,
)


def build_random(path: Path, dtype: str) -> None:
    from engine.testing import make_checkpoint

    if (path / "config.json").is_file():
        return
    print(f"building a ~1B random Qwen3-MoE in {path} …", file=sys.stderr)
    make_checkpoint(path, "qwen3_moe", "per_expert", dtype, shard_bytes=1 << 30, vocab_size=32000, **RANDOM_1B)


def time_hearth(llm: LLM, prompt: list[int], gen: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) for one request."""
    out = llm.generate(prompt, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    return m.first_token - m.arrival, (gen - 1) / (m.finished - m.first_token)


def time_transformers(model, prompt: list[int], gen: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kwargs)
        t2 = time.perf_counter()
    prefill = t1 - t0
    return prefill, (gen - 1) / ((t2 - t1) - prefill)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--build-random", type=Path, help="create a ~1B random Qwen3-MoE here (if absent) and use it")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype for both engines")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--cache-fraction", type=float, nargs="+", default=None, metavar="F",
                    help="benchmark the expert hierarchy at these cache fractions (virtual device)")
    ap.add_argument("--virtual-link-gbps", type=float, default=None, metavar="X",
                    help="rate-limit the virtual device's copy path (with --cache-fraction)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.build_random:
        build_random(args.build_random, args.dtype)
        args.model = args.build_random
    if args.model is None:
        ap.error("give --model or --build-random")

    if args.cache_fraction is not None:
        from bench.hierarchy_sweep import run_sweep

        return run_sweep(args)

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    _, cfg = load_config(args.model, dtype)
    summary = summarize(cfg)
    prompt = synthetic_prompt(cfg.vocab_size, args.prompt_len)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, max_model_len=args.prompt_len + args.gen + 16)
    ref = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype).eval()
    time_hearth(llm, prompt[:16], 4)  # warm-up both
    time_transformers(ref, prompt[:16], 4)
    rows: dict[str, list[tuple[float, float]]] = {"hearth": [], "transformers": []}
    for _ in range(args.runs):
        rows["hearth"].append(time_hearth(llm, prompt, args.gen))
        rows["transformers"].append(time_transformers(ref, prompt, args.gen))

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in rows[name])

    result = {
        "model": str(args.model), "dtype": args.dtype, "prompt_len": args.prompt_len, "gen": args.gen,
        "runs": args.runs, "threads": torch.get_num_threads(),
        "bytes_per_decode_token": summary.bytes_per_decode_token,
        "total_params": summary.total_params, "active_params": summary.active_params_per_token,
    }
    for name in rows:
        result[name] = {
            "prefill_tok_s": args.prompt_len / med(name, 0),
            "decode_tok_s": med(name, 1),
            "decode_tok_s_all": [r[1] for r in rows[name]],
            "prefill_s_all": [r[0] for r in rows[name]],
        }
    h, t = result["hearth"], result["transformers"]
    result["decode_ratio"] = h["decode_tok_s"] / t["decode_tok_s"]
    result["prefill_ratio"] = h["prefill_tok_s"] / t["prefill_tok_s"]
    bw = summary.bytes_per_decode_token * h["decode_tok_s"]
    print(f"\nmodel {args.model} ({cfg.architecture}, {args.dtype}, {torch.get_num_threads()} threads), "
          f"prompt {args.prompt_len}, generate {args.gen}, median of {args.runs}")
    print(f"bytes read per decode token: {human_bytes(summary.bytes_per_decode_token)} "
          f"(hearth streams {bw / 1e9:.2f} GB/s of weights)\n")
    print("| engine       | prefill tok/s | decode tok/s |")
    print("|--------------|---------------|--------------|")
    for name in rows:
        print(f"| {name:<12} | {result[name]['prefill_tok_s']:13.1f} | {result[name]['decode_tok_s']:12.2f} |")
    print(f"| ratio        | {result['prefill_ratio']:12.2f}x | {result['decode_ratio']:11.2f}x |")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
