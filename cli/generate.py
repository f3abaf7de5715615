"""``hearth generate``: one prompt through the engine in this process, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from hearth.cli.flags import engine_config
from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.demo import demo_model_dir
from hearth.engine.text.tokenizer import render_chat


def cmd_generate(args: argparse.Namespace) -> int:
    """``hearth generate``: the completion streamed to the terminal, then its speed."""
    config = engine_config(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    if args.model is None:
        args.model = str(demo_model_dir())
    llm = LLM(args.model, show_progress=True, config=config)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = render_chat(llm.tokenizer, [{"role": "user", "content": prompt}])
    start = time.perf_counter()
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    _print_speed(last, start)
    _print_expert_stats(llm.engine.stats().get("experts"))
    llm.engine.close()
    return 0


def _print_expert_stats(stats: dict | None) -> None:
    if not stats:
        return
    print(
        f"[experts: {stats['slots']} cache slots, hit rate {stats['hit_rate']:.1%}, "
        f"{stats['fills']} fills ({stats['fill_bytes'] / 2**20:.1f} MiB), {stats['cpu']} on CPU, "
        f"{stats['evictions']} evictions]",
        file=sys.stderr,
    )
    if stats.get("prefill_streamed_steps"):
        print(f"[prefill: {stats['prefill_streamed_steps']} steps streamed whole layers through "
              f"{stats['prefill_buffers']} buffer(s), {stats['prefill_copy_bytes'] / 2**20:.1f} MiB copied in "
              f"{stats['prefill_copy_seconds']:.2f} s, {stats['prefill_hidden_share']:.0%} of it hidden "
              "behind compute]",
              file=sys.stderr)


def _print_speed(out, start: float) -> None:
    if out is None or out.metrics is None:
        return
    t = out.metrics.timings()
    print(
        f"[prompt: {out.metrics.num_prompt_tokens} tokens, {t['prompt_per_second']:.1f} tok/s | "
        f"decode: {t['predicted_n']} tokens, {t['predicted_per_second']:.1f} tok/s | "
        f"finish: {out.finish_reason} | total {time.perf_counter() - start:.2f} s]",
        file=sys.stderr,
    )
