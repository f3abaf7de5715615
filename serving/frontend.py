"""Prompt rendering for the APIs: chat template, tools, token counting, output parsers, sampling.

Both protocols convert their messages into the chat-template message format used by Hugging
Face templates (``role``/``content``, ``tool_calls`` with ``function``, ``tool`` messages,
``reasoning_content``), render with the checkpoint's template and tokenize here, so remote engines
only ever see token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hearth.engine.sampling import SamplingParams
from hearth.serving.errors import APIError
from hearth.serving.parsers import THINK_CLOSE, THINK_OPEN, OutputParser, choose_tool_parser


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt: its token ids, and text the reply is forced to begin with."""

    ids: list[int]
    text: str
    assistant_prefix: str = ""
    tools_enabled: bool = False


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
        vocab = tokenizer.get_vocab()
        self.reasoning = THINK_OPEN in vocab and THINK_CLOSE in vocab

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_mode: ToolMode,
                    template_kwargs: dict[str, Any] | None = None) -> RenderedPrompt:
        """Render with the checkpoint's template; forced tool use starts the reply with the call tag."""
        if not self.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions with a raw prompt", "messages")
        use_tools = bool(tools) and tool_mode.mode != "none"
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools if use_tools else None, tokenize=False, add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - template errors (raise_exception, bad roles) are client errors
            raise APIError(400, f"messages: the chat template rejected the conversation ({exc})", "messages") from None
        prefix = self._forced_prefix(tool_mode) if use_tools else ""
        ids = self.encode(text + prefix)
        self.check_prompt_length(len(ids), "messages")
        return RenderedPrompt(ids, text + prefix, prefix, use_tools and self.tool_parser != "none")

    def _forced_prefix(self, tool_mode: ToolMode) -> str:
        if tool_mode.mode not in ("required", "named"):
            return ""
        if self.tool_parser not in ("hermes", "qwen3_coder"):
            raise APIError(400, "tool_choice: forcing a tool call is not supported for this model", "tool_choice")
        if tool_mode.mode == "required":
            return "<tool_call>\n"
        if self.tool_parser == "qwen3_coder":
            return f"<tool_call>\n<function={tool_mode.name}>\n"
        return '<tool_call>\n{"name": ' + json.dumps(tool_mode.name) + ', "arguments": '

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
            raise APIError(400, f"{field}: the prompt has {n} tokens but the model's context is "
                                f"{self.max_model_len} tokens", field)

    def parser(self, prompt: RenderedPrompt) -> OutputParser:
        """A fresh output parser for one reply (fed the forced prefix first)."""
        in_reasoning = self.reasoning and prompt.text.rstrip().endswith(THINK_OPEN)
        parser = OutputParser(self.tool_parser, self.reasoning, in_reasoning, prompt.tools_enabled)
        if prompt.assistant_prefix:
            parser.feed(prompt.assistant_prefix)
        return parser

    # -- sampling -------------------------------------------------------------------------------
    def max_tokens(self, requested: int | None, prompt_len: int, field: str) -> int:
        """Tokens to generate: what was asked (at most the context), else the rest of the context."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > self.max_model_len:
            raise APIError(400, f"{field}: {requested} is more than the model's context of {self.max_model_len} "
                                "tokens", field)
        return min(requested, room)

    @staticmethod
    def sampling(max_tokens: int, stop: list[str] | None, **fields: Any) -> SamplingParams:
        """SamplingParams from API fields (None means the API's default); invalid values are a 400."""
        values = {k: v for k, v in fields.items() if v is not None}
        if values.get("top_k") == -1:
            values["top_k"] = 0  # -1 disables top-k, as in vLLM
        stops = list(stop or [])
        for i, s in enumerate(stops):
            if not s:
                raise APIError(400, f"stop.{i}: stop strings must not be empty", "stop")
        if len(stops) > 16:
            raise APIError(400, "stop: at most 16 stop strings", "stop")
        try:
            return SamplingParams(max_tokens=max_tokens, stop=stops, **values)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split()[0]) from None


def tool_json(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool in the OpenAI function format that chat templates expect."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def parse_arguments(arguments: str | dict[str, Any], field: str) -> dict[str, Any]:
    """Tool-call arguments of a past assistant turn, as the dict chat templates expect."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        raise APIError(400, f"{field}: arguments must be a JSON object string", field) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{field}: arguments must be a JSON object", field)
    return value
