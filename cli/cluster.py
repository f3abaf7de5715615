"""``hearth up``, ``status``, ``drain`` and ``down``: their flags, ``--model [NAME=]DIR``, and the
table ``hearth status`` prints. Light (no Ray): the parser is built from here on every command; the
commands themselves run in :mod:`hearth.cli.deploy`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hearth.cli.flags import add_engine_flags, add_serving_flags

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


def model_arg(value: str) -> tuple[str, Path]:
    """``--model [NAME=]DIR`` -> (name, directory)."""
    name, sep, path = value.partition("=")
    if not sep or "/" in name or not name:  # a plain path (which may itself hold "=")
        return Path(value).name, Path(value)
    return name, Path(path)


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
