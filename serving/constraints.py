"""Output grammars for what a request demands: JSON matching a schema (``response_format``) or a
call to one of the given tools (``tool_choice`` required / named, Anthropic any / tool).

The grammars are llguidance's Lark dialect; the engine applies them as a per-token mask. A tag
the tokenizer holds as one token (``</tool_call>``, ``</think>``) is written as that token
(``<[id]>``): a model emits the token, never the tag's characters one by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from hearth.engine import JSON_STYLE
from hearth.serving.errors import APIError


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
        rules = ["body: %json " + json.dumps({**strict_schema(schema), "x-guidance": dict(JSON_STYLE)})]
        return _lark(self._start("body", after_reasoning), rules)

    def tool_call(self, parser: str, tools: list[dict[str, Any]], name: str | None,
                  after_reasoning: str | None = None, open_tag: bool = False) -> str:
        """One call to ``name`` (or any of ``tools``) in the model's tool-call format (``parser``:
        one of :data:`FORCED_CALL_PREFIX`), ending with the closing tag. The reply starts after the
        format's prefix (put in the prompt) unless ``open_tag``."""
        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"no tool to call (named {name!r})")  # an empty alternation would accept ""
        style = _KV_STYLES.get(parser)
        close = self.tag(_CLOSE_TAG[parser])
        rules: list[str] = []
        for i, fn in enumerate(chosen):
            params = strict_schema(fn.get("parameters") or {"type": "object"})
            args = "%json " + json.dumps({**params, "x-guidance": dict(JSON_STYLE)})
            if style is not None:
                rules += _kv_call_rules(i, fn["name"], params, close, style)
            elif parser in _JSON_ARGS_CALLS:  # NAME and JSON arguments between the format's markers
                before, after = ([self.tag(p) if p.startswith("<") else json.dumps(p) for p in side]
                                 for side in _JSON_ARGS_CALLS[parser](fn["name"]))
                rules.append(f"call_{i}: {' '.join(before)} args_{i} {' '.join([*after, close])}")
                rules.append(f"args_{i}: {args}")
            else:
                head = json.dumps('{"name": ' + json.dumps(fn["name"]) + ', "arguments": ')
                rules.append(f"call_{i}: {head} args_{i} " + json.dumps("}\n") + f" {close}")
                rules.append(f"args_{i}: %json " + json.dumps({**params, "x-guidance": dict(JSON_STYLE)}))
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
        body = "call"
        if open_tag:
            tag, rest = _OPEN_TAG[parser]
            rules.append(f"opened: {self.tag(tag)} " + (json.dumps(rest) + " " if rest else "") + "call")
            body = "opened"
        return _lark(self._start(body, after_reasoning), rules)

    def _start(self, body: str, after_reasoning: str | None) -> str:
        if after_reasoning is None:
            return f"start: {body}"
        return f"start: THOUGHT {self.tag(after_reasoning)} /\\n{{0,2}}/ {body}\nTHOUGHT: /(.|\\n)*/"


# The formats a call can be forced in: the prompt prefix that opens the call (its tag, then text).
_OPEN_TAG = {"hermes": ("<tool_call>", "\n"), "qwen3_coder": ("<tool_call>", "\n"), "glm45": ("<tool_call>", ""),
             "minimax_m2": ("<minimax:tool_call>", "\n"), "deepseek_v3": ("<｜tool▁calls▁begin｜>", ""),
             "deepseek_v31": ("<｜tool▁calls▁begin｜>", ""), "harmony": ("<|channel|>", "commentary to=functions."),
             "deepseek_v4": ("<｜DSML｜tool_calls>", "\n"), "deepseek_v32": ("<｜DSML｜function_calls>", "\n"),
             "kimi_k2": ("<|tool_calls_section_begin|>", "")}
