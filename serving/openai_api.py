"""OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (and a
clear 404 on ``/v1/embeddings``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hearth.proto.contracts import GenerateRequest
from hearth.serving.errors import APIError, check_json_schema
from hearth.serving.frontend import OMITTED, ToolMode, parse_arguments, tool_json, tool_mode
from hearth.serving.generation import collect_samples, fan_out, samples
from hearth.serving.openai_format import (
    LogprobFormat,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
)
from hearth.serving.openai_requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
)
from hearth.serving.session import session_key
from hearth.serving.transport import Intake, clamp_headers, event_stream, primed, run_unless_disconnected

router = APIRouter()

_MEDIA = {"image_url": "image", "input_audio": "audio", "file": "file"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served models, with their context length (known before the weights are loaded). An
    Anthropic client (``anthropic-version`` header) gets Anthropic's listing shape."""
    state = request.app.state.hearth
    served = [(name, m.client.model) for m in state.models for name in m.names]
    if "anthropic-version" in request.headers:
        data = [{"type": "model", "id": name, "display_name": name,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(model.created)),
                 "max_input_tokens": model.max_model_len, "context_window": model.max_model_len}
                for name, model in served]
        return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": model.created, "owned_by": "hearth",
         "max_model_len": model.max_model_len, "context_length": model.max_model_len}
        for name, model in served]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    intake = await Intake.read(request)

    def prepare():  # on an intake thread
        body, scope = intake.open(ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        tools, mode = _tools(body)
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        prompt = scope.frontend.render_chat(messages, tools, mode, body.chat_template_kwargs,
                                            json_schema=response_schema(body.response_format),
                                            schema_field="response_format.json_schema.schema")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requested = body.max_completion_tokens or body.max_tokens
        params = _sampling(scope, body, prompt.ids, requested,
                           "max_completion_tokens" if body.max_completion_tokens else "max_tokens", request_id,
                           logprobs=(body.top_logprobs or 0) if body.logprobs else None, grammar=prompt.grammar)
        session = session_key(intake.session_id, messages)
        gens = samples(GenerateRequest(request_id, prompt.ids, params, session, intake.tenant), body.n)
        return scope, body, prompt, request_id, requested, params, gens

    scope, body, prompt, request_id, requested, params, gens = await intake.prepare(prepare)
    stream = fan_out(scope, gens, [scope.frontend.parser(prompt) for _ in gens], "openai", "chat")
    headers = clamp_headers(requested, params.max_tokens)
    logprobs = LogprobFormat(scope.frontend.token_text) if body.logprobs else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = await primed(request, stream)
        return event_stream(chat_events(scope.model_name, request_id, stream, body.n, include_usage, logprobs),
                            headers)
    replies = await run_unless_disconnected(request, collect_samples(stream, body.n))
    return JSONResponse(chat_response(scope.model_name, request_id, replies, logprobs), headers=headers)


@router.post("/v1/completions")
async def completions(request: Request):
    intake = await Intake.read(request)

    def prepare():  # on an intake thread
        body, scope = intake.open(CompletionRequest)
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported", "echo" if body.echo else "suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: give one prompt per request (use n for several samples)", "prompt")
            prompt = prompt[0]
        ids = scope.frontend.prompt_ids(prompt, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = _sampling(scope, body, ids, body.max_tokens, "max_tokens", request_id, default_tokens=16,
                           logprobs=body.logprobs)
        gen = GenerateRequest(request_id, ids, params, session_key(intake.session_id, prompt_ids=ids), intake.tenant)
        return scope, body, request_id, params, samples(gen, body.n)

    scope, body, request_id, params, gens = await intake.prepare(prepare)
    stream = fan_out(scope, gens, [None] * len(gens), "openai", "completions")
    headers = clamp_headers(body.max_tokens, params.max_tokens)
    logprobs = LogprobFormat(scope.frontend.token_text) if body.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = await primed(request, stream)
        return event_stream(completion_events(scope.model_name, request_id, stream, body.n, include_usage,
                                              body.return_token_ids, logprobs), headers)
    replies = await run_unless_disconnected(request, collect_samples(stream, body.n))
    return JSONResponse(completion_response(scope.model_name, request_id, replies, logprobs, body.return_token_ids),
                        headers=headers)


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    """Not served: a clear answer for clients that probe for it (LangChain, RAG tools)."""
    raise APIError(404, "embeddings are not served: hearth serves generative models through chat, completions and "
                        "responses; use a dedicated embedding server for /v1/embeddings", "model",
                   code="model_not_found")


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
    if isinstance(choice, str) or choice is None:
        return tools, tool_mode(choice, None, tools)
    return tools, tool_mode(None, choice.function.name, tools)


def response_schema(fmt: ResponseFormat | None, where: str = "response_format.json_schema") -> dict[str, Any] | None:
    """The JSON schema a reply must match: any object for ``json_object``; every ``json_schema``
    is enforced, strict or not (a schema is what the client's parser will check). ``where``
    names the schema's parent in errors."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object", "additionalProperties": True}  # any object (kept open when read strictly)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, f"{where}.schema is required", f"{where}.schema")
    check_json_schema(fmt.json_schema.schema_, f"{where}.schema")
    return fmt.json_schema.schema_


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
    return "".join(part.text if part.type == "text" else OMITTED[_MEDIA[part.type]] for part in m.content)


def _sampling(state: Any, body: SamplingFields, prompt_ids: list[int], requested: int | None, field: str,
              request_id: str, default_tokens: int | None = None, logprobs: int | None = None,
              grammar: str | None = None):
    frontend = state.frontend
    max_tokens = frontend.max_tokens(requested if requested is not None else default_tokens, len(prompt_ids), field,
                                     request_id)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return frontend.sampling(
        max_tokens, stop, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos or None, logprobs=logprobs,
        grammar=grammar, logit_bias=body.logit_bias or None,
    )


