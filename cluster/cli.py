"""The ``hearth`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.config import ConfigError


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto (checkpoint's), float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None, help="longest context (default: model's, ≤32k)")
    g.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill chunk")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hearth",
        description="Exact mixture-of-experts inference on the machines you already own.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    gen.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    _add_sampling_args(gen)
    _add_engine_args(gen)
    ins = sub.add_parser("inspect", help="print architecture, parameter and expert counts, bytes per token")
    ins.add_argument("model", help="checkpoint directory")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from engine import LLM, SamplingParams
    from engine.tokenizer import render_chat

    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, show_progress=True, dtype=args.dtype, max_model_len=args.max_model_len,
              prefill_chunk=args.prefill_chunk, max_num_batched_tokens=max(args.prefill_chunk, 2048))
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
    return 0


def _print_speed(out, start: float) -> None:
    if out is None or out.metrics is None:
        return
    m = out.metrics
    prefill_s = max(m.first_token - m.arrival, 1e-9)
    decode_s = max(m.finished - m.first_token, 1e-9)
    decode_tokens = max(m.num_output_tokens - 1, 0)
    print(
        f"[prompt: {m.num_prompt_tokens} tokens, {m.num_prompt_tokens / prefill_s:.1f} tok/s | "
        f"decode: {m.num_output_tokens} tokens, {decode_tokens / decode_s:.1f} tok/s | "
        f"finish: {out.finish_reason} | total {time.perf_counter() - start:.2f} s]",
        file=sys.stderr,
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.inspect import human_bytes, human_count, summarize
    from engine.loader import load_config

    _, cfg = load_config(args.model)
    s = summarize(cfg)
    if args.json:
        print(json.dumps(s.as_dict(), indent=2))
        return 0
    rows = [
        ("architecture", s.architecture),
        ("dtype", s.dtype),
        ("layers (MoE)", f"{s.num_layers} ({s.num_moe_layers})"),
        ("experts per layer / top-k", f"{s.num_experts} / {s.top_k}"),
        ("parameters", f"{human_count(s.total_params)} total, {human_count(s.expert_params)} in experts"),
        ("active per token", human_count(s.active_params_per_token)),
        ("expert size", human_bytes(s.expert_bytes)),
        ("expert pool", human_bytes(s.expert_pool_bytes)),
        ("bytes per decode token", human_bytes(s.bytes_per_decode_token)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate, "inspect": cmd_inspect}
    if args.command not in handlers:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return handlers[args.command](args)
    except (ConfigError, ValueError) as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
