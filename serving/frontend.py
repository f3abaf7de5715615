"""Prompt rendering for the APIs: chat template, tools, token counting, output parsers, sampling.

Both protocols convert their messages into the chat-template message format used by Hugging
Face templates (``role``/``content``, ``tool_calls`` with ``function``, ``tool`` messages,
``reasoning_content``), render with the checkpoint's template and tokenize here, so remote engines
only ever see token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError

from hearth.proto.contracts import SamplingParams
from hearth.serving.constraints import FORCED_CALL_PREFIX, GrammarBuilder, check_grammar, check_satisfiable
from hearth.serving.errors import APIError, context_overflow, loads_bounded
from hearth.serving.parsers import THINK_CLOSE, THINK_OPEN
from hearth.serving.reply_parsers import OutputParser, choose_tool_parser

log = logging.getLogger("hearth.serving")
# Text that stands in for input this server cannot take, so a resent history never fails a turn.
OMITTED = {"image": "[image omitted: this model has no vision input]",
           "audio": "[audio omitted: this model has no audio input]",
           "document": "[document omitted: this server takes text only]",
           "file": "[file omitted: this server takes text only]"}
_PROBE = "hearth-system-probe-5e1f"


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt: its token ids, and text the reply is forced to begin with."""

    ids: list[int]
    text: str
    assistant_prefix: str = ""
    tools_enabled: bool = False
    grammar: str | None = None  # what the reply must match (a schema, a forced tool call)
    text_params: Mapping[str, frozenset[str]] = field(default_factory=dict)  # per tool: string parameters


@dataclass(frozen=True)
class ToolMode:
    """How tools take part in a request: ``none`` | ``auto`` | ``required`` | ``named``."""

    mode: str = "auto"
    name: str | None = None


