"""The ``hearth`` command line: the parser, and the single-machine commands that fit in a few lines.

Importing this module loads neither torch nor Ray: each command imports what it runs. Engine and
server flags come from the configuration tree (:mod:`hearth.cli.flags`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hearth.cli.flags import SETTINGS_COMMANDS, add_engine_flags, add_serving_flags, engine_config, expand_settings_file
from hearth.config import ConfigError, parse_bytes


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hearth",
        description="Exact mixture-of-experts inference on the machines you already own.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory, Hugging Face or FTW (default: the bundled demo model)")
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    _add_sampling_args(gen)
    add_engine_flags(gen)
    ins = sub.add_parser("inspect", help="print architecture, parameter and expert counts, bytes per token")
    ins.add_argument("model", help="checkpoint directory (Hugging Face or FTW) or GGUF file")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    conv = sub.add_parser("convert", help="convert a Hugging Face checkpoint or a GGUF file to the FTW format, or "
                                          "quantize a checkpoint into one GGUF file (--quant)")
    conv.add_argument("src", help="Hugging Face checkpoint directory, or a GGUF file (to FTW)")
    conv.add_argument("dst", help="output FTW directory (or FILE.gguf with --quant)")
    conv.add_argument("--dtype", default="auto", help="auto (checkpoint's), float32, bfloat16 (bf16) or float16")
    conv.add_argument("--quant", default=None, metavar="Q",
                      help="write one GGUF file with the weights in Q: q8_0, q6_k, q5_k, q4_k, q4_0, mxfp4, "
                           "the mixes q4_k_m and q5_k_m, or f32/f16/bf16")
    conv.add_argument("--shard-size", default="4GiB", help="largest shard (default 4GiB)")
    prof = sub.add_parser("profile", help="measure B_P and B_H and print the q* table")
    prof.add_argument("--model", required=True, help="checkpoint directory (Hugging Face or FTW)")
    prof.add_argument("--dtype", default="auto")
    prof.add_argument("--virtual-device", action="store_true", help="profile the virtual device's copy path")
    prof.add_argument("--virtual-link-gbps", type=float, default=None)
    prof.add_argument("--vram-limit", type=parse_bytes, default=None, metavar="BYTES",
                      help="plan for at most BYTES of GPU memory (as `serve --vram-limit`)")
    prof.add_argument("--repeats", type=int, default=15, help="timed runs per measurement (median)")
    prof.add_argument("--json", action="store_true", help="machine-readable output")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs and gRPC",
                           description="Serve one model on this machine. Without --model it serves the demo model.")
    serve.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    add_serving_flags(serve)
    add_engine_flags(serve)
    from hearth.cli.bench import add_parser as add_bench_parser
    from hearth.cli.cluster import add_commands

    add_bench_parser(sub)
    add_commands(sub)
    for name in SETTINGS_COMMANDS:
        sub.choices[name].add_argument(
            "--config", metavar="FILE.toml", default=None,
            help="read this command's flags from a TOML file (keys are the flags without '--': port = 8000, "
                 "expert-cache = \"8GiB\"; `models = [...]` for several --model); flags given here win")
    pool = sub.add_parser("pool", help="list or remove shared-memory expert pools")
    pool.add_argument("action", choices=["list", "clean"])
    pool.add_argument("name", nargs="?", help="pool to remove (clean); without it, clean removes pools whose "
                                              "owner process is gone")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from hearth.engine import LLM, SamplingParams
    from hearth.engine.text.tokenizer import render_chat

    config = engine_config(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    if args.model is None:
        from hearth.engine.checkpoint.demo import demo_model_dir

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


def cmd_inspect(args: argparse.Namespace) -> int:
    from hearth.engine.checkpoint.dispatch import load_config
    from hearth.engine.checkpoint.inspect import human_bytes, human_count, stored_summary, summarize

    _, cfg = load_config(args.model)
    s = summarize(cfg)
    stored = stored_summary(args.model, cfg)  # GGUF, FTW, FP8 / MXFP4: the formats as stored
    if args.json:
        print(json.dumps({**s.as_dict(), **({"stored": stored} if stored else {})}, indent=2))
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
        ("KV cache per token", human_bytes(s.kv_bytes_per_token) + (
            f" (latent; expanded K/V would take {human_bytes(s.expanded_kv_bytes_per_token)})"
            if s.expanded_kv_bytes_per_token else "")),
    ]
    if stored is not None:  # the formats as stored, and what a token reads in them
        rows[1] = ("dtype", f"{s.dtype} ({_blocks_note(stored['in_blocks'], s.dtype)})")
        rows += [(f"stored {group}", ", ".join(f"{fmt} {human_bytes(n)}" for fmt, n in sorted(fmts.items())))
                 for group, fmts in sorted(stored["formats"].items())]
        rows.append(("bytes per decode token, as stored", human_bytes(stored["bytes_per_decode_token"])))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _blocks_note(in_blocks: list[str], dtype: str) -> str:
    """What stays in its quantized blocks at run time, for the dtype line of ``hearth inspect``
    (``in_blocks`` is empty where no native kernels run: see ``stored_summary``)."""
    if not in_blocks:
        from hearth.engine.kernels.cpu import cpu_decode_ops

        if cpu_decode_ops() is None:
            return "compute; no weight stays in its blocks here (no native kernels: blocks are decoded at load)"
        return "compute; no weight stays in its blocks here"
    groups = in_blocks[0] if len(in_blocks) == 1 else f"{', '.join(in_blocks[:-1])} and {in_blocks[-1]}"
    return (f"compute; the block-quantized matrices of {groups} stay in their blocks, "
            f"everything else is {dtype}")


def cmd_convert(args: argparse.Namespace) -> int:
    from hearth.engine.checkpoint.dispatch import convert
    from hearth.engine.checkpoint.ftw import read_index

    start = time.perf_counter()
    if args.quant is not None:
        return _convert_gguf(args, start)
    path = convert(args.src, args.dst, None if args.dtype == "auto" else args.dtype,
                   shard_bytes=parse_bytes(args.shard_size), show_progress=True)
    index = read_index(path.parent)
    total = sum(s["bytes"] for s in index["shards"])
    blocks = {e["format"] for e in index["tensors"].values() if "format" in e}
    blocks |= {f for b in (index["banks"].get("blocks") or {}).values() for f in b.values()}
    kept = f" (quantized weights in their blocks: {', '.join(sorted(blocks))})" if blocks else ""
    print(f"wrote {path.parent}: {len(index['shards'])} shard(s), {total / 2**30:.2f} GiB, "
          f"{index['dtype']}{kept}, in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def _convert_gguf(args: argparse.Namespace, start: float) -> int:
    from hearth.engine.checkpoint.gguf_writer import ConvertError, write_gguf

    dst = Path(args.dst)
    if dst.suffix != ".gguf":
        print(f"hearth convert: with --quant the output is one GGUF file; name it FILE.gguf, not {dst}",
              file=sys.stderr)
        return 2
    try:
        write_gguf(args.src, dst, args.quant.lower(), show_progress=True)
    except (ConvertError, FileNotFoundError) as exc:
        dst.unlink(missing_ok=True)
        print(f"hearth convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {dst}: {dst.stat().st_size / 2**30:.2f} GiB, {args.quant}, in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from hearth.cli.profile import run_profile

    return run_profile(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from hearth.cli.serve import run_serve

    return run_serve(args)


def cmd_pool(args: argparse.Namespace) -> int:
    from hearth.engine.experts.mechanism.host_pool import cleanup, list_pools

    pools = list_pools()
    if args.action == "list":
        for p in pools:
            state = "owner alive" if p["owner_alive"] else "owner gone"
            print(f"{p['name']}  {p['bytes'] / 2**20:.1f} MiB  pid {p['owner_pid']} ({state})")
        if not pools:
            print("no hearth shared-memory pools")
        return 0
    names = [args.name] if args.name else [p["name"] for p in pools if not p["owner_alive"]]
    for name in names:
        print(f"{'removed' if cleanup(name) else 'not found'}: {name}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hearth.cli.bench import cmd_bench as run_bench

    return run_bench(args)


def _cluster_handlers() -> dict:
    from hearth.cli.cluster import cmd_down, cmd_drain, cmd_status, cmd_up

    return {"up": cmd_up, "status": cmd_status, "down": cmd_down, "drain": cmd_drain}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_settings_file(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate, "inspect": cmd_inspect, "convert": cmd_convert, "profile": cmd_profile,
                "pool": cmd_pool, "serve": cmd_serve, "bench": cmd_bench, **_cluster_handlers()}
    if args.command not in handlers:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return handlers[args.command](args)
    except (ConfigError, ValueError, FileExistsError, FileNotFoundError, OSError, RuntimeError) as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
