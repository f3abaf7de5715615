"""HTTP plumbing shared by the protocols: server-sent events and client-disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.25


def clamp_headers(requested: int | None, used: int) -> dict[str, str] | None:
    """Response headers saying that ``max_tokens`` was lowered to what fits the context."""
    if requested is None or requested <= used:
        return None
    return {"x-hearth-max-tokens": str(used), "x-hearth-max-tokens-requested": str(requested)}


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event (``event:`` line only when named, as Anthropic streams use)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (which aborts the engine request
    and frees its KV) and raise CancelledError."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def primed(request: Request, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Start ``stream`` before the response does, so admission errors (queue full, bad prompt)
    still become a proper status code; then yield everything, the first item included."""
    first = await run_unless_disconnected(request, anext(stream))
    return prepend(first, stream)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first``, then everything ``rest`` yields."""
    yield first
    async for item in rest:
        yield item
