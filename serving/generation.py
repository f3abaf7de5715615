"""One reply, shared by every protocol: stream chunks from the engine client through the output
parser, record latency metrics, and accumulate the final result."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from hearth.proto.contracts import EngineNotReady, EngineOverloaded, GenerateRequest, GenerationChunk, TokenLogprob
from hearth.serving.errors import APIError, overloaded
from hearth.serving.parsers import Event, NoToolParser, ToolCall
from hearth.serving.reply_parsers import OutputParser

log = logging.getLogger("hearth.serving")


@dataclass
class Reply:
    """Everything one request produced."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, events: list[Event], chunk: GenerationChunk) -> None:
        for e in events:
            if e.kind == "reasoning":
                self.reasoning += e.text
            elif e.kind == "content":
                self.content += e.text
            elif e.tool_call is not None:
                self.tool_calls.append(e.tool_call)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or ()
        if chunk.finished:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
            m = chunk.metrics
            self.prompt_tokens, self.completion_tokens = m.num_prompt_tokens, m.num_output_tokens
            self.cached_tokens, self.timings = m.num_cached_tokens, chunk.timings


async def stream_reply(app_state: Any, request: GenerateRequest, parser: OutputParser | None, protocol: str,
                       endpoint: str) -> AsyncIterator[tuple[list[Event], GenerationChunk]]:
    """Yield (parsed events, chunk) per engine step; maps queue and loading errors to API errors
    and keeps the metrics (TTFT, inter-token latency, tokens, outcome)."""
    metrics = app_state.metrics
    parser = parser or NoToolParser()  # raw text completions: everything is content
    start = last = time.perf_counter()
    status = "error"
    first: float | None = None
    final: GenerationChunk | None = None
    try:
        async for chunk in app_state.client.generate(request):
            now = time.perf_counter()
            if chunk.token_ids:
                (metrics.ttft if first is None else metrics.itl).observe(now - last)
                first = now if first is None else first
                last = now
            events = parser.feed(chunk.text)
            if chunk.finished:
                events += parser.flush()
                status, final = "ok", chunk
                metrics.prompt_tokens.inc(chunk.metrics.num_prompt_tokens)
                metrics.generation_tokens.inc(chunk.metrics.num_output_tokens)
                metrics.cached_tokens.inc(chunk.metrics.num_cached_tokens)
                metrics.e2e.observe(now - start)
            yield events, chunk
    except EngineOverloaded as exc:
        status = "rejected"
        metrics.rejected.inc()
        raise overloaded(protocol, str(exc), getattr(exc, "retry_after", 1)) from None
    except EngineNotReady as exc:
        status = "loading"
        raise APIError(503, str(exc)) from None
    except ValueError as exc:  # the engine refused the prompt
        status = "invalid"
        raise APIError(400, str(exc)) from None
    except RuntimeError as exc:  # the engine step failed: this request is lost, the server goes on
        status = "failed"
        raise APIError(500, str(exc)) from None
    finally:
        if status == "error":
            metrics.aborted.inc()
            status = "aborted"
        metrics.requests.labels(endpoint, status).inc()
        recent = getattr(app_state, "recent", None)
        if recent is not None:  # the status page's list of recent requests
            recent.append({"time": time.time(), "id": request.request_id, "model": getattr(app_state, "model_name", ""),
                           "endpoint": endpoint, "status": status, "prompt_tokens": len(request.prompt_ids),
                           "completion_tokens": final.metrics.num_output_tokens if final else 0,
                           "cached_tokens": final.metrics.num_cached_tokens if final else 0,
                           "ttft_ms": round((first - start) * 1e3, 1) if first else None,
                           "ms": round((time.perf_counter() - start) * 1e3, 1)})
        log.info("generation", extra={"fields": {
            "id": request.request_id, "endpoint": endpoint, "status": status,
            "prompt_tokens": len(request.prompt_ids),
            "completion_tokens": final.metrics.num_output_tokens if final else None,
            "finish_reason": final.finish_reason if final else None,
            "ttft_ms": round((first - start) * 1e3, 2) if first else None,
            "ms": round((time.perf_counter() - start) * 1e3, 2)}})


async def collect(stream: AsyncIterator[tuple[list[Event], GenerationChunk]]) -> Reply:
    reply = Reply()
    async for events, chunk in stream:
        reply.add(events, chunk)
    return reply


def samples(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``n`` samples of one request: ids ``ID-i`` and, with a seed, seeds ``seed + i`` (each
    sample reproducible, no two alike)."""
    if n == 1:
        return [request]
    seed = request.params.seed
    return [replace(request, request_id=f"{request.request_id}-{i}",
                    params=replace(request.params, seed=None if seed is None else (seed + i) % 2**64))
            for i in range(n)]


async def fan_out(app_state: Any, requests: list[GenerateRequest], parsers: list[OutputParser | None], protocol: str,
                  endpoint: str) -> AsyncIterator[tuple[int, list[Event], GenerationChunk]]:
    """Run the samples of one request as one stream of (sample index, events, chunk).

    The first sample starts alone. Once its first token is out, its prompt's KV blocks are in
    the prefix cache, and the others start then and reuse them: the prompt is computed once (only
    its last, partial block again per sample)."""
    streams = [stream_reply(app_state, r, p, protocol, endpoint) for r, p in zip(requests, parsers, strict=True)]
    first = await anext(streams[0])
    yield (0, *first)
    if len(streams) == 1:
        async for events, chunk in streams[0]:
            yield 0, events, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield (index, *item)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


async def collect_samples(stream: AsyncIterator[tuple[int, list[Event], GenerationChunk]], n: int) -> list[Reply]:
    replies = [Reply() for _ in range(n)]
    async for index, events, chunk in stream:
        replies[index].add(events, chunk)
    return replies
