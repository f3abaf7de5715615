"""Long-context prefill: does throughput hold from 512 tokens to 16k and 32k of context?

For each prompt length it times, on one engine with prefix caching on:

- ``cold``: a prompt no earlier request shares a prefix with: the time to its first token, and
  prefill tok/s (length / that time), against the 512-token rate (``vs_512``);
- ``warm``: the same prompt again with ``--append`` new tokens at its end, as an agent's next
  turn sends it: the time to the first token when the prefix cache holds the rest.

Attention runs through torch's CPU flash kernel (tiled keys, online softmax; no [T, T] scores):
a later chunk as its cached prefix plus its causal diagonal block, merged by log-sum-exp
(``engine/layers/attention.py``). ``tests/test_attention_kernel.py`` holds the engine to it.

    python bench/long_prefill.py --model DIR [--lengths 512 16384 32000] [--runs 1]
    python bench/long_prefill.py --demo-32k /tmp/demo-32k        # the demo's weights, 32k context
    python bench/long_prefill.py --build-random /tmp/qwen3-1b    # the ~1B random model, 40k context
    python bench/long_prefill.py --attention --lengths 4096 16384 32768   # the attention kernel alone
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, synthetic_prompt  # noqa: E402
from hearth.engine import LLM, SamplingParams  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens came from the prefix cache."""
    start = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    return time.perf_counter() - start, out.metrics.num_cached_tokens


def attention_table(contexts: list[int], runs: int, chunk: int = 512) -> list[dict]:
    """One layer's attention for one prefill chunk at each context (the ~1B model's 16 query / 4
    KV heads, bf16): one masked flash call against prefix + causal block, alternating, medians."""
    import torch
    import torch.nn.functional as F

    from hearth.engine.layers.attention import prefix_then_causal

    rows = []
    for ctx in contexts:
        q = torch.randn(16, chunk, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(ctx, 4, 64, dtype=torch.bfloat16) for _ in range(2))
        mask = torch.ones(chunk, ctx, dtype=torch.bool).tril(ctx - chunk)
        calls = {"masked": lambda q, k, v, m: F.scaled_dot_product_attention(
                     q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=m, enable_gqa=True),
                 "split": lambda q, k, v, m: prefix_then_causal(q, k, v, 64**-0.5)}
        times: dict[str, list[float]] = {"masked": [], "split": []}
        for _ in range(runs + 1):  # the first round warms up
            for name, fn in calls.items():
                start = time.perf_counter()
                fn(q, k, v, mask)
                times[name].append(time.perf_counter() - start)
        m, s = (statistics.median(times[n][1:]) * 1e3 for n in ("masked", "split"))
        rows.append({"context": ctx, "masked_ms": round(m, 1), "split_ms": round(s, 1), "speedup": round(m / s, 2)})
    return rows


def demo_with_context(out: Path, context: int) -> Path:
    """A copy of the bundled demo checkpoint whose config allows ``context`` positions."""
    from hearth.engine.checkpoint.demo import demo_model_dir

    shutil.copytree(demo_model_dir(), out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_random_1b(out: Path, context: int) -> Path:
    from bench.decode import RANDOM_1B
    from tests.checkpoints import make_checkpoint

    if not (out / "config.json").is_file():
        print(f"building a ~1B random Qwen3-MoE in {out} …", file=sys.stderr)
        make_checkpoint(out, "qwen3_moe", "per_expert", "bfloat16", shard_bytes=1 << 30, vocab_size=32000,
                        max_position_embeddings=context, **RANDOM_1B["qwen3_moe"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--demo-32k", type=Path, default=None, help="write a 32k-context demo copy here and use it")
    ap.add_argument("--build-random", type=Path, default=None, help="build the ~1B random model here and use it")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 16384, 32000])
    ap.add_argument("--append", type=int, default=64, help="new tokens of the warm request")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the engine's)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--attention", action="store_true",
                    help="only time one layer's chunk attention, masked call against prefix + causal block")
    args = ap.parse_args()
    if args.attention:
        rows = attention_table(args.lengths, max(args.runs, 5))
        print(f"{'context':>8} {'masked ms':>10} {'split ms':>9} {'speedup':>8}")
        for r in rows:
            print(f"{r['context']:>8} {r['masked_ms']:>10} {r['split_ms']:>9} {r['speedup']:>8}")
        emit({"bench": "chunk_attention", "rows": rows}, args.json)
        return
    context = max(args.lengths) + args.append + 8
    if args.demo_32k:
        model = demo_with_context(args.demo_32k, max(32768, context))
    elif args.build_random:
        model = build_random_1b(args.build_random, max(40960, context))
    elif args.model:
        model = args.model
    else:
        ap.error("give --model, --demo-32k or --build-random")
    options = dict(max_model_len=context, max_num_seqs=1)
    if args.chunk:
        options.update(prefill_chunk=args.chunk)
    llm = LLM(model, **options)
    vocab = llm.engine.model_config.vocab_size
    ttft(llm, synthetic_prompt(vocab, 600, 999))  # warm-up: first-touch page faults, kernel set-up
    rows, salt = [], 0
    for length in args.lengths:
        cold, warm = [], []
        for _ in range(args.runs):
            salt += 1
            prompt = synthetic_prompt(vocab, length, salt)
            seconds, cached = ttft(llm, prompt)
            assert cached == 0, "a cold prompt hit the prefix cache"
            cold.append(seconds)
            seconds, cached = ttft(llm, prompt + synthetic_prompt(vocab, args.append, salt + 1000))
            warm.append(seconds)
        cold_s = statistics.median(cold)
        rows.append({"tokens": length, "cold_ttft_s": round(cold_s, 3), "prefill_tok_s": round(length / cold_s, 1),
                     "warm_ttft_s": round(statistics.median(warm), 3), "warm_cached_tokens": cached,
                     "cold_samples": [round(s, 3) for s in cold]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = next((r["prefill_tok_s"] for r in rows if r["tokens"] == 512), None)
    for r in rows:
        r["vs_512"] = round(r["prefill_tok_s"] / base, 3) if base else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"model {model.name}  context {llm.engine.max_model_len}  chunk {llm.engine.config.scheduler.prefill_chunk}"
          f"  peak RSS {peak / 2**30:.2f} GiB")
    print(f"{'tokens':>7} {'cold TTFT s':>12} {'prefill tok/s':>14} {'vs 512':>7} {'warm TTFT s':>12}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['cold_ttft_s']:>12} {r['prefill_tok_s']:>14} {r['vs_512'] or '':>7} "
              f"{r['warm_ttft_s']:>12}")
    emit({"bench": "long_prefill", "model": str(model), "context": llm.engine.max_model_len, "runs": args.runs,
          "append": args.append, "peak_rss_bytes": peak, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
