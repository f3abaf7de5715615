"""Reading a model's reply: the tool-call formats of the later families (GLM-4.5, MiniMax-M2,
DeepSeek, GPT-OSS's harmony channels), the registry of every format, and :class:`OutputParser`,
which splits a streamed reply into reasoning, content and tool calls. The shared pieces and the
Hermes and Qwen3-Coder formats are in :mod:`hearth.serving.parsers`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from hearth.serving.parsers import (
    Event,
    HermesToolParser,
    NoToolParser,
    Qwen3CoderToolParser,
    ReasoningSplitter,
    ToolCall,
    new_tool_call_id,
    partial_suffix,
    read_value,
)


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
    args = {m.group(1).strip(): read_value(m.group(2), m.group(1).strip() in as_text)
            for m in _GLM_ARG.finditer(rest)}
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
            args = {m.group(1).strip(): read_value(m.group(2), m.group(1).strip() in as_text)
                    for m in _MINIMAX_PARAMETER.finditer(inner)}
            calls.append(ToolCall(new_tool_call_id(), invoke.group(1).strip(), json.dumps(args, ensure_ascii=False)))
        if not calls or _MINIMAX_INVOKE.sub("", body).strip():
            return None
        return calls


_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"\n]+)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"\n]+)">(.*?)</parameter>', re.DOTALL)


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


class KimiK2ToolParser(HermesToolParser):
    """Finds Kimi-K2 / K2.5 / Kimi-Linear calls in content, one or several in a section::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
        {"city": "Paris"}<|tool_call_end|>…<|tool_calls_section_end|>

    The arguments are a JSON object. The call's id is the one the model wrote (``functions.NAME:N``),
    as Kimi's chat template renders it back with the tool's result."""

    open_tag, close_tag = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for match in _KIMI_CALL.finditer(body):
            call_id, args = match.group(1).strip(), match.group(2)
            named = _KIMI_ID.fullmatch(call_id)
            try:
                value = json.loads(args)
            except json.JSONDecodeError:
                return None
            if named is None or not isinstance(value, dict):
                return None
            calls.append(ToolCall(call_id, named.group(1), json.dumps(value, ensure_ascii=False)))
        if not calls or _KIMI_CALL.sub("", body).strip():
            return None
        return calls


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:<>]+):\d+")


class DsmlToolParser(HermesToolParser):
    """Finds DeepSeek-V4's DSML calls in content, one or several in a block::

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="NAME">
        <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    A value with ``string="true"`` is the text as written; ``string="false"`` is JSON (read as for
    Qwen3-Coder where it does not parse). DeepSeek-V3.2 wraps the same invokes in
    ``function_calls`` (:class:`DsmlV32ToolParser`)."""

    open_tag, close_tag = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for invoke in _DSML_INVOKE.finditer(body):
            name, inner = invoke.group(1).strip(), invoke.group(2)
            if not name or _DSML_PARAMETER.sub("", inner).strip():
                return None  # text outside the parameters: not a call
            as_text = self.text_params.get(name, frozenset())
            args = {m.group(1).strip(): read_value(m.group(3), m.group(2) == "true" or m.group(1).strip() in as_text)
                    for m in _DSML_PARAMETER.finditer(inner)}
            calls.append(ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False)))
        if not calls or _DSML_INVOKE.sub("", body).strip():
            return None
        return calls


class DsmlV32ToolParser(DsmlToolParser):
    """DeepSeek-V3.2's DSML calls: :class:`DsmlToolParser`'s invokes in a ``function_calls`` block."""

    open_tag, close_tag = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"


_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"\n]+)">(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter name="([^"\n]+)"(?: string="(true|false)")?>(.*?)</｜DSML｜parameter>', re.DOTALL)


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
                keep = max(partial_suffix(self.buffer, tag) for tag in (*self.ENDS, "<|start|>"))
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



TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser, "glm45": Glm45ToolParser,
                "minimax_m2": MiniMaxM2ToolParser, "deepseek": DeepSeekToolParser, "harmony": HarmonyParser,
                "deepseek_v4": DsmlToolParser, "deepseek_v32": DsmlV32ToolParser, "kimi_k2": KimiK2ToolParser,
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
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm45",
    "KimiLinearForCausalLM": "kimi_k2",
    "KimiK25ForConditionalGeneration": "kimi_k2",
    "Kimi_K25ForConditionalGeneration": "kimi_k2",
}


# What in a chat template names its tool-call format, most specific first (GLM's and Qwen3-Coder's
# templates also write <tool_call>).
TEMPLATE_MARKERS = (("<|channel|>", "harmony"), ("｜DSML｜tool_calls", "deepseek_v4"),
                    ("｜DSML｜function_calls", "deepseek_v32"), ("tool▁calls▁begin", "deepseek"),
                    ("<|tool_calls_section_begin|>", "kimi_k2"),
                    ("<minimax:tool_call>", "minimax_m2"),
                    ("<arg_key>", "glm45"), ("<function=", "qwen3_coder"), ("<tool_call>", "hermes"))


def choose_tool_parser(architecture: str, chat_template: str | None, override: str | None = None) -> str:
    """The tool parser for a model: an explicit choice, else its family's, else 'none' when the
    template never mentions tools."""
    if override:
        if override not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser '{override}' (one of {', '.join(sorted(TOOL_PARSERS))})")
        return override
    for marker, parser in TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return parser
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