class ModelFrontend:
    """Tokenizer-side work of one served model."""

    def __init__(self, tokenizer: Any, architecture: str, max_model_len: int, vocab_size: int,
                 tool_parser: str | None = None) -> None:
        if tokenizer is None:
            raise ValueError("serving needs a checkpoint with a tokenizer")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        template = getattr(tokenizer, "chat_template", None)
        self.has_chat_template = bool(template)
        self.tool_parser = choose_tool_parser(architecture, template if isinstance(template, str) else None,
                                              tool_parser)
        # The grammar of a forced call: DeepSeek's parser reads two layouts, its template says which.
        self.forced_call_format = self.tool_parser if self.tool_parser != "deepseek" else (
            "deepseek_v3" if isinstance(template, str) and "```json" in template else "deepseek_v31")
        vocab = tokenizer.get_vocab()
        self.reasoning = THINK_OPEN in vocab and THINK_CLOSE in vocab
        self.mid_system = self.has_chat_template and self._template_renders_mid_system()
        self.grammars = GrammarBuilder(tokenizer)

    def _template_renders_mid_system(self) -> bool:
        """Whether the chat template renders a system message after the first turn (Qwen's do);
        many templates drop it or raise instead."""
        probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "system", "content": _PROBE}, {"role": "user", "content": "c"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses them does not support them
            return False
        return _PROBE in text

    # -- prompts --------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """One token's text as it would be printed (what log-probability entries show)."""
        return self.tokenizer.decode([token_id])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, mode: ToolMode,
                    template_kwargs: dict[str, Any] | None = None, check_length: bool = True,
                    json_schema: dict[str, Any] | None = None, schema_field: str = "response_format",
                    messages_field: str = "messages") -> RenderedPrompt:
        """Render with the checkpoint's template. Forced tool use starts the reply with the call tag
        and constrains the rest to a call; ``json_schema`` constrains the reply to matching JSON.
        System messages may stand anywhere (see :func:`place_system_messages`)."""
        if not self.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions with a raw prompt", "messages")
        messages = place_system_messages(messages, self.mid_system)
        use_tools = bool(tools) and mode.mode != "none"
        template_kwargs = check_template_kwargs(template_kwargs)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools if use_tools else None, tokenize=False, add_generation_prompt=True,
                **template_kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - template errors (raise_exception, bad roles) are client errors
            # The template's own words (raise_exception) are for the client; anything else would quote
            # the renderer's internals.
            detail = f" ({exc})" if type(exc) is TemplateError else ""
            raise APIError(400, f"{messages_field}: the chat template rejected the conversation{detail}",
                           messages_field) from None
        thinking = THINK_CLOSE if self.reasoning and text.rstrip().endswith(THINK_OPEN) else None
        prefix, grammar = "", None
        if use_tools and mode.mode in ("required", "named"):
            call_format = self.forced_call_format
            if call_format not in FORCED_CALL_PREFIX:
                raise APIError(400, f"tool_choice: forcing a tool call is not supported for this model's "
                                    f"'{self.tool_parser}' tool-call format", "tool_choice")
            # The call tag is put in the prompt unless the reply first closes a think block.
            prefix = "" if thinking else FORCED_CALL_PREFIX[call_format]
            for tool in tools:
                fn = tool["function"]
                if mode.name is None or fn["name"] == mode.name:
                    check_satisfiable(fn.get("parameters") or {}, f"tools.{fn['name']}.parameters")
            grammar = self.grammars.tool_call(call_format, tools, mode.name, thinking, bool(thinking))
            check_grammar(grammar, "tools")
        elif json_schema is not None:
            check_satisfiable(json_schema, schema_field)
            grammar = self.grammars.json(json_schema, thinking)
            check_grammar(grammar, schema_field)
        ids = self.encode(text + prefix)
        if check_length:
            self.check_prompt_length(len(ids), messages_field)
        text_params = {t["function"]["name"]: frozenset(
            k for k, v in ((t["function"].get("parameters") or {}).get("properties") or {}).items()
            if isinstance(v, dict) and v.get("type") == "string") for t in tools or []} if use_tools else {}
        return RenderedPrompt(ids, text + prefix, prefix, use_tools and self.tool_parser != "none", grammar,
                              text_params)

    def prompt_ids(self, prompt: str | list[int], field: str) -> list[int]:
        """A raw prompt's token ids (text is tokenized without special tokens), checked."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise APIError(400, f"{field}: token ids must lie in [0, {self.vocab_size})", field)
        self.check_prompt_length(len(ids), field)
        return ids

    def check_prompt_length(self, n: int, field: str) -> None:
        if n == 0:
            raise APIError(400, f"{field}: the prompt is empty", field)
        if n >= self.max_model_len:
            raise context_overflow(n, self.max_model_len, field)

    def parser(self, prompt: RenderedPrompt) -> OutputParser:
        """A fresh output parser for one reply (fed the forced prefix first)."""
        in_reasoning = self.reasoning and prompt.text.rstrip().endswith(THINK_OPEN)
        parser = OutputParser(self.tool_parser, self.reasoning, in_reasoning, prompt.tools_enabled,
                              prompt.text_params)
        if prompt.assistant_prefix:
            parser.feed(prompt.assistant_prefix)
        return parser

    # -- sampling -------------------------------------------------------------------------------
    def max_tokens(self, requested: int | None, prompt_len: int, field: str, request_id: str = "") -> int:
        """Tokens to generate: what was asked, else the rest of the context. A request for more than
        fits is clamped to what fits (agents ask for 32000 whatever the model), and logged."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            log.info("clamped %s", field, extra={"fields": {
                "id": request_id, "field": field, "requested": requested, "used": room,
                "prompt_tokens": prompt_len, "context": self.max_model_len}})
        return min(requested, room)

    def sampling(self, max_tokens: int, stop: list[str] | None, **fields: Any) -> SamplingParams:
        """SamplingParams from API fields (None means the API's default); invalid values are a 400.
        A harmony model's text keeps its special tokens: its parser reads the channels from them."""
        values = {k: v for k, v in fields.items() if v is not None}
        if self.tool_parser == "harmony":
            values.setdefault("skip_special_tokens", False)
        if values.get("top_k") == -1:
            values["top_k"] = 0  # -1 disables top-k, as in vLLM
        stops = list(stop or [])
        for i, s in enumerate(stops):
            if not s:
                raise APIError(400, f"stop.{i}: stop strings must not be empty", "stop")
        if len(stops) > 16:
            raise APIError(400, "stop: at most 16 stop strings", "stop")
        if "logit_bias" in values:
            values["logit_bias"] = self._logit_bias(values["logit_bias"])
        for token in values.get("stop_token_ids", ()):
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"stop_token_ids: {token} is not a token id of this model (vocabulary of "
                                    f"{self.vocab_size})", "stop_token_ids")
        try:
            return SamplingParams(max_tokens=max_tokens, stop=stops, **values)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split()[0]) from None

    def _logit_bias(self, bias: dict[Any, float]) -> dict[int, float]:
        """OpenAI's ``logit_bias`` (token ids as strings or numbers -> a bias in [-100, 100]) with its
        ids checked against this model's vocabulary."""
        if not isinstance(bias, dict) or len(bias) > 300:
            raise APIError(400, "logit_bias: give an object of at most 300 token ids -> bias", "logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise APIError(400, f"logit_bias.{str(key)[:40]}: a bias is a number in [-100, 100]", "logit_bias")
            digits = isinstance(key, str) and key.isdecimal() and len(key) <= 12
            token = int(key) if isinstance(key, int) or digits else -1
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"logit_bias: {str(key)[:40]!r} is not a token id of this model (vocabulary of "
                                    f"{self.vocab_size})", "logit_bias")
            out[token] = float(value)
        return out


