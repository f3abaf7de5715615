"""Streaming parsers that split model output into reasoning, content and tool calls.

Both protocols consume the same events, so streaming and non-streaming responses are built from
one parse. Parsers are chosen per model: a registry maps a name (``hermes``, ``qwen3_coder``,
``none``) to a tool parser, and the reasoning parser is on when the tokenizer knows the ``<think>`` markers.
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


def _partial_suffix(text: str, tag: str) -> int:
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
                    keep = _partial_suffix(self.buffer, THINK_CLOSE)
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
                    keep = _partial_suffix(self.buffer, tag)
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
    args: dict[str, Any] = {}
    for param in _XML_PARAMETER.finditer(inner):
        key, value = param.group(1).strip(), param.group(2).removeprefix("\n").removesuffix("\n")
        if key in as_text:
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    if _XML_PARAMETER.sub("", inner).strip():
        return None  # text outside the parameters: not a call
    return ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False))


class Glm45ToolParser(HermesToolParser):
    """Finds GLM-4.5 / 4.6 / 4.7 calls in content::

        <tool_call>NAME
        <arg_key>KEY</arg_key>
        <arg_value>VALUE</arg_value>
        </tool_call>

    (the newlines are optional: GLM-4.7 writes none). Values are read as for Qwen3-Coder: JSON where
    they parse, text otherwise, and text always for a parameter whose schema says string."""

    def parse_call(self, body: str) -> ToolCall | None:
        return parse_glm_call(body, self.text_params)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm_call(body: str, text_params: Mapping[str, frozenset[str]] | None = None) -> ToolCall | None:
    """The tool call in one GLM ``<tool_call>`` body, or None when it is not a valid call."""
    head, sep, tail = body.partition("<arg_key>")
    name, rest = head.strip(), sep + tail
    if not name or "<" in name or "\n" in name:
        return None
    as_text = (text_params or {}).get(name, frozenset())
    args: dict[str, Any] = {}
    for arg in _GLM_ARG.finditer(rest):
        key, value = arg.group(1).strip(), arg.group(2)
        if key in as_text:
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    if _GLM_ARG.sub("", rest).strip():
        return None  # text outside the arguments: not a call
    return ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False))


class MiniMaxM2ToolParser(HermesToolParser):
    """Finds MiniMax-M2 calls in content, one or several in a block::

        <minimax:tool_call>
        <invoke name="NAME">
        <parameter name="KEY">VALUE</parameter>
        </invoke>
        </minimax:tool_call>

    Values are read as for Qwen3-Coder (JSON where they parse, text for string parameters)."""

    open_tag, close_tag = "<minimax:tool_call>", "</minimax:tool_call>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for invoke in _MINIMAX_INVOKE.finditer(body):
            inner, as_text = invoke.group(2), self.text_params.get(invoke.group(1).strip(), frozenset())
            if _MINIMAX_PARAMETER.sub("", inner).strip():
                return None  # text outside the parameters: not a call
            args = {m.group(1).strip(): _value(m.group(2), m.group(1).strip() in as_text)
                    for m in _MINIMAX_PARAMETER.finditer(inner)}
            calls.append(ToolCall(new_tool_call_id(), invoke.group(1).strip(), json.dumps(args, ensure_ascii=False)))
        if not calls or _MINIMAX_INVOKE.sub("", body).strip():
            return None
        return calls


_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"\n]+)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"\n]+)">(.*?)</parameter>', re.DOTALL)


def _value(text: str, as_text: bool) -> Any:
    """A parameter's value: the text itself for a string parameter, else JSON where it parses."""
    if as_text:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class DeepSeekToolParser(HermesToolParser):
    """Finds DeepSeek-V3 / R1 / V3.1 calls in content, between the calls markers::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

    (V3 and R1), or ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``
    (V3.1). The arguments are a JSON object."""

    open_tag, close_tag = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for match in _DEEPSEEK_CALL.finditer(body):
            head, tail = match.group(1).strip(), match.group(2)
            if head == "function":  # V3 / R1: the name on the separator's line, then fenced JSON
                name, _, args = tail.partition("\n")
            else:  # V3.1: the name before the separator
                name, args = head, tail
            fenced = _DEEPSEEK_FENCE.fullmatch(args.strip())
            args, name = fenced.group(1) if fenced else args, name.strip()
            try:
                value = json.loads(args)
            except json.JSONDecodeError:
                return None
            if not name or not isinstance(value, dict):
                return None
            calls.append(ToolCall(new_tool_call_id(), name, json.dumps(value, ensure_ascii=False)))
        if not calls or _DEEPSEEK_CALL.sub("", body).strip():
            return None
        return calls


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DEEPSEEK_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


