"""Session keys: what identifies a conversation across requests, so that a router (the cluster's)
keeps it on the replica whose prefix cache holds it. Derived here, in the API layer, from what each
protocol sends; the router only compares them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from hearth.serving.errors import presented_key

PREFIX_KEY_TOKENS = 256  # raw prompts: the session is identified by this many leading tokens
CLIENT_KEY = "id:"  # session keys the client gave start with this


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """A session key for a chat: the messages up to and including the first user message (the
    system prompt and the opening question identify a conversation; later turns only append)."""
    head: list[dict[str, Any]] = []
    for m in messages:
        head.append({"role": m.get("role"), "content": m.get("content")})
        if m.get("role") == "user":
            break
    return "conv:" + hashlib.blake2b(json.dumps(head, sort_keys=True, default=str).encode(),
                                     digest_size=12).hexdigest()


def prefix_key(prompt_ids: list[int]) -> str:
    """A session key for a raw prompt: a hash of its leading tokens."""
    head = prompt_ids[:PREFIX_KEY_TOKENS]
    return "prefix:" + hashlib.blake2b(json.dumps(head).encode(), digest_size=12).hexdigest()


def session_key(header: str | None, messages: list[dict[str, Any]] | None = None,
                prompt_ids: list[int] | None = None) -> str:
    """The routing key of a request: the client's ``x-session-id`` when it sends one, else the
    conversation's opening (chat), else the prompt's leading tokens."""
    if header and header.strip():
        return CLIENT_KEY + header.strip()[:256]
    if messages:
        return conversation_key(messages)
    return prefix_key(prompt_ids or [])


def tenant_key(header: str | None, host: str | None, api_key: str | None = None) -> str:
    """Whose request it is, for fair admission: the API key it was let in with (given only where the
    server holds several keys, one per person or program), else the client's ``x-session-id`` when
    it sends one, else the address it connects from. A key is kept only as a hash."""
    if api_key:
        return "key:" + hashlib.blake2b(api_key.encode(), digest_size=12).hexdigest()
    if header and header.strip():
        return CLIENT_KEY + header.strip()[:256]
    return "addr:" + (host or "")


def request_tenant(headers: Mapping[str, str], host: str | None, keys: str | tuple[str, ...] | None) -> str:
    """:func:`tenant_key` of a request's headers (HTTP headers or gRPC metadata, lower-case names)
    on a server holding ``keys``."""
    several = isinstance(keys, tuple) and len(keys) > 1
    key = presented_key(headers.get("authorization", ""), headers.get("x-api-key")) if several else None
    return tenant_key(headers.get("x-session-id"), host, key)


def request_owner(headers: Mapping[str, str], keys: str | tuple[str, ...] | None) -> str:
    """Who owns what a request stores (stored responses): a hash of the API key it was let in with,
    or "" on a server without keys (whoever reaches it shares one owner)."""
    if not keys:
        return ""
    key = presented_key(headers.get("authorization", ""), headers.get("x-api-key"))
    return "key:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