def tool_mode(choice: str | None, name: str | None, tools: list[dict[str, Any]] | None,
              field: str = "tool_choice") -> ToolMode:
    """A request's tool choice: ``choice`` one of none / auto / required (None: not given, auto),
    or a function ``name`` that must be among ``tools``; a choice other than none needs tools."""
    if name is not None:
        if name not in [t["function"]["name"] for t in tools or []]:
            raise APIError(400, f"{field}: no tool named '{name}'", field)
        return ToolMode("named", name)
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, f"{field}: '{choice}' needs tools", field)
    return ToolMode(choice or "auto")


def tool_json(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool in the OpenAI function format that chat templates expect."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


# What a client may pass to the chat template (``chat_template_kwargs``): the switches templates
# document, each with the type it takes. The template itself comes from the model or the operator.
TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool, "thinking": bool, "reasoning_effort": str}


def check_template_kwargs(kwargs: dict[str, Any] | None, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """The client's template switches, checked: any key not in :data:`TEMPLATE_KWARGS` (a client's own
    ``chat_template`` included) or a value of the wrong type is a 400."""
    for key, value in (kwargs or {}).items():
        kind = TEMPLATE_KWARGS.get(key)
        if kind is None:
            raise APIError(400, f"{field}.{key}: not accepted (accepted: {', '.join(TEMPLATE_KWARGS)}; the chat "
                                "template is the model's)", f"{field}.{key}")
        if not isinstance(value, kind) or (isinstance(value, str) and len(value) > 32):
            raise APIError(400, f"{field}.{key}: must be a {kind.__name__}"
                                f"{' of at most 32 characters' if kind is str else ''}", f"{field}.{key}")
    return dict(kwargs or {})


def parse_arguments(arguments: str | dict[str, Any], field: str) -> dict[str, Any]:
    """Tool-call arguments of a past assistant turn, as the dict chat templates expect."""
    if isinstance(arguments, dict):
        return arguments
    value = loads_bounded(arguments, f"{field}: the arguments string", field) if arguments.strip() else {}
    if not isinstance(value, dict):
        raise APIError(400, f"{field}: arguments must be a JSON object", field)
    return value


def place_system_messages(messages: list[dict[str, Any]], mid_system: bool) -> list[dict[str, Any]]:
    """System messages anywhere in a conversation, made renderable without losing one.

    The leading ones become one system turn. A later one stays where it is when the template
    renders such messages (``mid_system``); otherwise it becomes a marked note in the user turn it
    introduces (the next user message before any assistant reply), else at the end of the turn it
    follows, else a user turn of its own."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out: list[dict[str, Any]] = []
    if lead:
        out.append({"role": "system", "content": "\n\n".join(m["content"] or "" for m in messages[:lead])})
    pending: list[str] = []  # notes waiting for the user turn they introduce
    for m in messages[lead:]:
        if m["role"] == "system" and not mid_system:
            pending.append(f"<system_note>\n{m['content'] or ''}\n</system_note>")
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": "\n\n".join(pending + [m["content"] or ""])}
            pending = []
        elif pending and m["role"] == "assistant":
            _attach_notes(out, pending)
            pending = []
        out.append(m)
    if pending:
        _attach_notes(out, pending)
    return out


def _attach_notes(out: list[dict[str, Any]], notes: list[str]) -> None:
    """Notes with no user turn after them: appended to the user or tool turn they follow, or a user turn."""
    last = out[-1] if out else None
    if last is not None and last["role"] in ("user", "tool"):
        out[-1] = {**last, "content": "\n\n".join([last["content"] or ""] + notes)}
    else:
        out.append({"role": "user", "content": "\n\n".join(notes)})
