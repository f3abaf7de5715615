"""OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hearth.proto.contracts import GenerateRequest
from hearth.serving.errors import APIError, check_json_schema, parse_body
from hearth.serving.frontend import ToolMode, parse_arguments, tool_json
from hearth.serving.generation import Reply, collect, stream_reply
from hearth.serving.openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from hearth.serving.parsers import ToolCall
from hearth.serving.session import session_key
from hearth.serving.transport import primed, run_unless_disconnected, sse

router = APIRouter()

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
B = TypeVar("B", ChatCompletionRequest, CompletionRequest)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state.hearth
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": state.client.model.created, "owned_by": "hearth",
         "max_model_len": state.client.model.max_model_len} for name in state.model_names]}


async def _open(request: Request, model: type[B]) -> tuple[Any, B]:
    """The server state and the validated body, for a served model and supported fields."""
    state = request.app.state.hearth
    body = parse_body(model, await request.body())
    state.check_model(body.model)
    if body.logprobs:
        raise APIError(400, "logprobs: log probabilities are not supported", "logprobs")
    return state, body


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, body = await _open(request, ChatCompletionRequest)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format: only 'text' is supported", "response_format")
    tools, mode = _tools(body)
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    prompt = state.frontend.render_chat(messages, tools, mode, body.chat_template_kwargs)
    params = _sampling(state, body, prompt.ids, body.max_completion_tokens or body.max_tokens,
                       "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    session = session_key(request.headers.get("x-session-id"), messages)
    gen = GenerateRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt.ids, params, session)
    stream = stream_reply(state, gen, state.frontend.parser(prompt), "openai", "chat")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = await primed(request, stream)
        return StreamingResponse(_chat_events(state, gen.request_id, stream, include_usage),
                                 media_type="text/event-stream")
    reply = await run_unless_disconnected(request, collect(stream))
    return JSONResponse(_chat_response(state, gen.request_id, reply))


@router.post("/v1/completions")
async def completions(request: Request):
    state, body = await _open(request, CompletionRequest)
    if body.echo or body.suffix:
        raise APIError(400, "echo and suffix are not supported", "echo" if body.echo else "suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "prompt: give one prompt per request (n = 1)", "prompt")
        prompt = prompt[0]
    ids = state.frontend.prompt_ids(prompt, "prompt")
    params = _sampling(state, body, ids, body.max_tokens, "max_tokens", default_tokens=16)
    gen = GenerateRequest(f"cmpl-{uuid.uuid4().hex}", ids, params,
                          session_key(request.headers.get("x-session-id"), prompt_ids=ids))
    stream = stream_reply(state, gen, None, "openai", "completions")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = await primed(request, stream)
        return StreamingResponse(_completion_events(state, gen.request_id, stream, include_usage,
                                                    body.return_token_ids),
                                 media_type="text/event-stream")
    reply = await run_unless_disconnected(request, collect(stream))
    choice = {"index": 0, "text": reply.content, "logprobs": None,
              "finish_reason": FINISH.get(reply.finish_reason, "stop")}
    if body.return_token_ids:
        choice["token_ids"] = reply.token_ids
    return JSONResponse({
        "id": gen.request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": [choice], "usage": _usage(reply), "timings": reply.timings,
    })


# -- request conversion -------------------------------------------------------------------------
def _tools(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, ToolMode]:
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"tools.{i}.function.parameters")
            tools.append(tool_json(tool.function.name, tool.function.description, tool.function.parameters))
    choice = body.tool_choice
    if choice is None:
        return tools, ToolMode("auto")
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise APIError(400, f"tool_choice: '{choice}' needs tools", "tool_choice")
        return tools, ToolMode(choice)
    names = [t["function"]["name"] for t in tools or []]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool named '{choice.function.name}'", "tool_choice")
    return tools, ToolMode("named", choice.function.name)


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m, i)}
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                           f"messages.{i}.tool_calls")
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {
                "name": c.function.name,
                "arguments": parse_arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"),
            }} for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def _text(m: ChatMessage, i: int) -> str:
    if m.content is None:
        if m.role != "assistant":
            raise APIError(400, f"messages.{i}.content: required for {m.role} messages", f"messages.{i}.content")
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise APIError(400, f"messages.{i}.content.{j}: {part.type} input is not supported by this server",
                           f"messages.{i}.content.{j}.type")
        parts.append(part.text)
    return "".join(parts)


def _sampling(state: Any, body: SamplingFields, prompt_ids: list[int], requested: int | None, field: str,
              default_tokens: int | None = None):
    frontend = state.frontend
    max_tokens = frontend.max_tokens(requested if requested is not None else default_tokens, len(prompt_ids), field)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return frontend.sampling(
        max_tokens, stop, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos or None,
    )


# -- responses ----------------------------------------------------------------------------------
def _usage(reply: Reply) -> dict[str, Any]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens}}


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


def _finish(reply_reason: str | None, has_tools: bool) -> str:
    if has_tools and reply_reason == "stop":
        return "tool_calls"
    return FINISH.get(reply_reason or "stop", "stop")


def _chat_response(state: Any, request_id: str, reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content if reply.content or not
                               reply.tool_calls else None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_json(c) for c in reply.tool_calls]
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish(reply.finish_reason, bool(reply.tool_calls))}],
        "usage": _usage(reply), "timings": reply.timings,
    }


async def _chat_events(state: Any, request_id: str, stream: AsyncIterator, include_usage: bool):
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": state.model_name, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                            "finish_reason": finish}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    reply, calls = Reply(), 0
    try:
        async for events, gen_chunk in stream:
            for e in events:
                if e.kind == "reasoning":
                    yield chunk({"reasoning_content": e.text})
                elif e.kind == "content":
                    yield chunk({"content": e.text})
                else:
                    yield chunk({"tool_calls": [_tool_call_json(e.tool_call, calls)]})
                    calls += 1
            if gen_chunk.finished:
                reply.add([], gen_chunk)
                yield chunk({}, _finish(gen_chunk.finish_reason, calls > 0), timings=reply.timings)
    except APIError as exc:  # after the response started: one error event ends the stream
        yield sse(exc.openai_body())
        return
    if include_usage:
        yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                   "model": state.model_name, "choices": [], "usage": _usage(reply)})
    yield "data: [DONE]\n\n"


async def _completion_events(state: Any, request_id: str, stream: AsyncIterator, include_usage: bool,
                             token_ids: bool):
    created = int(time.time())
    reply = Reply()
    try:
        async for events, gen_chunk in stream:
            text = "".join(e.text for e in events)
            finish = FINISH.get(gen_chunk.finish_reason, "stop") if gen_chunk.finished else None
            if not (text or finish or token_ids):
                continue
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if token_ids:
                choice["token_ids"] = gen_chunk.token_ids
            extra = {}
            if finish:
                reply.add([], gen_chunk)
                extra = {"timings": reply.timings}
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": state.model_name,
                       "choices": [choice], **extra})
    except APIError as exc:
        yield sse(exc.openai_body())
        return
    if include_usage:
        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [], "usage": _usage(reply)})
    yield "data: [DONE]\n\n"
