"""Constrained decoding in the engine: sampled output always matches the request's grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hearth.engine.demo import demo_model_dir
from hearth.engine.llm import LLM
from hearth.engine.structured import GrammarError, json_schema_grammar
from hearth.proto.contracts import SamplingParams
from hearth.serving.constraints import GrammarBuilder
from hearth.serving.parsers import parse_xml_call

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "kind", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                         "kind": {"enum": ["a", "b"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_model_dir())


def test_sampled_json_always_matches_the_schema(llm) -> None:
    grammar = json_schema_grammar(SCHEMA)
    for seed in range(4):
        out = llm.generate("def f(x):", SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar))[0]
        assert out.chunk.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_forced_tool_call_grammar_yields_a_call_to_a_given_tool(llm) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call("hermes", tools, "get_weather")
    for seed in range(3):
        out = llm.generate("<tool_call>\n", SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                          grammar=grammar))[0]
        body, tail = out.text.rsplit("\n</tool_call>", 1)
        call = json.loads(body)
        assert tail == "" and call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], params)


def test_forced_xml_tool_call_grammar_yields_a_parsable_call(llm) -> None:
    params = {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call("qwen3_coder", tools, "get_weather")
    for seed in range(3):
        out = llm.generate("<tool_call>\n", SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                          grammar=grammar))[0]
        body, tail = out.text.rsplit("</tool_call>", 1)
        call = parse_xml_call(body)
        assert tail == "" and call is not None and call.name == "get_weather", out.text
        assert "city" in call.input and call.input.get("unit", "c") in ("c", "f")


def test_a_grammar_that_does_not_compile_is_refused(llm) -> None:
    with pytest.raises(GrammarError, match="invalid"):
        llm.engine.add_request("x", SamplingParams(grammar=json_schema_grammar({"type": "objectx"})))
