"""``hearth up``, ``hearth status`` and ``hearth down``: the deployment on a Ray cluster."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hearth.cli.flags import add_engine_flags, add_serving_flags, engine_options, serving_config
from hearth.config import cache_dir

_STATE_FILE = "cluster.json"  # records a head node that `hearth up` started itself (stopped by `down`)
_TYPICAL_M = (1, 2, 4, 8)


def add_commands(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="deploy a model onto a Ray cluster (starting a local one if needed)",
                        description="Place replicas of the model on the cluster's machines and start the router.")
    up.add_argument("--model", action="append", default=None, metavar="[NAME=]DIR",
                    help="checkpoint directory, the same path on every machine (default: the demo model); "
                         "repeat it to serve several models, each by its NAME (default: the directory name)")
    up.add_argument("--name", default=None, help="name clients use for a single model (default: the directory name)")
    _add_address(up)
    up.add_argument("--replicas", type=int, default=None, help="replicas (default: one per machine that fits)")
    up.add_argument("--require", default=None, metavar="LABEL", help="only machines with this Ray resource")
    up.add_argument("--stages", action="store_true",
                    help="split the model by layers over several machines (pipeline stages) even where one "
                         "would hold it; a model that fits no one machine is split without it")
    add_serving_flags(up, skip=frozenset({"served_model_name", "log_format"}))
    add_engine_flags(up, overrides_only=True, skip=frozenset({"host_pool_name", "cpu_experts"}))
    st = sub.add_parser("status", help="per-machine table of the deployment")
    _add_address(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    down = sub.add_parser("down", help="remove everything `hearth up` started")
    _add_address(down)
    drain = sub.add_parser("drain", help="take a machine out: its requests finish, then its replicas stop",
                           description="New requests go elsewhere at once; the machine's replicas finish what "
                                       "they hold (queued requests included), then stop. It gets no replica again "
                                       "while this deployment runs.")
    drain.add_argument("node", help="the machine's name (as `hearth status` shows it) or Ray node id")
    drain.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for its requests (default 600)")
    _add_address(drain)


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto",
                   help="Ray cluster: auto (the running one, else a new local one for `up`), HOST:PORT, "
                        "or ray://HOST:10001 (Ray client)")


def _ray_cli() -> str:
    """The ``ray`` command of this Python environment."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _connect(address: str, start_if_missing: bool = False) -> None:
    import ray

    from hearth.cluster.actors import NAMESPACE

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
    from hearth.cluster.deploy import DeployOptions, deploy
    from hearth.engine.checkpoint.demo import DEMO_NAME, demo_model_dir
    from hearth.engine.checkpoint.dispatch import load_config

    models = [_model_arg(a) for a in args.model] if args.model else [(DEMO_NAME, demo_model_dir())]
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
                            more_models=tuple((str(p.resolve()), n) for n, p in more), stages=args.stages)
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


def _model_arg(value: str) -> tuple[str, Path]:
    """``--model [NAME=]DIR`` -> (name, directory)."""
    name, sep, path = value.partition("=")
    if not sep or "/" in name or not name:  # a plain path (which may itself hold "=")
        return Path(value).name, Path(value)
    return name, Path(path)


def cmd_status(args: argparse.Namespace) -> int:
    from hearth.cluster.deploy import cluster_status

    _connect(args.address)
    status = cluster_status()
    if status is None:
        print("hearth: nothing is deployed on this cluster", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    import ray

    from hearth.cluster.deploy import find_router

    _connect(args.address)
    router = find_router()
    if router is None:
        print("hearth: nothing is deployed on this cluster", file=sys.stderr)
        return 1
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
    import ray

    from hearth.cluster.deploy import teardown

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


def _gbps(value: float | None) -> str:
    return "-" if not value else f"{value / 1e9:.1f}"


def format_status(status: dict[str, Any]) -> str:
    """The per-replica table of ``hearth status``."""
    header = ("REPLICA", "NODE", "STATE", "EXEC", "GPU", "VRAM BUDGET", "B_P GB/s", "B_H GB/s",
              "q(m=" + ",".join(map(str, _TYPICAL_M)) + ")", "HIT", "DECODE tok/s", "ACTIVE")
    rows = [header]
    for r in status["rows"]:
        table = r.get("qtable")
        q = ",".join(str(table[m]) for m in _TYPICAL_M if m < len(table)) if table else "-"
        state = r.get("state", "?") if r.get("healthy", False) or r.get("state") != "ready" else "out"
        rows.append((r["replica"], r["node"], state, r["executor"], "-" if r["gpu"] is None else str(r["gpu"]),
                     f"{r['cache_bytes'] / 2**30:.1f} GiB" if r["cache_bytes"] else "-", _gbps(r.get("b_p")),
                     _gbps(r.get("b_h")), q, "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.0%}",
                     f"{r.get('decode_tok_s') or 0:.1f}", str(r.get("in_flight", 0))))
    models = status.get("models") or [status["model"]]
    lines = [f"model{'s' if len(models) > 1 else ''} {', '.join(models)} at {status['url']}", *_table(rows)]
    stages = [("STAGE", "NODE", "LAYERS", "EXEC", "STATE")] + [
        (f"{t['model']}/{t['index']}", t["node_name"], f"{t['first_layer']}-{t['end_layer'] - 1}", t["executor"],
         "serving" if t["healthy"] else (t.get("error") or "down")) for t in status.get("stage_rows") or []]
    if len(stages) > 1:
        lines += ["", "pipeline stages:", *_table(stages)]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the header first) as lines of left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
