"""The OpenAPI document with the request bodies the handlers parse themselves and the response
bodies they build (``openapi_replies``).

The handlers read their bodies as bytes (strict parsing with errors in each API's own shape, see
``errors.parse_body``), so FastAPI cannot see them; here each body model's JSON Schema is put into
``components.schemas`` and referenced from its operation, so that schema-driven clients and fuzzers
see what every endpoint takes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from hearth.serving.admin_api import ExpertCacheResize
from hearth.serving.anthropic_requests import CountTokensRequest, MessagesRequest
from hearth.serving.errors import protocol_of
from hearth.serving.openai_requests import ChatCompletionRequest, CompletionRequest
from hearth.serving.openapi_replies import ANTHROPIC_ERROR, HEALTH, OPENAI_ERROR, RESPONSE_BODIES, SSE_EVENT
from hearth.serving.responses_requests import ResponsesRequest

# (path, method) -> the model its body is validated as.
REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/v1/messages", "post"): MessagesRequest,
    ("/v1/messages/count_tokens", "post"): CountTokensRequest,
    ("/admin/expert-cache", "post"): ExpertCacheResize,
}
_REF = "#/components/schemas/{model}"
# Operations that answer ``"stream": true`` with server-sent events.
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


def with_request_bodies(document: dict[str, Any], bodies: dict[tuple[str, str], type[BaseModel]],
                        model_names: list[str] | None = None) -> dict[str, Any]:
    """``document`` (an OpenAPI dict) with a required JSON ``requestBody`` on each listed operation;
    each body's ``model`` lists the names served here (others get 404)."""
    # One pass over all the models: pydantic names apart the models of the same name from different
    # modules (the OpenAI and Responses APIs both have a TextPart).
    refs, defs = models_json_schema([(model, "validation") for model in dict.fromkeys(bodies.values())],
                                    ref_template=_REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for model in bodies.values():
        field = schemas.get(model.__name__, {}).get("properties", {}).get("model")
        if field is not None and model_names:
            field["enum"] = list(model_names)
    for (path, method), model in bodies.items():
        operation = document.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(model, "validation")]}}}
    return document


def with_response_bodies(document: dict[str, Any], bodies: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """``document`` with each listed operation's 200 body (JSON, and server-sent events where it
    streams) and its error body in the API's own shape (``default``: every 4xx and 5xx)."""
    for (path, method), schema in bodies.items():
        operation = document.get("paths", {}).get(path, {}).get(method)
        if operation is None:
            continue
        responses = operation.setdefault("responses", {})
        content = {"application/json": {"schema": schema}}
        if path in STREAMING:
            content["text/event-stream"] = {"schema": SSE_EVENT}
        responses["200"] = {"description": "Successful Response", "content": content}
        responses.pop("422", None)  # FastAPI's own validation shape: this server answers in the API's
        error = ANTHROPIC_ERROR if protocol_of(path) == "anthropic" else OPENAI_ERROR
        if path == "/health":
            error = HEALTH  # 503 while loading or after a failed load
        responses["default"] = {"description": "An error", "content": {"application/json": {"schema": error}}}
    return document


def install(app: FastAPI, model_names: list[str] | None = None) -> None:
    """Serve the completed document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            document = with_request_bodies(document, REQUEST_BODIES, model_names)
            app.openapi_schema = with_response_bodies(document, RESPONSE_BODIES)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