FORCED_CALL_PREFIX = {parser: tag + rest for parser, (tag, rest) in _OPEN_TAG.items()}
_CLOSE_TAG = {"hermes": "</tool_call>", "qwen3_coder": "</tool_call>", "glm45": "</tool_call>",
              "minimax_m2": "</minimax:tool_call>", "deepseek_v3": "<｜tool▁calls▁end｜>",
              "deepseek_v31": "<｜tool▁calls▁end｜>", "harmony": "<|call|>", "deepseek_v4": "</｜DSML｜tool_calls>",
              "deepseek_v32": "</｜DSML｜function_calls>", "kimi_k2": "<|tool_calls_section_end|>"}
# Formats whose arguments are one JSON object: the pieces before and after it for a tool NAME (a
# piece that starts with "<" is a marker, written as its token where the tokenizer has one).
_JSON_ARGS_CALLS = {
    "deepseek_v3": lambda name: (["<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", f"{name}\n```json\n"],
                                 ["\n```", "<｜tool▁call▁end｜>"]),
    "deepseek_v31": lambda name: (["<｜tool▁call▁begin｜>", name, "<｜tool▁sep｜>"], ["<｜tool▁call▁end｜>"]),
    "harmony": lambda name: ([f"{name} ", "<|constrain|>", "json", "<|message|>"], []),
    "kimi_k2": lambda name: (["<|tool_call_begin|>", f"functions.{name}:0", "<|tool_call_argument_begin|>"],
                             ["<|tool_call_end|>"]),
}


@dataclass(frozen=True)
class _KeyValueStyle:
    """How a format writes a call of named parameters: ``{name}`` / ``{key}`` are filled in;
    ``text_head`` opens a value written as raw text where the format marks those apart (DSML)."""

    call_head: str
    param_head: str
    param_end: str
    call_tail: str
    text_head: str | None = None


_KV_STYLES = {
    "qwen3_coder": _KeyValueStyle("<function={name}>\n", "<parameter={key}>\n", "\n</parameter>\n",
                                  "</function>\n"),
    "glm45": _KeyValueStyle("{name}", "\n<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>", "\n"),
    "minimax_m2": _KeyValueStyle('<invoke name="{name}">', '\n<parameter name="{key}">', "</parameter>",
                                 "\n</invoke>\n"),
    "deepseek_v4": _KeyValueStyle('<｜DSML｜invoke name="{name}">', '\n<｜DSML｜parameter name="{key}" string="false">',
                                  "</｜DSML｜parameter>", "\n</｜DSML｜invoke>\n",
                                  '\n<｜DSML｜parameter name="{key}" string="true">'),
}
_KV_STYLES["deepseek_v32"] = _KV_STYLES["deepseek_v4"]


def _kv_call_rules(i: int, name: str, params: dict[str, Any], close: str, style: _KeyValueStyle) -> list[str]:
    """A call of named parameters (Qwen3-Coder, GLM-4.5, MiniMax-M2, DSML): required parameters in
    schema order, then each optional one or not; a string value as raw text, others as JSON."""
    props: dict[str, Any] = params.get("properties") or {}
    required = [k for k in params.get("required") or [] if k in props]
    optional = [k for k in props if k not in required]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # what "$ref"s point into
    rules, items = [], []
    for j, key in enumerate(required + optional):
        rule, value = f"p_{i}_{j}", f"v_{i}_{j}"
        schema = {**defs, **props[key]}
        as_text = _is_plain_string(schema) or _is_text_enum(schema)
        param_head = style.text_head if as_text and style.text_head else style.param_head
        head = f"{rule}: " + json.dumps(param_head.format(key=key)) + f" {value}"
        if _is_plain_string(schema):
            # Raw text, ended by the closing tag: a lazy lexeme (a greedy one would eat the newline
            # before the tag; a value may hold "<" and newlines). Its length is not bounded: with a
            # bounded regex, llguidance's mask offers only end-of-sequence once the bound is reached.
            rules.append(head)
            rules.append(f"{value}[stop={json.dumps(style.param_end)}]: /(.|\\n)*/")
        else:
            rules.append(f"{head} " + json.dumps(style.param_end))
            rules.append(f"{value}: " + _xml_value(schema))
        items.append(rule if key in required else f"{rule}?")
    call_head = json.dumps(style.call_head.format(name=name))
    rules.insert(0, f"call_{i}: {call_head} {' '.join(items)} {json.dumps(style.call_tail)} {close}")
    return rules


