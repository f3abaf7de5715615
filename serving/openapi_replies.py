"""JSON Schemas of the reply bodies of every API (OpenAI, Responses, Anthropic), for ``/openapi.json``.

The handlers build their answers as plain dicts (``openai_format``, ``responses_format``,
``anthropic_api``); these schemas say what those dicts hold, field by field, so that schema-driven
clients and fuzzers can check every answer (``bench/reliability.py``'s schemathesis row does).
Objects stay open (``additionalProperties`` is not closed): the APIs add fields over time and
clients ignore the ones they do not know."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
OBJ: Schema = {"type": "object"}


def _const(value: str) -> Schema:
    return {"type": "string", "enum": [value]}


OPENAI_ERROR = _obj({"error": _obj({"message": STR, "type": STR}, {"param": _nullable(STR),
                                                                  "code": _nullable(STR)})})
ANTHROPIC_ERROR = _obj({"type": _const("error"), "error": _obj({"type": STR, "message": STR})})

_OPENAI_USAGE = _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})
_TOOL_CALL = _obj({"id": STR, "type": _const("function"), "function": _obj({"name": STR, "arguments": STR})})
_CHAT_MESSAGE = _obj({"role": _const("assistant"), "content": _nullable(STR)},
                     {"reasoning_content": STR, "tool_calls": {"type": "array", "items": _TOOL_CALL}})
_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls", "content_filter"]}

CHAT_COMPLETION = _obj({
    "id": STR, "object": _const("chat.completion"), "created": INT, "model": STR,
    "choices": {"type": "array", "items": _obj({"index": INT, "message": _CHAT_MESSAGE, "finish_reason": _FINISH},
                                               {"logprobs": _nullable(OBJ)})},
    "usage": _OPENAI_USAGE}, {"timings": OBJ})

COMPLETION = _obj({
    "id": STR, "object": _const("text_completion"), "created": INT, "model": STR,
    "choices": {"type": "array", "items": _obj({"index": INT, "text": STR, "finish_reason": _FINISH},
                                               {"logprobs": _nullable(OBJ),
                                                "token_ids": {"type": "array", "items": INT}})},
    "usage": _OPENAI_USAGE}, {"timings": OBJ})

_OUTPUT_ITEM = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["message", "reasoning", "function_call"]}, "id": STR, "status": STR,
    "role": STR, "content": {"type": "array", "items": OBJ}, "call_id": STR, "name": STR, "arguments": STR}}
RESPONSE = _obj({
    "id": STR, "object": _const("response"), "created_at": INT,
    "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete", "failed"]},
    "model": STR, "output": {"type": "array", "items": _OUTPUT_ITEM}},
    {"usage": _nullable(_obj({"input_tokens": INT, "output_tokens": INT, "total_tokens": INT})),
     "error": _nullable(OBJ), "incomplete_details": _nullable(OBJ)})
RESPONSE_DELETED = _obj({"id": STR, "object": _const("response.deleted"), "deleted": {"type": "boolean"}})

_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "thinking", "tool_use"]}, "text": STR, "thinking": STR,
    "signature": STR, "id": STR, "name": STR, "input": OBJ}}
MESSAGE = _obj({
    "id": STR, "type": _const("message"), "role": _const("assistant"), "model": STR,
    "content": {"type": "array", "items": _BLOCK},
    "stop_reason": _nullable({"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]}),
    "stop_sequence": _nullable(STR), "usage": _obj({"input_tokens": INT, "output_tokens": INT})}, {"timings": OBJ})
TOKEN_COUNT = _obj({"input_tokens": INT})

MODELS = {"anyOf": [
    _obj({"object": _const("list"), "data": {"type": "array", "items": _obj(
        {"id": STR, "object": _const("model"), "created": INT, "owned_by": STR},
        {"max_model_len": INT, "context_length": INT})}}),
    _obj({"data": {"type": "array", "items": _obj({"type": _const("model"), "id": STR, "display_name": STR,
                                                   "created_at": STR})},
          "has_more": {"type": "boolean"}}, {"first_id": STR, "last_id": STR}),
]}
HEALTH = _obj({"status": {"type": "string", "enum": ["ready", "loading", "failed"]}}, {"model": STR, "error": STR})

# (path, method) -> its 200 body.
RESPONSE_BODIES: dict[tuple[str, str], Schema] = {
    ("/v1/chat/completions", "post"): CHAT_COMPLETION,
    ("/v1/completions", "post"): COMPLETION,
    ("/v1/responses", "post"): RESPONSE,
    ("/v1/responses/{response_id}", "get"): RESPONSE,
    ("/v1/responses/{response_id}", "delete"): RESPONSE_DELETED,
    ("/v1/messages", "post"): MESSAGE,
    ("/v1/messages/count_tokens", "post"): TOKEN_COUNT,
    ("/v1/models", "get"): MODELS,
    ("/health", "get"): HEALTH,
}
# One server-sent event (before OpenAPI 3.2 a stream's ``schema`` describes each event): ``data`` is
# the API's JSON chunk (or ``[DONE]``), ``event`` its type where the API names one.
SSE_EVENT: Schema = {"type": "object", "description": "one server-sent event, when the body asks to stream",
                     "properties": {"event": STR, "data": STR, "id": STR, "retry": INT}}
