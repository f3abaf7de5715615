"""The GPU contact check's acceptance targets, read from its rows (pure: rows in, targets out).

Each target has its value, its goal and whether it is met: True, False, or None when its rows are
missing or failed before giving a value (a run cut short says so instead of passing)."""

from __future__ import annotations

EXACT_PREFIXES = ("exact float32", "family ", "elastic")
SHAPE_DECODE = "shape decode batch={batch} cache={cache} static={mode}"
SHAPE_PREFILL = "shape prefill {tokens}"


def _find(rows: list[dict], check: str) -> dict:
    return next((r for r in rows if r.get("check") == check), {})


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def targets(rows: list[dict], dry: bool) -> list[dict]:
    """The targets of issue 40's acceptance, from the rows of one run."""
    fast = "eager" if dry else "graph"
    exact = [r for r in rows if r.get("check", "").startswith(EXACT_PREFIXES)]
    graph_rows = [r for r in rows if r.get("check", "").startswith("exact float32") and r.get("static") == "graph"]
    skips = [r.get("graph_skips") for r in graph_rows]
    syncs = [r.get("sync_in_replay", "not checked") for r in graph_rows]
    plain = _find(rows, SHAPE_DECODE.format(batch=1, cache="1.0", mode="off"))
    graph = _find(rows, SHAPE_DECODE.format(batch=1, cache="1.0", mode=fast))
    speedup = graph["tok_s"] / plain["tok_s"] if graph.get("tok_s") and plain.get("tok_s") else None
    low = [_find(rows, SHAPE_DECODE.format(batch=1, cache="0.25", mode=m)) for m in ("off", fast)]
    qstar = max((r["qstar_share"] for r in low if r.get("qstar_share")), default=None)
    prefill = _find(rows, SHAPE_PREFILL.format(tokens=512 if dry else 16384)).get("pcie_share")
    resizes = [r for r in rows if r.get("check", "").startswith("elastic")]
    out = [
        ("fp32 exact against the CPU engine", all(r.get("ok") for r in exact) if exact else None, len(exact),
         "every row"),
        ("graph skips in fixed-shape steps", None if not skips or None in skips else sum(skips) == 0,
         skips, "0" if not dry else "0 (dry run: no graphs)"),
        ("host syncs inside a replay", None if dry or not syncs else all(s is None for s in syncs), syncs, "none"),
        ("graph decode / HBM bound, 30B-A3B shape, batch 1, cache 1.0", _at_least(graph.get("hbm_share"), 0.35),
         graph.get("hbm_share"), ">= 0.35"),
        ("graph / plain decode, batch 1, cache 1.0", _at_least(speedup, 1.5), speedup, ">= 1.5"),
        ("decode / q* model bound at cache 0.25", _at_least(qstar, 0.8), qstar, ">= 0.8 (within 1.25x)"),
        ("16k prefill / PCIe bound", _at_least(prefill, 0.8), prefill, ">= 0.8"),
        ("resizes exact", all(r.get("ok") for r in resizes) if resizes else None, len(resizes), "every row"),
    ]
    return [{"target": name, "met": met, "value": _rounded(value), "goal": goal} for name, met, value, goal in out]


def _rounded(value):
    return round(value, 4) if isinstance(value, float) else value
