"""Responses API bodies and stream events, built from parsed replies: output items (reasoning,
message, function_call), usage, and the event sequence of a streamed response."""

from __future__ import annotations

import json
import mmap
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from hearth.serving.generation import Reply
from hearth.serving.parsers import Event, ToolCall
from hearth.serving.transport import sse


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: ``resp_…``, ``msg_…``, ``rs_…``, ``fc_…``."""
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ResponseHead:
    """What a response object says about its request (echoed back in every shape of it)."""

    id: str
    model: str
    request: dict[str, Any]  # the request fields a response echoes (instructions, tools, ...)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             incomplete: str | None = None) -> dict[str, Any]:
        """The response object in a given state (in_progress, completed, incomplete, failed)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, **self.request}


def status_of(reply: Reply) -> tuple[str, str | None]:
    """A finished reply's status and, when incomplete, why."""
    return ("incomplete", "max_output_tokens") if reply.finish_reason == "length" else ("completed", None)


def usage(reply: Reply, reasoning_tokens: int) -> dict[str, Any]:
    """Token usage; the prompt tokens computed afresh are the ones written to the prefix cache."""
    written = reply.prompt_tokens - reply.cached_tokens
    return {"input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens, "cache_write_tokens": written},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    """A reasoning output item (the text as ``reasoning_text`` content; no summary is made)."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item: one output_text part once completed, none while in progress."""
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: ToolCall, namespaces: dict[str, str], status: str = "completed") -> dict[str, Any]:
    """A function_call item (with the namespace of a tool that came in one)."""
    item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}
    if call.name in namespaces:
        item["namespace"] = namespaces[call.name]
    return item


def output_items(reply: Reply, namespaces: dict[str, str]) -> list[dict[str, Any]]:
    """A finished reply as output items: its reasoning, its text, then one item per tool call
    (a reply with neither text nor calls still has its, empty, message)."""
    items = []
    if reply.reasoning:
        items.append(reasoning_item(new_id("rs"), reply.reasoning))
    if reply.content or not reply.tool_calls:
        items.append(message_item(new_id("msg"), reply.content))
    items += [call_item(new_id("fc"), call, namespaces) for call in reply.tool_calls]
    return items


def as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat-template messages a later turn renders (one assistant message)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] += item["content"][0]["text"] if item["content"] else ""
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": _arguments(item["arguments"])}})
    return [message]


def _arguments(text: str) -> dict[str, Any]:
    """A stored call's arguments as a dict (the parser only emits JSON objects; anything else is {})."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class ResponseStore:
    """Stored responses, for ``previous_response_id`` and retrieval, in memory only (a restart forgets
    them). Each belongs to the client that stored it (``owner``: a hash of its API key, or "" on a
    server without keys); another owner's id reads as absent.

    Bounded by count and by bytes. Each response is kept as its compact JSON in one ring buffer of
    ``max_bytes``, an anonymous memory map: its pages are committed as they are first written and
    never exceed the budget, and entries of every size come and go without fragmenting the heap (a
    store of separate objects measured about 20 % above its count). The oldest stored are
    overwritten first (a continuation is stored anew, with its whole conversation). The index's
    cost (``ENTRY_OVERHEAD`` an entry) counts against the same budget."""

    ENTRY_OVERHEAD = 256  # bytes an entry costs in the index (its id, owner, slot and dict entry)

    def __init__(self, capacity: int = 100_000, max_bytes: int = 64 << 20) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0  # JSON and index bytes of what is kept
        self._ring = mmap.mmap(-1, max_bytes) if max_bytes > 0 else None
        self._head = 0  # where the next entry is written
        self._items: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # id -> (owner, offset, length)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]], owner: str = "") -> bool:
        """Keep a response; ``conversation``: the chat messages up to and including its output. False
        (nothing kept) when it alone is larger than the whole budget."""
        data = json.dumps([body, conversation], ensure_ascii=False, separators=(",", ":")).encode()
        self.delete(body["id"], owner)
        if self._ring is None or len(data) + self.ENTRY_OVERHEAD > self.max_bytes:
            return False
        self._write(body["id"], owner, data)
        return True

    def get(self, response_id: str, owner: str = "") -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """The stored response and its conversation, or None."""
        found = self._items.get(response_id)
        if found is None or found[0] != owner:
            return None
        body, conversation = json.loads(self._ring[found[1] : found[1] + found[2]])
        return body, conversation

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Forget a response; False when this owner has none by that id."""
        found = self._items.get(response_id)
        if found is None or found[0] != owner:
            return False
        del self._items[response_id]
        self.bytes -= found[2] + self.ENTRY_OVERHEAD
        return True

    def _write(self, response_id: str, owner: str, data: bytes) -> None:
        """``data`` at the head, past what it overwrites; then the budgets by count and bytes."""
        n = len(data)
        if self._head + n > self.max_bytes:  # wrap; what lies past the head is the oldest
            self._drop_overlapping(self._head, self.max_bytes)
            self._head = 0
        self._drop_overlapping(self._head, self._head + n)
        self._ring[self._head : self._head + n] = data
        self._items[response_id] = (owner, self._head, n)
        self._head += n
        self.bytes += n + self.ENTRY_OVERHEAD
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            self._drop_oldest()

    def _drop_overlapping(self, start: int, end: int) -> None:
        # The index is in write order, and so in ring order from the head on: the entries in
        # [start, end) (start being the head) are a prefix of it.
        while self._items:
            _, offset, n = next(iter(self._items.values()))
            if offset >= end or offset + n <= start:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, _, n) = self._items.popitem(last=False)
        self.bytes -= n + self.ENTRY_OVERHEAD


