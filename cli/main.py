"""The ``hearth`` command line: the parser of every command, and the table of the modules that run
them (:data:`COMMANDS`).

Importing this module loads neither torch nor Ray: a command's module is imported only when that
command runs. Engine and server flags come from the configuration tree (:mod:`hearth.cli.flags`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from hearth.cli.bench import add_parser as add_bench_parser
from hearth.cli.cluster import add_commands as add_cluster_commands
from hearth.cli.flags import SETTINGS_COMMANDS, add_engine_flags, add_serving_flags, expand_settings_file
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
    add_bench_parser(sub)
    add_cluster_commands(sub)
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


# Each command's module and function. A command's module imports what it runs (torch, the engine,
# Ray) at its top, so it is imported only when that command runs: see ``load_command``.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("hearth.cli.generate", "cmd_generate"),
    "inspect": ("hearth.cli.checkpoint", "cmd_inspect"),
    "convert": ("hearth.cli.checkpoint", "cmd_convert"),
    "profile": ("hearth.cli.profile", "run_profile"),
    "serve": ("hearth.cli.serve", "run_serve"),
    "pool": ("hearth.cli.pool", "cmd_pool"),
    "bench": ("hearth.cli.bench_backends", "cmd_bench"),
    "up": ("hearth.cli.deploy", "cmd_up"),
    "status": ("hearth.cli.deploy", "cmd_status"),
    "down": ("hearth.cli.deploy", "cmd_down"),
    "drain": ("hearth.cli.deploy", "cmd_drain"),
}


def load_command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs the command ``name`` (see :data:`COMMANDS`)."""
    module, function = COMMANDS[name]
    # deferred: the commands' modules load torch or Ray, which the parser and the other commands must not
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_settings_file(sys.argv[1:] if argv is None else list(argv), parser)
    except ConfigError as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command not in COMMANDS:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return load_command(args.command)(args)
    except (ConfigError, ValueError, FileExistsError, FileNotFoundError, OSError, RuntimeError) as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