class HarmonyParser:
    """GPT-OSS's harmony format, read from text that keeps its special tokens: each message is a
    header up to ``<|message|>`` (``<|channel|>analysis``, ``final`` or ``commentary``, with
    ``to=functions.NAME`` and ``<|constrain|>json`` on a call) and a body up to ``<|end|>``,
    ``<|call|>`` or ``<|return|>`` (or the end of the reply: the last two are stop tokens), the
    next one opened by ``<|start|>assistant``. Analysis is reasoning, final and plain commentary
    are content, a message to ``functions.NAME`` is a call whose body is the JSON arguments
    (text when tools are off or the JSON does not parse). Text before any header is content."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, text_params: Mapping[str, frozenset[str]] | None = None, tools_enabled: bool = True) -> None:
        self.buffer, self.tools_enabled = "", tools_enabled
        self.header: str | None = ""  # the header being read; None inside a body
        self.kind, self.recipient, self.call_body = "content", None, ""

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            if self.header is not None:
                if not self._read_header():
                    break
                continue
            end = min(((self.buffer.find(tag), tag) for tag in self.ENDS if tag in self.buffer), default=None)
            if end is None:
                keep = max(_partial_suffix(self.buffer, tag) for tag in (*self.ENDS, "<|start|>"))
                self._body(self.buffer[: len(self.buffer) - keep], events)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            pos, tag = end
            self._body(self.buffer[:pos], events)
            self._finish(events)
            self.buffer, self.header = self.buffer[pos + len(tag):], ""
        return events

    def flush(self) -> list[Event]:
        events: list[Event] = []
        if self.header is None:
            self._body(self.buffer, events)
            self._finish(events)
        elif self.header + self.buffer:
            events.append(Event("content", self.header + self.buffer))  # an unfinished header stays text
        self.buffer, self.header = "", ""
        return events

    def _read_header(self) -> bool:
        """Consume a header once its ``<|message|>`` has arrived; False while it is incomplete."""
        start = self.buffer.lstrip()
        if not self.header and not start.startswith("<|"):
            if not start or start == "<":
                return False  # nothing yet, or a marker's first character
            self.header, self.kind, self.recipient = None, "content", None  # no header: plain content
            return True
        text = self.header + self.buffer  # the marker may straddle two chunks
        pos = text.find("<|message|>")
        if pos < 0:
            self.header, self.buffer = text, ""
            return False
        header, self.buffer = text[:pos], text[pos + len("<|message|>"):]
        recipient = re.search(r"to=([^\s<]+)", header)
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        self.recipient = recipient.group(1) if recipient else None
        self.kind = "reasoning" if channel and channel.group(1) == "analysis" and not self.recipient else "content"
        self.header, self.call_body = None, ""
        return True

    def _body(self, text: str, events: list[Event]) -> None:
        if self.recipient is not None:
            self.call_body += text
        elif text:
            events.append(Event(self.kind, text))

    def _finish(self, events: list[Event]) -> None:
        """The end of a message: a call's arguments are complete."""
        if self.recipient is None:
            return
        name = self.recipient.removeprefix("functions.")
        try:
            args = json.loads(self.call_body) if self.tools_enabled else None
        except json.JSONDecodeError:
            args = None
        if isinstance(args, dict) and name:
            events.append(Event("tool_call", tool_call=ToolCall(new_tool_call_id(), name,
                                                                json.dumps(args, ensure_ascii=False))))
        else:
            events.append(Event("content", self.call_body))
        self.recipient, self.call_body = None, ""


class NoToolParser:
    """Everything is content."""

    def __init__(self, text_params: Mapping[str, frozenset[str]] | None = None) -> None:
        pass

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def flush(self) -> list[Event]:
        return []


TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser, "glm45": Glm45ToolParser,
                "minimax_m2": MiniMaxM2ToolParser, "deepseek": DeepSeekToolParser, "harmony": HarmonyParser,
                "none": NoToolParser}
# Which tool-call format each architecture's chat templates use.
ARCHITECTURE_TOOL_PARSERS = {
    "Qwen3MoeForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "MixtralForCausalLM": "hermes",
    "Qwen3NextForCausalLM": "hermes",
    "Qwen3_5MoeForCausalLM": "qwen3_coder",
    "Glm4MoeForCausalLM": "glm45",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "DeepseekV3ForCausalLM": "deepseek",
    "DeepseekV2ForCausalLM": "deepseek",
    "GptOssForCausalLM": "harmony",
}


def choose_tool_parser(architecture: str, chat_template: str | None, override: str | None = None) -> str:
    """The tool parser for a model: an explicit choice, else its family's, else 'none' when the
    template never mentions tools."""
    if override:
        if override not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser '{override}' (one of {', '.join(sorted(TOOL_PARSERS))})")
        return override
    if chat_template and "<|channel|>" in chat_template:
        return "harmony"
    if chat_template and "tool▁calls▁begin" in chat_template:
        return "deepseek"
    if chat_template and "<minimax:tool_call>" in chat_template:
        return "minimax_m2"
    if chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if chat_template and "<function=" in chat_template:
        return "qwen3_coder"
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return ARCHITECTURE_TOOL_PARSERS.get(architecture, "none")


class OutputParser:
    """Reasoning split first, then tool calls in the content; ``tools_enabled`` False leaves
    tool-call markup as text (``tool_choice: none`` or no tools given)."""

    def __init__(self, tool_parser: str, reasoning: bool, in_reasoning: bool, tools_enabled: bool,
                 text_params: Mapping[str, frozenset[str]] | None = None) -> None:
        if tool_parser == "harmony":  # its channels carry the reasoning: no <think> split
            self.reasoning, self.tools = None, HarmonyParser(text_params, tools_enabled)
            return
        self.reasoning = ReasoningSplitter(in_reasoning) if reasoning else None
        self.tools = TOOL_PARSERS[tool_parser if tools_enabled else "none"](text_params)

    def feed(self, text: str) -> list[Event]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [Event("content", text)])

    def flush(self) -> list[Event]:
        events = self._route(self.reasoning.flush()) if self.reasoning else []
        return events + self.tools.flush()

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if event.kind == "content":
                out.extend(self.tools.feed(event.text))
            elif event.text:
                out.append(event)
        return out
