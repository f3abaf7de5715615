"""The cluster API: requests from Ray drivers, jobs and Ray clients, handled inside the router.

A request is a plain dict (it crosses Ray): ``{"prompt": str | [ids]}`` or ``{"messages": [...]}``
with optional sampling fields. The answer is a dict too; bad input gives ``{"error": {...}}``
with the same status and message the HTTP API would give, never an exception, so one bad line of
a batch does not fail the batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from hearth.proto.contracts import GenerateRequest
from hearth.serving.errors import APIError
from hearth.serving.frontend import ToolMode
from hearth.serving.generation import Reply, stream_reply
from hearth.serving.session import session_key

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "ignore_eos", "logit_bias")
_KNOWN = {"prompt", "messages", "max_tokens", "stop", "session_id", "id", "model", *SAMPLING_FIELDS}


def _build(state: Any, request: dict[str, Any]) -> tuple[Any, GenerateRequest, Any]:
    """(the model's scope, the engine request, its reply parser); ``model`` defaults to the first served."""
    unknown = sorted(set(request) - _KNOWN)
    if unknown:
        raise APIError(400, f"unknown field(s) {unknown}; known: {sorted(_KNOWN)}", unknown[0])
    scope = state.check_model(request.get("model") or state.model_name)
    frontend = scope.frontend
    messages = request.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages: give a non-empty list of {role, content}", "messages")
        rendered = frontend.render_chat(messages, None, ToolMode("none"))
        ids, parser = rendered.ids, frontend.parser(rendered)
    elif "prompt" in request:
        ids, parser = frontend.prompt_ids(request["prompt"], "prompt"), None
    else:
        raise APIError(400, "give 'prompt' or 'messages'", "prompt")
    max_tokens = frontend.max_tokens(request.get("max_tokens", 256), len(ids), "max_tokens")
    params = frontend.sampling(max_tokens, request.get("stop"), **{f: request.get(f) for f in SAMPLING_FIELDS})
    key = session_key(request.get("session_id"), messages, ids)
    return scope, GenerateRequest(f"ray-{uuid.uuid4().hex}", ids, params, key), parser


async def run_request(state: Any, request: dict[str, Any],
                      on_delta: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run one request through the router's engine client; ``on_delta`` gets each step's text."""
    reply = Reply()
    try:
        scope, gen, parser = _build(state, request)
        async for events, chunk in stream_reply(scope, gen, parser, "openai", "ray"):
            reply.add(events, chunk)
            if on_delta is not None and chunk.token_ids:
                on_delta({"text": chunk.text, "token_ids": list(chunk.token_ids)})
    except APIError as exc:
        return {"id": request.get("id"), "error": {"status": exc.status, "message": exc.message}}
    return {
        "id": request.get("id"), "text": reply.content, "reasoning": reply.reasoning or None,
        "token_ids": reply.token_ids, "finish_reason": reply.finish_reason,
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                  "cached_tokens": reply.cached_tokens},
        "timings": reply.timings,
    }
