"""``hearth up``, ``status``, ``drain`` and ``down`` carried out: connecting to (or starting) the Ray
cluster and calling the deployment. Imported only when one of them runs (their flags are in
:mod:`hearth.cli.cluster`)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import ray

from hearth.cli.cluster import format_status, model_arg
from hearth.cli.flags import engine_options, serving_config
from hearth.cluster.deploy import cluster_status, deploy, find_router
from hearth.cluster.launch import teardown
from hearth.cluster.specs import NAMESPACE, DeployOptions
from hearth.config import cache_dir
from hearth.engine.checkpoint.demo import DEMO_NAME, demo_model_dir
from hearth.engine.checkpoint.dispatch import load_config

_STATE_FILE = "cluster.json"  # records a head node that `hearth up` started itself (stopped by `down`)


def _ray_cli() -> str:
    """The ``ray`` command of this Python environment."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _connect(address: str, start_if_missing: bool = False) -> None:
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        return
    except ConnectionError:
        if not (start_if_missing and address == "auto"):
            raise ConnectionError(f"no Ray cluster at '{address}' (start one with `ray start --head`, "
                                  "see deploy/)") from None
    print("hearth: no Ray cluster running; starting a local head node (`ray start --head`)", file=sys.stderr)
    subprocess.run([_ray_cli(), "start", "--head", "--disable-usage-stats"], check=True, stdout=subprocess.DEVNULL)
    (cache_dir()).mkdir(parents=True, exist_ok=True)
    (cache_dir() / _STATE_FILE).write_text(json.dumps({"started_head": True}))
    ray.init(address="auto", namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)


def cmd_up(args: argparse.Namespace) -> int:
    models = [model_arg(a) for a in args.model] if args.model else [(DEMO_NAME, demo_model_dir())]
    if args.name and len(models) > 1:
        raise ValueError("--name names a single model; with several, give --model NAME=DIR")
    if args.name:
        models = [(args.name, models[0][1])]
    for _, model in models:
        if not model.is_dir():
            raise FileNotFoundError(f"{model}: no such checkpoint directory")
        load_config(model)  # an unsupported or broken config is refused before any Ray work
    names = [name for name, _ in models]
    serving = serving_config(args, served_model_name=names[:1])
    _connect(args.address, start_if_missing=True)
    (name, model), *more = models
    options = DeployOptions(str(model.resolve()), name, serving.host, serving.port, serving.grpc_port,
                            serving.api_key, args.replicas, args.require, engine_options(args),
                            max_waiting=serving.max_waiting, tool_parser=serving.tool_parser,
                            more_models=tuple((str(p.resolve()), n) for n, p in more), stages=args.stages,
                            serving_config=serving)
    desc = deploy(options, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    base = desc["url"]
    print(f"hearth: {', '.join(repr(n) for n in names)} {'is' if len(names) == 1 else 'are'} up: "
          f"{len(desc['replicas'])} replica(s)"
          + (f" in {len(desc['stages'])} pipeline stages" if desc.get("stages") else "") + "\n"
          f"  OpenAI API     {base}/v1\n  Anthropic API  {base}\n"
          f"  gRPC           {'port ' + str(args.grpc_port) if args.grpc_port else 'off'}\n"
          f"  Python         hearth.cluster.connect('{args.address}')\n"
          f"  `hearth status` for the per-machine table, `hearth down` to stop", file=sys.stderr)
    return 0


def _nothing_deployed() -> int:
    print("hearth: nothing is deployed on this cluster", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    _connect(args.address)
    status = cluster_status()
    if status is None:
        return _nothing_deployed()
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    _connect(args.address)
    router = find_router()
    if router is None:
        return _nothing_deployed()
    try:
        done = ray.get(router.drain.remote(args.node, args.timeout), timeout=args.timeout + 60)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, LookupError):
            print(f"hearth: error: {cause.args[0]}", file=sys.stderr)
            return 1
        raise
    left = f"; {done['unfinished']} request(s) still running were cut off" if done["unfinished"] else ""
    print(f"hearth: drained {done['node']}: stopped {', '.join(done['replicas'])}{left}", file=sys.stderr)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _connect(args.address)
    removed = teardown(log=lambda msg: print(msg, file=sys.stderr))
    print(f"hearth: removed {len(removed)} actor(s)" if removed else "hearth: nothing was deployed",
          file=sys.stderr)
    ray.shutdown()
    state = cache_dir() / _STATE_FILE
    if args.address == "auto" and state.exists():
        subprocess.run([_ray_cli(), "stop"], check=False, stdout=subprocess.DEVNULL)
        state.unlink()
        print("hearth: stopped the local Ray head node that `hearth up` started", file=sys.stderr)
    return 0
