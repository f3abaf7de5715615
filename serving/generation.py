"""One reply, shared by every protocol: stream chunks from the engine client through the output
parser, record latency metrics, and accumulate the final result."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hearth.proto.contracts import EngineNotReady, EngineOverloaded, GenerateRequest, GenerationChunk
from hearth.serving.errors import APIError, overloaded
from hearth.serving.parsers import Event, NoToolParser, OutputParser, ToolCall

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

    def add(self, events: list[Event], chunk: GenerationChunk) -> None:
        for e in events:
            if e.kind == "reasoning":
                self.reasoning += e.text
            elif e.kind == "content":
                self.content += e.text
            elif e.tool_call is not None:
                self.tool_calls.append(e.tool_call)
        self.token_ids += chunk.token_ids
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
        raise overloaded(protocol, str(exc)) from None
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
