"""HTTP plumbing shared by the protocols: a generation request's intake, server-sent events and
client-disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from hearth.serving.errors import parse_body

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)
_DISCONNECT_POLL_S = 0.25
_PRIME_WAIT_S = 1.0  # how long a stream's start may wait for its first item before the response starts
KEEPALIVE_S = 5.0  # the longest a stream stays silent: then an SSE comment goes out


class ClientGone(Exception):  # noqa: N818 - an event, not an error
    """The client closed its connection before its answer was ready (the work for it is cancelled).
    The app answers it with one info line in the log (``app.create_app``), not a traceback."""


@dataclass(frozen=True)
class Intake:
    """What a generation endpoint reads of its request on the event loop: the server's state, the
    raw body, the ``x-session-id`` header, the request's tenant and the owner of what it stores. The
    body is parsed on an intake thread, by :meth:`open` inside the function given to :meth:`prepare`."""

    state: Any
    raw: bytes
    session_id: str | None
    tenant: str
    owner: str = ""

    @classmethod
    async def read(cls, request: Request) -> Intake:
        state = request.app.state.hearth
        raw, session_id = await request.body(), request.headers.get("x-session-id")
        return cls(state, raw, session_id, state.tenant(request), state.owner(request))

    def open(self, model: type[B]) -> tuple[B, Any]:
        """The validated body, and the scope of the served model it names (on the intake thread)."""
        body = parse_body(model, self.raw)
        return body, self.state.check_model(body.model)

    async def prepare(self, fn: Callable[[], T]) -> T:
        """``fn()`` on an intake thread (``ServerState.prepare``), sized by the body."""
        return await self.state.prepare(fn, len(self.raw))


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
    and frees its KV) and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def primed(request: Request, stream: AsyncIterator[T], wait: float = _PRIME_WAIT_S) -> AsyncIterator[T]:
    """Start ``stream`` before the response does, so that an error in its first ``wait`` seconds
    (queue full, a prompt the engine refuses) still becomes a proper status code; then yield
    everything, the first item included. A stream with nothing yet after ``wait`` (queued behind
    other requests) starts anyway: :func:`event_stream` keeps its connection alive until it runs."""
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(anext(stream))
    deadline = loop.time() + wait
    try:
        while not first.done() and loop.time() < deadline:
            await asyncio.wait({first}, timeout=min(_DISCONNECT_POLL_S, max(deadline - loop.time(), 0.0)))
            if not first.done() and await request.is_disconnected():
                raise ClientGone("client disconnected")
    except BaseException:
        first.cancel()
        raise
    if first.done():
        return prepend(first.result(), stream)
    return _after(first, stream)


async def _after(first: asyncio.Future, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """What ``first`` resolves to, then everything ``rest`` yields (``first`` cancelled if the
    consumer leaves before it resolves)."""
    try:
        item = await first
    finally:
        if not first.done():
            first.cancel()
    yield item
    async for item in rest:
        yield item


async def keep_alive(events: AsyncIterator[str], interval: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """``events`` (server-sent event text), with an SSE comment line whenever ``interval`` seconds
    pass without one: a request queued behind others, or waiting on a long prefill, keeps its
    connection and the client's read timeout alive (SSE clients ignore comments).

    A task reads ``events`` into a queue and a timer adds the comments, so that each event costs a
    queue hand-off (~2 us) rather than a task and a timed wait of its own (~10 us, every token)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue = asyncio.Queue()
    last = loop.time()

    async def pump() -> None:
        try:
            async for item in events:
                ready.put_nowait(item)
            ready.put_nowait(_END)
        except BaseException as exc:  # noqa: BLE001 - raised again where the events are read
            ready.put_nowait(_Raised(exc))

    def tick() -> None:
        nonlocal timer
        due = last + interval - loop.time()
        if due <= 0:
            ready.put_nowait(": keep-alive\n\n")
            due = interval
        timer = loop.call_later(due, tick)

    pumping = asyncio.ensure_future(pump())
    timer = loop.call_later(interval, tick)
    try:
        while (item := await ready.get()) is not _END:
            if isinstance(item, _Raised):
                raise item.exc
            last = loop.time()
            yield item
    finally:
        timer.cancel()
        pumping.cancel()


_END = object()  # the events ended


@dataclass(frozen=True)
class _Raised:
    exc: BaseException  # what reading the events raised


def event_stream(events: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    """The streaming response of ``events``, kept alive (:func:`keep_alive`)."""
    return StreamingResponse(keep_alive(events, KEEPALIVE_S), media_type="text/event-stream", headers=headers)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first``, then everything ``rest`` yields."""
    yield first
    async for item in rest:
        yield item
