"""Streaming parsers that split model output into reasoning, content and tool calls: the events,
the ``<think>`` splitter, and the Hermes and Qwen3-Coder call formats.

Both protocols consume the same events, so streaming and non-streaming responses are built from
one parse. Parsers are chosen per model (:mod:`hearth.serving.reply_parsers` holds the registry,
the later families' formats and :class:`~hearth.serving.reply_parsers.OutputParser`); the
reasoning parser is on when the tokenizer knows the ``<think>`` markers.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the function name and its arguments as a JSON object string."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Event:
    """One piece of parsed output: kind is ``reasoning``, ``content`` or ``tool_call``."""

    kind: str
    text: str = ""
    tool_call: ToolCall | None = None


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Separates ``<think>…</think>`` at the start of the output from what follows.

    ``in_reasoning`` starts True when the prompt already opened the block (templates that end
    the generation prompt with ``<think>``)."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""
        self.started = False  # reasoning text seen (leading whitespace is dropped)
        self.pending_ws = ""  # trailing whitespace of the reasoning so far, dropped before </think>

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buffer, self.state = stripped[len(THINK_OPEN):], "reasoning"
                elif THINK_OPEN.startswith(stripped):
                    return events  # could still become "<think>"
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_suffix(self.buffer, THINK_CLOSE)
                    self._reasoning(self.buffer[: len(self.buffer) - keep], events)
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                self._reasoning(self.buffer[:end], events)
                self.buffer, self.state, self.pending_ws = self.buffer[end + len(THINK_CLOSE):], "after", ""
            elif self.state == "after":
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
            else:
                events.append(Event("content", self.buffer))
                self.buffer = ""
        return events

    def _reasoning(self, text: str, events: list[Event]) -> None:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        if body:
            events.append(Event("reasoning", self.pending_ws + body))
            self.pending_ws = ""
        self.pending_ws += text[len(body):]

    def flush(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            events: list[Event] = []
            self._reasoning(rest, events)
            return events
        if not rest or self.state == "after":
            return []
        return [Event("content", rest)]


class HermesToolParser:
    """Finds ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` in content (Qwen, Hermes).

    Whitespace around calls is dropped; a call whose JSON does not parse is passed on as text."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    @staticmethod
    def parse_call(body: str) -> ToolCall | None:
        """The call in one tag body, or None (then the body stays text); subclasses swap the format."""
        return parse_hermes_call(body)

    def __init__(self, text_params: Mapping[str, frozenset[str]] | None = None) -> None:
        self.text_params = text_params or {}  # per tool, the parameters whose schema says string
        self.buffer = ""
        self.in_call = False
        self.pending_ws = ""
        self.last_was_call = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            tag = self.close_tag if self.in_call else self.open_tag
            pos = self.buffer.find(tag)
            if pos < 0:
                if not self.in_call:
                    keep = partial_suffix(self.buffer, tag)
                    self._content(self.buffer[: len(self.buffer) - keep], events)
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            if self.in_call:
                self._call(self.buffer[:pos], events)
            else:
                self._content(self.buffer[:pos], events)
            self.buffer, self.in_call = self.buffer[pos + len(tag):], not self.in_call
        return events

    def flush(self) -> list[Event]:
        events: list[Event] = []
        if self.in_call:
            self._content(self.open_tag + self.buffer, events)  # an unterminated call stays text
        else:
            self._content(self.buffer, events)
        self.buffer = ""
        if self.pending_ws and not self.last_was_call:
            events.append(Event("content", self.pending_ws))
        self.pending_ws = ""
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.pending_ws += text
            return
        lead = "" if self.last_was_call else self.pending_ws
        if self.last_was_call:
            body = body.lstrip()
        events.append(Event("content", lead + body))
        self.pending_ws, self.last_was_call = text[len(text.rstrip()):], False

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        """The calls in one tag body (one, unless the format groups several in a tag), or None."""
        call = self.parse_call(body)
        return None if call is None else [call]

    def _call(self, body: str, events: list[Event]) -> None:
        calls = self.parse_calls(body)
        if not calls:
            self._content(self.open_tag + body + self.close_tag, events)
            return
        self.pending_ws, self.last_was_call = "", True
        events.extend(Event("tool_call", tool_call=call) for call in calls)


def parse_hermes_call(body: str) -> ToolCall | None:
    """The tool call in one ``<tool_call>`` body, or None when it is not a valid call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_tool_call_id(), data["name"], json.dumps(args, ensure_ascii=False))


class Qwen3CoderToolParser(HermesToolParser):
    """Finds Qwen3-Coder / Qwen3.5 XML calls in content::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    A value that reads as JSON (a number, true, an object…) is taken as such, otherwise as text,
    except that a parameter whose schema says string stays text ("42" is not 42)."""

    def parse_call(self, body: str) -> ToolCall | None:
        return parse_xml_call(body, self.text_params)


_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_xml_call(body: str, text_params: Mapping[str, frozenset[str]] | None = None) -> ToolCall | None:
    """The tool call in one XML ``<tool_call>`` body, or None when it is not a valid call
    (``text_params``: per tool, the parameters kept as text whatever they look like)."""
    match = _XML_FUNCTION.match(body)
    if match is None or not match.group(1).strip():
        return None
    name, inner = match.group(1).strip(), match.group(2)
    as_text = (text_params or {}).get(name, frozenset())
    args = {m.group(1).strip(): read_value(m.group(2).removeprefix("\n").removesuffix("\n"),
                                           m.group(1).strip() in as_text) for m in _XML_PARAMETER.finditer(inner)}
    if _XML_PARAMETER.sub("", inner).strip():
        return None  # text outside the parameters: not a call
    return ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False))


def read_value(text: str, as_text: bool) -> Any:
    """A named parameter's value in an XML-like call: the text itself for a parameter whose schema
    says string (``as_text``), else JSON where it parses, else the text."""
    if as_text:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class NoToolParser:
    """Everything is content."""

    def __init__(self, text_params: Mapping[str, frozenset[str]] | None = None) -> None:
        pass

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def flush(self) -> list[Event]:
        return []