class EventWriter:
    """Parsed events as the Responses stream writes them: each output item opened with
    ``output_item.added``, filled by deltas, closed with ``output_item.done``; every event numbered."""

    def __init__(self, namespaces: dict[str, str]) -> None:
        self.namespaces = namespaces
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self._kind: str | None = None
        self._id = ""
        self._text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        """One event of type ``kind``, numbered."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, kind)

    def write(self, event: Event) -> list[str]:
        """The events for one parsed piece of output (opening and closing items as kinds change)."""
        out: list[str] = []
        if event.kind == "tool_call" or event.kind != self._kind:
            out += self.close()
            out += self._open(event)
        index = len(self.items)
        if event.kind == "reasoning":
            self._text += event.text
            out.append(self.emit("response.reasoning_text.delta", item_id=self._id, output_index=index,
                                 content_index=0, delta=event.text))
        elif event.kind == "content":
            self._text += event.text
            out.append(self.emit("response.output_text.delta", item_id=self._id, output_index=index,
                                 content_index=0, delta=event.text, logprobs=[]))
        else:
            call = event.tool_call
            out.append(self.emit("response.function_call_arguments.delta", item_id=self._id, output_index=index,
                                 delta=call.arguments))
            out.append(self.emit("response.function_call_arguments.done", item_id=self._id, output_index=index,
                                 name=call.name, arguments=call.arguments))
            out += self._finish(call_item(self._id, call, self.namespaces))
        return out

    def _open(self, event: Event) -> list[str]:
        index = len(self.items)
        self._kind, self._text = event.kind, ""
        if event.kind == "reasoning":
            self._id = new_id("rs")
            item = {"type": "reasoning", "id": self._id, "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif event.kind == "content":
            self._id = new_id("msg")
            item, part = message_item(self._id, "", "in_progress"), {"type": "output_text", "text": "",
                                                                     "annotations": [], "logprobs": []}
        else:
            self._id = new_id("fc")
            return [self.emit("response.output_item.added", output_index=index,
                              item=call_item(self._id, event.tool_call, self.namespaces, "in_progress"))]
        return [self.emit("response.output_item.added", output_index=index, item=item),
                self.emit("response.content_part.added", item_id=self._id, output_index=index, content_index=0,
                          part=part)]

    def close(self) -> list[str]:
        """Finish the open text or reasoning item (a call is finished as soon as it is written)."""
        kind, self._kind = self._kind, None
        index = len(self.items)
        if kind == "reasoning":
            return [self.emit("response.reasoning_text.done", item_id=self._id, output_index=index, content_index=0,
                              text=self._text),
                    self.emit("response.content_part.done", item_id=self._id, output_index=index, content_index=0,
                              part={"type": "reasoning_text", "text": self._text}),
                    *self._finish(reasoning_item(self._id, self._text))]
        if kind == "content":
            item = message_item(self._id, self._text)
            return [self.emit("response.output_text.done", item_id=self._id, output_index=index, content_index=0,
                              text=self._text, logprobs=[]),
                    self.emit("response.content_part.done", item_id=self._id, output_index=index, content_index=0,
                              part=item["content"][0]),
                    *self._finish(item)]
        return []

    def empty_message(self) -> list[str]:
        """An empty message item, for a reply with no text and no calls."""
        self._open(Event("content", ""))
        return self.close()

    def _finish(self, item: dict[str, Any]) -> list[str]:
        self._kind = None
        self.items.append(item)
        return [self.emit("response.output_item.done", output_index=len(self.items) - 1, item=item)]
