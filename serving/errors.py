"""Client errors in each protocol's own shape, and strict parsing of request bodies."""

from __future__ import annotations

import hmac
import json
from typing import Any, TypeVar

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
                500: "server_error", 503: "service_unavailable"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "api_error", 529: "overloaded_error"}


MAX_NESTING = 100  # levels of arrays and objects a request body may nest
MAX_DIGITS = 20  # digits of an integer in a request body (int64 needs 19)
_MESSAGE_CHARS, _PARAM_CHARS = 1000, 200  # what an error repeats of the request, at most


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out (errors that quote a
    client's value never send a megabyte back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def protocol_of(path: str) -> str:
    """The API a path belongs to, whose error shape its answers take: "anthropic" or "openai"."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class APIError(Exception):
    """An error answered to the client: HTTP status, a message naming the field, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 anthropic_message: str | None = None, retry_after: int = 1) -> None:
        message = clip(message, _MESSAGE_CHARS)
        self.retry_after = retry_after  # seconds, sent as Retry-After with 429, 503 and 529
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else clip(param, _PARAM_CHARS)
        self.code = code  # OpenAI's machine-readable code (``context_length_exceeded``), if any
        # where Anthropic clients expect other words
        self.anthropic_message = clip(anthropic_message, _MESSAGE_CHARS) if anthropic_message else message

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.anthropic_message}}


def context_overflow(prompt_tokens: int, context: int, field: str) -> APIError:
    """A prompt that leaves no room in the context, in the words clients act on: OpenAI SDK users
    and agents match ``code: context_length_exceeded``; Claude Code matches ``prompt is too long:
    N tokens > M maximum`` and then compacts the conversation."""
    what = "messages" if field == "messages" else "prompt"
    return APIError(
        400, f"This model's maximum context length is {context} tokens. However, your {what} resulted in "
             f"{prompt_tokens} tokens. Please reduce the length of the {what}.", field,
        code="context_length_exceeded",
        anthropic_message=f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum")


def presented_key(authorization: str, x_api_key: str | None) -> str:
    """The key a request presents (``x-api-key: KEY``, else ``Authorization: Bearer KEY``), or ""."""
    bearer = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    return x_api_key or bearer


def key_matches(authorization: str, x_api_key: str | None, key: str | tuple[str, ...]) -> bool:
    """Whether a request carries the API key, or one of the keys (``Authorization: Bearer KEY`` or
    ``x-api-key: KEY``). Every key is compared, each in constant time."""
    given = presented_key(authorization, x_api_key).encode()
    found = False
    for k in (key,) if isinstance(key, str) else key:
        found |= hmac.compare_digest(given, k.encode())
    return bool(given) and found


def overloaded(protocol: str, detail: str, retry_after: int = 1) -> APIError:
    """The bounded queue is full: 429 for OpenAI clients, 529 ``overloaded_error`` for Anthropic."""
    return APIError(529 if protocol == "anthropic" else 429, f"the server is overloaded, retry later ({detail})",
                    retry_after=retry_after)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})


def field_name(loc: tuple[Any, ...]) -> str:
    """``messages.0.content`` from a pydantic error location (union-member tags dropped: type and
    model names, and tags with ``[]-,`` in them; body fields are snake_case)."""
    parts = [str(p) for p in loc if isinstance(p, int) or not (
        any(c in str(p) for c in "[]-,") or str(p) in _TYPE_TAGS or str(p)[:1].isupper())]
    return ".".join(parts) or "body"


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON body strictly (no string-to-number coercion); errors name the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    data = loads_bounded(text, "the request body")
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" escapes decode to lone surrogates no tokenizer accepts
        raise APIError(400, "the request body contains an unpaired UTF-16 surrogate escape (invalid Unicode)") \
            from None
    return validate_as(model, data)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise APIError(400, f"a number in the request has more than {MAX_DIGITS} digits")
    return int(digits)


def loads_bounded(text: str, what: str, field: str | None = None) -> Any:
    """JSON text parsed with bounds a hostile client cannot get past: at most :data:`MAX_NESTING`
    levels of arrays and objects, integers of at most :data:`MAX_DIGITS` digits. Each violation is a
    400 naming ``what`` (and ``field``)."""
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       field) from None
    except RecursionError:  # nested past the interpreter's own limit
        too_deep = True
    else:
        too_deep = _depth_exceeds(data, MAX_NESTING)
    if too_deep:
        raise APIError(400, f"{what} nests arrays and objects more than {MAX_NESTING} levels deep", field)
    return data


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts deeper than ``limit`` (iterative: any depth is safe)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


def validate_as(model: type[M], data: Any, where: str = "") -> M:
    """``data`` validated strictly as ``model``; errors name the field (under ``where``)."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        # The first field in error, and of its errors the deepest: of a union (text or a list of
        # items) the member that got furthest names the real problem, not "should be a string".
        errors = exc.errors(include_url=False)
        top = errors[0]["loc"][:1]
        errors = sorted((e for e in errors if e["loc"][:1] == top), key=lambda e: -len(field_name(e["loc"]).split(".")))
        inner = field_name(errors[0]["loc"])
        name = f"{where}.{inner}" if where and inner != "body" else (where or inner)
        same = [e["msg"] for e in errors if field_name(e["loc"]) == inner]
        detail = same[0] if len(same) == 1 else "invalid value (" + "; or ".join(dict.fromkeys(same)) + ")"
        raise APIError(400, f"{name}: {detail}", name) from None


def check_json_schema(schema: Any, where: str) -> None:
    """A schema (tool parameters, a reply's format) must be a valid JSON Schema of an object."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}: must be a JSON Schema object", where)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise APIError(400, f"{where}: not a valid JSON Schema ({exc.message})", where) from None
    if schema.get("type", "object") != "object":
        raise APIError(400, f"{where}: the schema's type must be 'object'", where)
