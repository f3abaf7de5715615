"""Decode and prefill throughput of hearth's engine against transformers.

Both run on the same checkpoint, in the same process, on the same prompt, alternating run by
run, through the same runners as ``hearth bench --transformers`` (``hearth.cli.bench_backends``);
the table reports medians over ``--runs`` repetitions and the ratio hearth / transformers.

    python bench/decode.py --model DIR [--prompt-len 128] [--gen 64] [--runs 3] [--dtype bfloat16]
    python bench/decode.py --build-random /tmp/qwen3-1b   # ~1B random Qwen3-MoE, then benchmark it
    python bench/decode.py --build-random /tmp/dsv3-1b --family deepseek_v3   # ~1B DeepSeek-V3 shape (MLA)

With ``--cache-fraction F [F ...]`` it benchmarks the expert hierarchy instead: the plain engine
against a virtual-device expert cache of each size (``--virtual-link-gbps`` rate-limits its copy
path), reporting decode tok/s, hit rate, fills and CPU experts per token, and the share of the
host bandwidth B_H (measured with the real CPU expert kernel) that the CPU expert path reaches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from hearth.engine.checkpoint.dispatch import load_config  # noqa: E402
from hearth.engine.checkpoint.inspect import human_bytes, summarize  # noqa: E402

RANDOM_1B = {
    "qwen3_moe": dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=2048,
        norm_topk_prob=True, initializer_range=0.02,
    ),
    # DeepSeek-V3's layout scaled down (0.9B): MLA with query LoRA, one dense layer first, 64 experts in 8
    # groups (4 chosen), 6 routed plus a shared expert.
    "deepseek_v3": dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=256, intermediate_size=2816, n_shared_experts=1,
        first_k_dense_replace=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, initializer_range=0.02,
    ),
}


def build_random(path: Path, dtype: str, family: str = "qwen3_moe") -> None:
    from tests.checkpoints import make_checkpoint

    if (path / "config.json").is_file():
        return
    print(f"building a ~1B random {family} in {path} …", file=sys.stderr)
    make_checkpoint(path, family, "per_expert", dtype, shard_bytes=1 << 30, vocab_size=32000, **RANDOM_1B[family])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--build-random", type=Path, help="create a ~1B random model here (if absent) and use it")
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(RANDOM_1B), help="its family (--build-random)")
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
        build_random(args.build_random, args.dtype, args.family)
        args.model = args.build_random
    if args.model is None:
        ap.error("give --model or --build-random")

    if args.cache_fraction is not None:
        from bench.hierarchy_sweep import run_sweep

        return run_sweep(args)

    # The runners of `hearth bench`, interleaved run by run so that a drifting machine affects both alike.
    from hearth.cli.bench_backends import engine_runner, transformers_runner

    _, cfg = load_config(args.model, getattr(torch, args.dtype))
    summary = summarize(cfg)
    samples: dict[str, list[dict[str, float]]] = {"hearth": [], "transformers": []}
    with engine_runner(str(args.model), args.dtype, args.prompt_len + args.gen + 16, args.prompt_len, {}) as ours:
        theirs = transformers_runner(str(args.model), args.dtype)
        ours(0, 16, 4)  # warm-up both
        theirs(0, 16, 4)
        for _ in range(args.runs):
            samples["hearth"].append(ours(0, args.prompt_len, args.gen))
            samples["transformers"].append(theirs(0, args.prompt_len, args.gen))
    result = {
        "model": str(args.model), "dtype": args.dtype, "prompt_len": args.prompt_len, "gen": args.gen,
        "runs": args.runs, "threads": torch.get_num_threads(),
        "bytes_per_decode_token": summary.bytes_per_decode_token,
        "total_params": summary.total_params, "active_params": summary.active_params_per_token,
        "kv_bytes_per_token": summary.kv_bytes_per_token,
        "expanded_kv_bytes_per_token": summary.expanded_kv_bytes_per_token,
    }
    for name, runs in samples.items():
        result[name] = {"prefill_tok_s": statistics.median(r["pp"] for r in runs),
                        "decode_tok_s": statistics.median(r["tg"] for r in runs),
                        "decode_tok_s_all": [r["tg"] for r in runs], "prefill_tok_s_all": [r["pp"] for r in runs]}
    h, t = result["hearth"], result["transformers"]
    result["decode_ratio"] = h["decode_tok_s"] / t["decode_tok_s"]
    result["prefill_ratio"] = h["prefill_tok_s"] / t["prefill_tok_s"]
    bw = summary.bytes_per_decode_token * h["decode_tok_s"]
    print(f"\nmodel {args.model} ({cfg.architecture}, {args.dtype}, {torch.get_num_threads()} threads), "
          f"prompt {args.prompt_len}, generate {args.gen}, median of {args.runs}")
    print(f"bytes read per decode token: {human_bytes(summary.bytes_per_decode_token)} "
          f"(hearth streams {bw / 1e9:.2f} GB/s of weights)")
    kv_line = f"KV cache per token: {human_bytes(summary.kv_bytes_per_token)}"
    if result["expanded_kv_bytes_per_token"]:
        expanded = result["expanded_kv_bytes_per_token"]
        kv_line += (f" (latent + rotary key) against {human_bytes(expanded)} of expanded K/V: "
                    f"{expanded / summary.kv_bytes_per_token:.1f}x smaller")
    print(kv_line + "\n")
    print("| engine       | prefill tok/s | decode tok/s |")
    print("|--------------|---------------|--------------|")
    for name in samples:
        print(f"| {name:<12} | {result[name]['prefill_tok_s']:13.1f} | {result[name]['decode_tok_s']:12.2f} |")
    print(f"| ratio        | {result['prefill_ratio']:12.2f}x | {result['decode_ratio']:11.2f}x |")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
