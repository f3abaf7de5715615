"""``hearth serve``: one model on this machine over HTTP (OpenAI, Anthropic) and gRPC. No Ray."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path

from hearth.cli.flags import engine_config, serving_config
from hearth.config import ServingConfig
from hearth.engine.checkpoint.demo import DEMO_NAME, demo_model_dir
from hearth.engine.checkpoint.dispatch import load_config
from hearth.serving.server import build_state, configure_logging, serve_async

STILL_LOADING_S = 30.0  # how often a start that is not ready yet reports where it is


def run_serve(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else demo_model_dir()
    if not model.is_dir() and not (model.suffix == ".gguf" and model.is_file()):
        raise FileNotFoundError(f"{model}: no such checkpoint directory or GGUF file")
    default_name = DEMO_NAME if args.model is None else model.stem if model.is_file() else model.name
    names = args.served_model_name or [default_name]
    serving = serving_config(args, served_model_name=names)
    engine = engine_config(args)
    load_config(model)  # an unsupported or broken config is refused before the server starts
    configure_logging(serving.log_format)
    state = build_state(model, engine, serving, show_progress=True)
    started = threading.Event()
    threading.Thread(target=_announce, args=(state, serving, model, started), daemon=True).start()
    try:
        asyncio.run(_serve(state, serving, started))
    finally:
        state.close()
    return 0


async def _serve(state, options: ServingConfig, started: threading.Event) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_async(state, options, started, stop)


def _announce(state, options: ServingConfig, model: Path, started: threading.Event) -> None:
    """Print where to connect once the listener is up, then when the model is ready."""
    start = time.monotonic()
    started.wait()
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    base = f"http://{host}:{options.port}"
    name = state.model_name
    key = "<your key>" if options.api_keys() else "unused"
    lines = [
        f"hearth: serving '{name}' from {model}",
        f"  OpenAI API     {base}/v1    (OPENAI_BASE_URL={base}/v1)",
        f"  Anthropic API  {base}       (ANTHROPIC_BASE_URL={base})",
        f"  gRPC           {host}:{options.grpc_port}" if options.grpc_port else "  gRPC           off",
        f"  health         {base}/health    metrics {base}/metrics",
        f"  Claude Code    ANTHROPIC_BASE_URL={base} ANTHROPIC_AUTH_TOKEN={key} ANTHROPIC_MODEL={name} "
        f"ANTHROPIC_SMALL_FAST_MODEL={name} claude",
        f"  OpenCode       provider npm '@ai-sdk/openai-compatible', options.baseURL '{base}/v1', model '{name}'",
        f"  Python         openai.OpenAI(base_url='{base}/v1', api_key='{key}')",
    ]
    if name == DEMO_NAME:
        lines.insert(1, "  (the demo model is small and was trained on Python's standard library: it writes Python)")
    print("\n".join(lines), file=sys.stderr, flush=True)
    try:
        while True:  # a load that takes long says so, so that a stuck start is never silent
            try:
                state.client.wait_ready(STILL_LOADING_S)
                break
            except TimeoutError:
                phase = getattr(state.client, "phase", "loading")
                print(f"hearth: still {phase} after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, and /health says "failed"
        print(f"hearth: error: loading failed: {exc}", file=sys.stderr, flush=True)
    else:
        print(f"hearth: model ready in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        memory = getattr(getattr(state.client, "engine", None), "memory", None)
        if memory is not None:
            print(f"hearth: {memory.describe()}", file=sys.stderr, flush=True)
        print(client_settings(base, name, state.client.model.max_model_len), file=sys.stderr, flush=True)


def output_cap(context: int) -> int:
    """Output tokens an agent should ask for: a quarter of the context, at most 32000 (Claude Code's
    default), so a long conversation still leaves room for its prompt."""
    return max(1, min(32000, context // 4))


def client_settings(base: str, name: str, context: int) -> str:
    """The agent settings that fit the served context (printed once the model is ready)."""
    cap = output_cap(context)
    opencode = {"provider": {"hearth": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{base}/v1"},
                                        "models": {name: {"limit": {"context": context, "output": cap}}}}}}
    return "\n".join([
        f"hearth: context {context} tokens; settings for agents that fit it:",
        f"  Claude Code    CLAUDE_CODE_MAX_OUTPUT_TOKENS={cap} (longer prompts get 'prompt is too long', "
        "and Claude Code compacts)",
        f"  OpenCode       opencode.json: {json.dumps(opencode)}",
    ])
