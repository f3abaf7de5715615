"""Output grammars for what a request demands: JSON matching a schema (``response_format``) or a
call to one of the given tools (``tool_choice`` required / named, Anthropic any / tool).

The grammars are llguidance's Lark dialect; the engine applies them as a per-token mask. A tag
the tokenizer holds as one token (``</tool_call>``, ``</think>``) is written as that token
(``<[id]>``): a model emits the token, never the tag's characters one by one.
"""

from __future__ import annotations

import json
from typing import Any

from hearth.serving.errors import APIError

# JSON laid out as json.dumps and the templates' tojson write it (what the model saw in training);
# free whitespace would let a small model pad until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarBuilder:
    """Grammar pieces that depend on one tokenizer (which tags are single tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self._vocab = tokenizer.get_vocab()
        self._tokenizer = tokenizer

    def tag(self, text: str) -> str:
        """``text`` as a grammar item: its token when the tokenizer has one for it, else a literal."""
        token = self._vocab.get(text)
        if token is not None and self._tokenizer.encode(text, add_special_tokens=False) == [token]:
            return f"<[{token}]>"
        return json.dumps(text)

    def json(self, schema: dict[str, Any], after_reasoning: str | None = None) -> str:
        """Compact JSON matching ``schema``; ``after_reasoning`` (the closing think tag) lets the
        reply reason freely first, for prompts that open a think block."""
        rules = ["body: %json " + json.dumps({**schema, "x-guidance": JSON_STYLE})]
        return _lark(self._start("body", after_reasoning), rules)

    def tool_call(self, parser: str, tools: list[dict[str, Any]], name: str | None,
                  after_reasoning: str | None = None, open_tag: bool = False) -> str:
        """One call to ``name`` (or any of ``tools``) in the model's tool-call format, ending with
        the closing tag. The reply starts after ``<tool_call>\\n`` unless ``open_tag``."""
        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        close = self.tag("</tool_call>")
        rules: list[str] = []
        for i, fn in enumerate(chosen):
            params = fn.get("parameters") or {"type": "object"}
            if parser == "qwen3_coder":
                rules += _xml_call_rules(i, fn["name"], params, close)
            else:
                head = json.dumps('{"name": ' + json.dumps(fn["name"]) + ', "arguments": ')
                rules.append(f"call_{i}: {head} args_{i} " + json.dumps("}\n") + f" {close}")
                rules.append(f"args_{i}: %json " + json.dumps({**params, "x-guidance": JSON_STYLE}))
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
        body = "call"
        if open_tag:
            rules.append(f"opened: {self.tag('<tool_call>')} " + json.dumps("\n") + " call")
            body = "opened"
        return _lark(self._start(body, after_reasoning), rules)

    def _start(self, body: str, after_reasoning: str | None) -> str:
        if after_reasoning is None:
            return f"start: {body}"
        return f"start: THOUGHT {self.tag(after_reasoning)} /\\n{{0,2}}/ {body}\nTHOUGHT: /(.|\\n)*/"


def _xml_call_rules(i: int, name: str, params: dict[str, Any], close: str) -> list[str]:
    """A Qwen3-Coder XML call: required parameters in schema order, then each optional one or not."""
    props: dict[str, Any] = params.get("properties") or {}
    required = [k for k in params.get("required") or [] if k in props]
    optional = [k for k in props if k not in required]
    rules, items = [], []
    for j, key in enumerate(required + optional):
        rule = f"p_{i}_{j}"
        rules.append(f"{rule}: " + json.dumps(f"<parameter={key}>\n") + f" v_{i}_{j} " + json.dumps("\n</parameter>\n"))
        rules.append(f"v_{i}_{j}: " + _xml_value(props[key]))
        items.append(rule if key in required else f"{rule}?")
    head = json.dumps(f"<function={name}>\n")
    tail = json.dumps("</function>\n")
    rules.insert(0, f"call_{i}: {head} {' '.join(items)} {tail} {close}")
    return rules


def _xml_value(schema: dict[str, Any]) -> str:
    """A parameter value as the XML format writes it: strings raw, anything else as JSON."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return " | ".join(json.dumps(v) for v in enum)
    if schema.get("type") == "string" and not enum:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        return f"/[^<]{{{low},{'' if high is None else high}}}/"
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _lark(start: str, rules: list[str]) -> str:
    import llguidance

    return llguidance.grammar_from("lark", start + "\n" + "\n".join(rules) + "\n")


def check_grammar(grammar: str, field: str) -> None:
    """A grammar (built from a client's schema) that does not compile is a 400 on ``field``."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"{field}: the schema cannot be enforced ({error.strip().splitlines()[0]})", field)
