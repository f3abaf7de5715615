"""Operator endpoints: ``/admin/expert-cache`` reads and resizes the device expert cache (elastic
VRAM) of the engine, or of every replica behind the cluster's router. Behind the API key like
every other route."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from hearth.config import ConfigError, parse_cache_size
from hearth.proto.contracts import EngineNotReady
from hearth.serving.errors import APIError, parse_body
from hearth.serving.status_page import status_snapshot

router = APIRouter()


class ExpertCacheResize(BaseModel):
    """A new size for the device expert cache, in ``--expert-cache``'s forms."""

    model_config = ConfigDict(extra="forbid")
    size: str = Field(max_length=32, description="a fraction of all experts (0.1), bytes (2GiB) or slots (8slots)")
    replica: str | None = Field(None, max_length=200, description="one replica of a cluster (default: all)")


@router.get("/admin/status")
async def status(request: Request) -> dict[str, Any]:
    """The status page's data: machines, replicas (health, load, speed, bandwidths, q table), the
    queue and recent requests."""
    state = request.app.state.hearth
    nodes = await asyncio.to_thread(state.node_provider) if state.node_provider is not None else None
    stages = await asyncio.to_thread(state.stage_provider) if state.stage_provider is not None else None
    return status_snapshot(state, nodes, stages)


@router.get("/admin/expert-cache")
async def expert_cache(request: Request) -> dict[str, Any]:
    """Each replica's cache: slots, bytes, experts held, hit rate (from the engine's latest stats)."""
    client = request.app.state.hearth.client
    return {"object": "expert_cache", "replicas": _cache_view(client.stats())}


@router.post("/admin/expert-cache")
async def resize_expert_cache(request: Request) -> dict[str, Any]:
    """Resize the device expert cache at the next step boundary; requests in flight go on unchanged."""
    body = parse_body(ExpertCacheResize, await request.body())
    try:
        parse_cache_size(body.size)
    except ConfigError as exc:
        raise APIError(400, str(exc).replace("expert_cache", "size", 1), "size") from None
    try:
        resized = await request.app.state.hearth.client.resize_expert_cache(body.size, body.replica)
    except EngineNotReady as exc:
        raise APIError(503, f"the engine is not ready: {exc}") from None
    except LookupError as exc:
        raise APIError(404, exc.args[0] if exc.args else str(exc), "replica") from None
    except ValueError as exc:  # no cache to resize
        raise APIError(400, str(exc), "size") from None
    except MemoryError as exc:  # the device could not hold the new arena (it says what it has now)
        raise APIError(503, str(exc)) from None
    return {"object": "expert_cache.resized", "replicas": resized}


def _cache_view(stats: dict[str, Any]) -> dict[str, Any]:
    """{replica: cache figures} from an engine client's stats (one local engine, or the router's)."""
    engines = {name: r.get("executor", {}) for name, r in stats["replicas"].items()} if "replicas" in stats \
        else {"local": stats}
    view = {}
    for name, engine in engines.items():
        experts = engine.get("experts")
        view[name] = None if not experts else {
            "slots": experts["slots"], "bytes": experts["slots"] * experts["expert_bytes"],
            "expert_bytes": experts["expert_bytes"], "hit_rate": experts["hit_rate"]}
    return view
