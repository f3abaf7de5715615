"""The status page: one static HTML file (``static/status.html``, no build step, nothing from a CDN)
that polls ``/admin/status`` once a second, and the snapshot that endpoint returns. The snapshot
reads the same engine statistics as ``/metrics``: machines (RAM, GPUs and VRAM; a cluster's router
supplies them), replicas with their health (and the pipeline stages of a split model), load,
decode speed, cache hit rate, live bandwidths B_P and B_H and q table, the queue, and the most
recent requests."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any


@functools.cache
def status_page_html() -> str:
    return (Path(__file__).parent / "static" / "status.html").read_text()


def status_snapshot(state: Any, nodes: list[dict[str, Any]] | None,
                    stages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What the page shows, from ``state``'s engine client(s), ``nodes`` (None: no machine list) and
    ``stages`` (a model split over machines: each stage's machine, layers and health)."""
    stats = state.client.stats()
    engines = stats.get("replicas") or {"local": {"healthy": state.client.ready, "in_flight": stats.get("in_flight", 0),
                                                  "node": "this machine", "executor": stats,
                                                  "decode_tok_s": stats.get("decode_tok_s", 0.0)}}
    replicas = []
    for rid, r in engines.items():
        executor = r.get("executor") or {}
        experts = executor.get("experts") or {}
        replicas.append({
            "id": rid, "model": rid.split("@")[0] if "@" in rid else state.model_name, "node": r.get("node"),
            "healthy": bool(r.get("healthy")), "in_flight": r.get("in_flight", 0),
            "running": executor.get("running", 0), "waiting": executor.get("waiting", 0),
            "decode_tok_s": r.get("decode_tok_s") or 0.0, "hit_rate": experts.get("hit_rate"),
            "b_p": experts.get("b_p"), "b_h": experts.get("b_h"), "qtable": experts.get("qtable"),
            "cache_slots": experts.get("slots"),
            "prefix_hit": (r["cached_prompt_tokens"] / r["prompt_tokens"]) if r.get("prompt_tokens") else None,
            "error": r.get("last_error")})
    return {
        "time": time.time(),
        "models": [{"name": m.name, "ready": bool(m.client.ready)} for m in state.models],
        "nodes": nodes, "replicas": replicas, "stages": stages or [],
        "queue": {"in_flight": stats.get("in_flight", 0), "running": sum(r["running"] for r in replicas),
                  "waiting": sum(r["waiting"] for r in replicas)},
        "recent": list(state.recent)[::-1][:20],
    }
