"""Anthropic-compatible endpoints: ``/v1/messages`` (plain and streaming) and ``count_tokens``."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hearth.proto.contracts import GenerateRequest
from hearth.serving.anthropic_requests import CountTokensRequest, Message, MessagesRequest
from hearth.serving.errors import APIError, check_json_schema
from hearth.serving.frontend import OMITTED, RenderedPrompt, ToolMode, tool_json, tool_mode
from hearth.serving.generation import Reply, collect, stream_reply
from hearth.serving.parsers import Event
from hearth.serving.session import session_key
from hearth.serving.transport import (
    Intake,
    clamp_headers,
    event_stream,
    prepend,
    primed,
    run_unless_disconnected,
    sse,
)

router = APIRouter()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    intake = await Intake.read(request)

    def prepare() -> int:  # on an intake thread
        body, scope = intake.open(CountTokensRequest)
        return len(_render(scope, body, check_length=False).ids)  # even when too long

    return {"input_tokens": await intake.prepare(prepare)}


@router.post("/v1/messages")
async def messages(request: Request):
    intake = await Intake.read(request)

    def prepare():  # on an intake thread
        body, scope = intake.open(MessagesRequest)
        prompt = _render(scope, body)
        frontend = scope.frontend
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        max_tokens = frontend.max_tokens(body.max_tokens, len(prompt.ids), "max_tokens", message_id)
        params = frontend.sampling(max_tokens, body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
                                   top_k=body.top_k, grammar=prompt.grammar)
        opening = [{"role": "system", "content": body.model_dump(mode="json").get("system")}] if body.system else []
        opening += [m.model_dump(mode="json") for m in body.messages]
        gen = GenerateRequest(message_id, prompt.ids, params, session_key(intake.session_id, opening), intake.tenant)
        return scope, body, prompt, max_tokens, gen

    scope, body, prompt, max_tokens, gen = await intake.prepare(prepare)
    stream = stream_reply(scope, gen, scope.frontend.parser(prompt), "anthropic", "messages")
    headers = clamp_headers(body.max_tokens, max_tokens)
    if body.stream:
        stream = await primed(request, stream)
        return event_stream(_events(scope, gen.request_id, len(prompt.ids), stream), headers)
    reply = await run_unless_disconnected(request, collect(stream))
    return JSONResponse(_message_response(scope, gen.request_id, reply), headers=headers)


def anthropic_id(call_id: str) -> str:
    """A tool call's id as Anthropic spells its own (``toolu_``); an id the model wrote itself (Kimi's
    ``functions.NAME:N``) stays as it is, for the chat template to render back."""
    return "toolu_" + call_id[len("call_"):] if call_id.startswith("call_") else call_id


# -- request conversion -------------------------------------------------------------------------

def _render(state: Any, body: CountTokensRequest, check_length: bool = True) -> RenderedPrompt:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        messages.extend(_convert(m, i))
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            check_json_schema(t.input_schema, f"tools.{i}.input_schema")
            tools.append(tool_json(t.name, t.description, t.input_schema))
    mode = _tool_mode(body, tools)
    kwargs = None
    if body.thinking is not None:
        kwargs = {"enable_thinking": body.thinking.type != "disabled"}
    return state.frontend.render_chat(messages, tools, mode, kwargs, check_length)


def _tool_mode(body: CountTokensRequest, tools: list[dict[str, Any]] | None) -> ToolMode:
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return ToolMode(choice.type if choice else "auto")
    if not tools:
        raise APIError(400, f"tool_choice: '{choice.type}' needs tools", "tool_choice")
    if choice.type == "any":
        return tool_mode("required", None, tools)
    return tool_mode(None, choice.name, tools, "tool_choice.name")


def _convert(m: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages (tool results become ``tool`` messages)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "system":
        return [{"role": "system", "content": "".join(_block_text(b, f"messages.{i}.content.{j}")
                                                      for j, b in enumerate(m.content))}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "text":
            text.append(block.text)
        elif block.type == "thinking":
            reasoning.append(block.thinking)
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            if m.role != "assistant":
                raise APIError(400, f"{where}: tool_use blocks belong to assistant messages", where)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name,
                                                                             "arguments": block.input}})
        elif block.type == "tool_result":
            if m.role != "user":
                raise APIError(400, f"{where}: tool_result blocks belong to user messages", where)
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            content = block.content if isinstance(block.content, str) or block.content is None else \
                "".join(_block_text(b, where) for b in block.content)
            out.append({"role": "tool", "content": content or "", "tool_call_id": block.tool_use_id})
        else:
            text.append(_block_text(block, where))
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _block_text(block: Any, where: str) -> str:
    """The text a content block contributes: its own, or a placeholder for an image or document."""
    if block.type == "text":
        return block.text
    if block.type in OMITTED:
        return OMITTED[block.type]
    raise APIError(400, f"{where}: {block.type} blocks are not supported by this server", f"{where}.type")


# -- responses ----------------------------------------------------------------------------------
def _stop(reply: Reply, has_tools: bool) -> tuple[str, str | None]:
    if reply.finish_reason == "length":
        return "max_tokens", None
    if isinstance(reply.stop_reason, str):
        return "stop_sequence", reply.stop_reason
    return ("tool_use" if has_tools else "end_turn"), None


def _signature(thinking: str) -> str:
    return "hearth-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    # Anthropic counts cache reads apart: input_tokens are the prompt tokens computed afresh.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _reply_usage(reply: Reply) -> dict[str, Any]:
    return _usage(reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens)


def _message_response(state: Any, message_id: str, reply: Reply) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": _signature(reply.reasoning)})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        content.append({"type": "tool_use", "id": anthropic_id(call.id), "name": call.name,
                        "input": call.input})
    stop_reason, stop_sequence = _stop(reply, bool(reply.tool_calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _reply_usage(reply), "timings": reply.timings}


class _BlockWriter:
    """Turns parsed events into content_block_start/delta/stop events, one block per kind run."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.thinking = ""
        self.had_tool = False

    def write(self, event: Event) -> list[str]:
        out: list[str] = []
        if event.kind == "tool_call" or event.kind != self.kind:
            out += self.close()
            out += self._open(event)
        if event.kind == "reasoning":
            self.thinking += event.text
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif event.kind == "content":
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        else:
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.tool_call.arguments}))
        return out

    def _open(self, event: Event) -> list[str]:
        self.index += 1
        self.kind = event.kind
        if event.kind == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif event.kind == "content":
            block = {"type": "text", "text": ""}
        else:
            self.had_tool = True
            call = event.tool_call
            block = {"type": "tool_use", "id": anthropic_id(call.id), "name": call.name, "input": {}}
        return [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                    "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "reasoning":
            out.append(self._delta({"type": "signature_delta", "signature": _signature(self.thinking)}))
            self.thinking = ""
        self.kind = None
        return out + [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]


async def _events(state: Any, message_id: str, prompt_tokens: int, stream: AsyncIterator):
    first = await anext(stream)  # primed: already here, and it knows how much of the prompt was cached
    cached = first[1].metrics.num_cached_tokens
    yield sse({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(prompt_tokens, cached, 0)}}, "message_start")
    yield sse({"type": "ping"}, "ping")
    writer = _BlockWriter()
    reply = Reply()
    try:
        async for events, chunk in prepend(first, stream):
            for event in events:
                for line in writer.write(event):
                    yield line
            if chunk.finished:
                reply.add([], chunk)
    except APIError as exc:
        yield sse(exc.anthropic_body(), "error")
        return
    for line in writer.close():
        yield line
    stop_reason, stop_sequence = _stop(reply, writer.had_tool)
    yield sse({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": _reply_usage(reply), "timings": reply.timings}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")



