"""The OpenAI Responses endpoint, ``/v1/responses`` (what Codex-style clients use): create,
stream, function tools, reasoning items, structured output, and ``previous_response_id`` over a
bounded in-memory store; ``GET`` / ``DELETE /v1/responses/{id}`` on stored responses.

Input items become chat-template messages (a run of ``function_call`` items one assistant turn
with its tool calls, ``function_call_output`` a tool message, a ``reasoning`` item the next
assistant turn's reasoning) and go through the same frontend, engine and parsers as chat."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hearth.proto.contracts import GenerateRequest, GenerationChunk
from hearth.serving.errors import APIError, check_json_schema, validate_as
from hearth.serving.frontend import OMITTED, ToolMode, parse_arguments, tool_json, tool_mode
from hearth.serving.generation import Reply, collect, stream_reply
from hearth.serving.openai_api import response_schema
from hearth.serving.openai_requests import ResponseFormat
from hearth.serving.parsers import Event
from hearth.serving.responses_format import (
    EventWriter,
    ResponseHead,
    as_messages,
    new_id,
    output_items,
    status_of,
    usage,
)
from hearth.serving.responses_requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)
from hearth.serving.session import session_key
from hearth.serving.transport import Intake, clamp_headers, event_stream, primed, run_unless_disconnected

router = APIRouter()
log = logging.getLogger("hearth.serving")
_MEDIA = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> JSONResponse | StreamingResponse:
    """Create a response: JSON, or a stream of events with ``stream: true``."""
    intake = await Intake.read(request)

    def prepare():  # on an intake thread
        body, scope = intake.open(ResponsesRequest)
        history = _history(intake.state, body.previous_response_id, intake.owner)
        conversation = history + _input_messages(body)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        tools, mode, namespaces = _tools(body)
        fmt = body.text.format if body.text is not None else None
        schema = response_schema(ResponseFormat(type=fmt.type, json_schema=fmt.as_json_schema()),
                                 "text.format") if fmt else None
        effort = body.reasoning.effort if body.reasoning else None
        kwargs = {"enable_thinking": False} if effort in ("none", "minimal") else None
        frontend = scope.frontend
        prompt = frontend.render_chat(messages, tools, mode, kwargs, json_schema=schema,
                                      schema_field="text.format.schema", messages_field="input")
        head = ResponseHead(new_id("resp"), scope.model_name, _echo(body))
        max_tokens = frontend.max_tokens(body.max_output_tokens, len(prompt.ids), "max_output_tokens", head.id)
        params = frontend.sampling(max_tokens, None, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                   grammar=prompt.grammar)
        gen = GenerateRequest(f"resp-{uuid.uuid4().hex}", prompt.ids, params,
                              session_key(intake.session_id, conversation), intake.tenant)
        return scope, body, conversation, namespaces, prompt, head, max_tokens, gen

    scope, body, conversation, namespaces, prompt, head, max_tokens, gen = await intake.prepare(prepare)
    stream = stream_reply(scope, gen, scope.frontend.parser(prompt), "openai", "responses")
    headers = clamp_headers(body.max_output_tokens, max_tokens)
    owner = intake.owner if body.store else None  # whose store keeps it; None: not stored
    if body.stream:
        stream = await primed(request, stream)
        return event_stream(_events(scope, head, owner, conversation, stream, namespaces), headers)
    reply = await run_unless_disconnected(request, collect(stream))
    return JSONResponse(_finish(scope, head, reply, output_items(reply, namespaces), owner, conversation),
                        headers=headers)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
    """A stored response, as it was returned."""
    state = request.app.state.hearth
    found = state.responses.get(response_id, state.owner(request))
    if found is None:  # another key's response reads as absent too: ids do not leak
        raise _not_found(state, response_id, "response_id")
    return found[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    """Forget a stored response (a later previous_response_id naming it is a 404)."""
    state = request.app.state.hearth
    if not state.responses.delete(response_id, state.owner(request)):
        raise _not_found(state, response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(state: Any, response_id: str, field: str) -> APIError:
    return APIError(404, f"{field}: no stored response with id '{response_id}' (responses with store: true are kept "
                         f"in memory only, the newest within {state.responses.max_bytes >> 20} MiB, each for the key "
                         "that stored it)", field, code="response_not_found")


# -- request conversion -------------------------------------------------------------------------
def _history(state: Any, previous: str | None, owner: str) -> list[dict[str, Any]]:
    if previous is None:
        return []
    found = state.responses.get(previous, owner)
    if found is None:
        raise _not_found(state, previous, "previous_response_id")
    return list(found[1])


def _input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item, waiting for the assistant turn it belongs to
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
            reasoning = None  # reasoning belongs to the assistant turn right after it, or none
            out.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": parse_arguments(item.arguments, f"{where}.arguments")}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":  # calls after a reply's text join its turn
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _text(item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            reasoning = None
        else:
            texts = [p.text for p in (item.content or item.summary)]
            reasoning = "\n".join(texts)
    return out


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type == "refusal":
            parts.append(part.refusal)
        elif part.type in _MEDIA:
            parts.append(OMITTED[_MEDIA[part.type]])
        else:
            parts.append(part.text)
    return "".join(parts)


def _function_tools(raw: list[dict[str, Any]], where: str,
                    namespace: str | None = None) -> list[tuple[FunctionTool, str | None]]:
    """The function tools of a request, each with its namespace (``namespace`` tools are opened:
    the model sees their functions, and a call names its namespace again). Hosted tools
    (``web_search``, ``file_search``, ``code_interpreter``, ...) and ``custom`` tools run on
    OpenAI's side or need a free-form format; Codex sends some by default, so they are left out
    (and logged) rather than refused."""
    out: list[tuple[FunctionTool, str | None]] = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append((validate_as(FunctionTool, tool, f"{where}.{i}"), namespace))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            out += _function_tools(tool["tools"], f"{where}.{i}.tools", tool.get("name"))
        elif isinstance(kind, str):
            log.info("responses: tool of type '%s' left out (not run by this server)", kind,
                     extra={"fields": {"field": f"{where}.{i}", "type": kind}})
        else:
            raise APIError(400, f"{where}.{i}.type: a tool needs a type", f"{where}.{i}.type")
    return out


def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, ToolMode, dict[str, str]]:
    """The tools in the chat-template format, the tool mode, and each namespaced tool's namespace."""
    tools: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for tool, namespace in _function_tools(body.tools or [], "tools"):
        if any(t["function"]["name"] == tool.name for t in tools):
            raise APIError(400, f"tools: two tools are named '{tool.name}'", "tools")
        if tool.parameters is not None:
            check_json_schema(tool.parameters, f"tools.{tool.name}.parameters")
        tools.append(tool_json(tool.name, tool.description, tool.parameters))
        if namespace:
            namespaces[tool.name] = namespace
    choice = body.tool_choice
    if isinstance(choice, str) or choice is None:
        return tools or None, tool_mode(choice, None, tools), namespaces
    return tools or None, tool_mode(None, choice.name, tools), namespaces


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request fields every response object repeats."""
    fields = body.model_dump(mode="json", by_alias=True, include={
        "instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p", "tools", "tool_choice",
        "metadata", "store", "parallel_tool_calls", "reasoning", "text", "user"})
    fields["tool_choice"] = fields.get("tool_choice") or "auto"
    fields["tools"] = fields.get("tools") or []
    fields["parallel_tool_calls"] = bool(fields.get("parallel_tool_calls", True))
    fields["text"] = fields.get("text") or {"format": {"type": "text"}}
    fields["metadata"] = fields.get("metadata") or {}
    fields["truncation"] = "disabled"
    return fields


# -- responses ----------------------------------------------------------------------------------
def _finish(state: Any, head: ResponseHead, reply: Reply, items: list[dict[str, Any]], owner: str | None,
            conversation: list[dict[str, Any]]) -> dict[str, Any]:
    status, incomplete = status_of(reply)
    reasoning_tokens = len(state.frontend.encode(reply.reasoning)) if reply.reasoning else 0
    body = head.body(status, items, usage(reply, reasoning_tokens), incomplete)
    if owner is not None and not state.responses.put(body, conversation + as_messages(items), owner):
        log.info("responses: %s not stored (larger than the store's %d bytes)", head.id, state.responses.max_bytes)
    return body


async def _events(state: Any, head: ResponseHead, owner: str | None, conversation: list[dict[str, Any]],
                  stream: AsyncIterator[tuple[list[Event], GenerationChunk]],
                  namespaces: dict[str, str]) -> AsyncIterator[str]:
    writer = EventWriter(namespaces)
    start = head.body("in_progress", [])
    yield writer.emit("response.created", response=start)
    yield writer.emit("response.in_progress", response=start)
    reply = Reply()
    try:
        async for events, chunk in stream:
            for event in events:
                for line in writer.write(event):
                    yield line
            reply.add([], chunk)
    except APIError as exc:  # the engine lost this request: say so, then end the stream as failed
        error = {"code": exc.code or "server_error", "message": exc.message}
        yield writer.emit("error", param=exc.param, **error)
        yield writer.emit("response.failed", response={**head.body("failed", writer.items), "error": error})
        return
    for line in writer.close():
        yield line
    if not any(i["type"] in ("message", "function_call") for i in writer.items):
        for line in writer.empty_message():  # as the non-streamed output: a reply is at least a message
            yield line
    reply.reasoning = "".join(i["content"][0]["text"] for i in writer.items if i["type"] == "reasoning")
    body = _finish(state, head, reply, writer.items, owner, conversation)
    yield writer.emit("response.completed" if body["status"] == "completed" else "response.incomplete",
                      response=body)