def _is_plain_string(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "string" and "enum" not in schema and "pattern" not in schema


def _is_text_enum(schema: dict[str, Any]) -> bool:
    enum = schema.get("enum")
    return bool(enum) and all(isinstance(v, str) for v in enum)


def _xml_value(schema: dict[str, Any]) -> str:
    """A non-text parameter value: one of a string enum as raw text, anything else as JSON."""
    if _is_text_enum(schema):
        return " | ".join(json.dumps(v) for v in schema["enum"])
    return "%json " + json.dumps({**schema, "x-guidance": dict(JSON_STYLE)})


def _lark(start: str, rules: list[str]) -> str:
    return llguidance.grammar_from("lark", start + "\n" + "\n".join(rules) + "\n")


def check_grammar(grammar: str, field: str) -> None:
    """A grammar (built from a client's schema) that does not compile is a 400 on ``field``."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"{field}: the schema cannot be enforced ({error.strip().splitlines()[0]})", field)


# -- what a schema admits -------------------------------------------------------------------------
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def strict_schema(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` read strictly, as xgrammar's strict mode and OpenAI's structured outputs do: an
    object takes only the properties it declares unless it says otherwise (``additionalProperties``
    or ``patternProperties``). JSON Schema's open default would let a model invent keys until it
    runs out of tokens. (Members of an ``allOf`` stay as written: each declares only part.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_schema(v, in_all_of=True) for v in out["allOf"]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if is_object and not in_all_of and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def check_satisfiable(schema: Any, field: str) -> None:
    """A 400 on ``field`` for a schema no finite JSON value matches (a required property, or the
    items of a non-empty array, that lead back to their own schema): its grammar could never be
    completed, and the reply would run to ``max_tokens`` as unfinished JSON."""
    if not has_finite_instance(schema):
        raise APIError(400, f"{field}: no finite JSON value matches this schema (a required property or a "
                            "non-empty array refers back to its own schema on every path)", field)


def has_finite_instance(schema: Any) -> bool:
    """Whether some finite JSON value matches ``schema``, as far as recursion decides it (a fixed
    point: a node has one once any of its ways out is known to end)."""
    nodes: dict[int, dict[str, Any]] = {}
    _collect(schema, nodes)
    known: set[int] = set()
    changed = True
    while changed:
        changed = False
        for key, node in nodes.items():
            if key not in known and _ends(node, schema, known):
                known.add(key)
                changed = True
    return schema is not False and (not isinstance(schema, dict) or id(schema) in known)


def _collect(schema: Any, nodes: dict[int, dict[str, Any]]) -> None:
    if isinstance(schema, dict) and id(schema) not in nodes:
        nodes[id(schema)] = schema
        for value in schema.values():
            _collect(value, nodes)
    elif isinstance(schema, list):
        for value in schema:
            _collect(value, nodes)


def _ends(node: dict[str, Any], root: Any, known: set[int]) -> bool:
    """Whether ``node`` has a finite instance given the subschemas already ``known`` to."""
    def ok(sub: Any) -> bool:
        return sub is not False and (not isinstance(sub, dict) or id(sub) in known)

    if "$ref" in node and not ok(_resolve(root, node["$ref"])):
        return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
            return False
    if "enum" in node or "const" in node:
        return True
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None or any(t not in ("object", "array") for t in types):
        return True  # some scalar (or any value) matches
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if "object" in types and all(ok(props[k]) for k in node.get("required") or [] if k in props):
        return True
    items = node.get("items")
    return "array" in types and (not node.get("minItems") or items is None or ok(items))


def _resolve(root: Any, ref: Any) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/x``) names; True (anything) for others."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return True
    target = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return True  # an unresolvable ref is the grammar library's to report
    return target
