"""Structured output through the real clients: ``response_format`` JSON schemas (openai SDK and
LangChain), and forced tool calls (``tool_choice`` required / named, Anthropic any / tool),
streamed and not. The model has random weights: only the grammar makes its output valid."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

S = {"type": "string", "maxLength": 8}  # bounded: a random model would otherwise write on and on
I = {"type": "integer", "minimum": -50, "maximum": 50}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    _obj({"name": S}),
    _obj({"n": I}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"kind": {"enum": ["cat", "dog", "fish"]}}),
    _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    _obj({"point": _obj({"x": I, "y": I})}),
    _obj({"a": S, "b": I, "c": {"type": "boolean"}}),
    _obj({"user": _obj({"name": S, "role": {"enum": ["admin", "guest"]}}), "active": {"type": "boolean"}}),
    _obj({"items": {"type": "array", "items": _obj({"id": I, "label": S}), "maxItems": 2}}),
    _obj({"maybe": {"anyOf": [I, {"type": "null"}]}}),
    _obj({"status": {"const": "done"}, "code": I}),
    _obj({"required_one": S, "optional_one": I}, required=["required_one"]),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    _obj({"level": {"type": "integer", "enum": [1, 2, 3]}, "note": S}),
    _obj({"deep": _obj({"deeper": _obj({"deepest": {"enum": ["yes", "no"]}})})}),
    _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}}),
    _obj({"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}}),
    _obj({"choice": {"oneOf": [_obj({"a": I}), _obj({"b": S})]}}),
    _obj({"id": I, "meta": _obj({"k": S, "v": {"type": ["integer", "null"], "maximum": 9, "minimum": 0}}),
          "labels": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}),
]
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": _obj({"city": S, "days": {"type": "integer", "minimum": 1, "maximum": 9}}, required=["city"])}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": _obj({"zone": S})}}


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON: {what}"}]


def test_json_schema_strict_output_validates_on_twenty_schemas(oclient) -> None:
    assert len(SCHEMAS) == 20
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        r = oclient.chat.completions.create(model="tiny", messages=_ask(f"schema {i}"), response_format=fmt,
                                            temperature=1.0, seed=i, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_output_streamed_validates(oclient) -> None:
    schema = SCHEMAS[9]
    fmt = {"type": "json_schema", "json_schema": {"name": "items", "schema": schema, "strict": True}}
    stream = oclient.chat.completions.create(model="tiny", messages=_ask("items"), response_format=fmt, stream=True,
                                             temperature=1.0, seed=3, max_tokens=300)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_a_json_object(oclient) -> None:
    r = oclient.chat.completions.create(model="tiny", messages=_ask("anything"), max_tokens=200, temperature=0,
                                        response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_sdk_parse_helper_returns_the_pydantic_object(oclient) -> None:
    r = oclient.chat.completions.parse(model="tiny", messages=_ask("a pet"), response_format=Pet,
                                       temperature=1.0, seed=5, max_tokens=200)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_langchain_with_structured_output_default(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny",
                                      temperature=1.0, seed=2, max_tokens=200, max_retries=0)
    for seed in range(3):
        pet = llm.bind(seed=seed).with_structured_output(Pet).invoke("Describe a pet.")
        assert isinstance(pet, Pet), pet


def test_bad_response_formats_get_clear_errors(oclient) -> None:
    with pytest.raises(openai.BadRequestError, match="json_schema.schema is required"):
        oclient.chat.completions.create(model="tiny", messages=_ask("x"),
                                        response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="not a valid JSON Schema") as err:
        oclient.chat.completions.create(model="tiny", messages=_ask("x"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="must be 'object'"):
        oclient.chat.completions.create(model="tiny", messages=_ask("x"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}})


# -- forced tool calls ------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_openai_forced_tool_choice_always_yields_a_parsed_call(oclient, choice) -> None:
    for seed in range(4):
        r = oclient.chat.completions.create(model="tiny", messages=_ask("weather?"), tools=[CITY_TOOL, TIME_TOOL],
                                            tool_choice=choice, temperature=1.0, seed=seed, max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0].message
        name = calls[0].function.name
        assert name in ("get_weather", "get_time") if choice == "required" else name == "get_time"
        schema = (CITY_TOOL if name == "get_weather" else TIME_TOOL)["function"]["parameters"]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_openai_forced_tool_call_streamed(oclient) -> None:
    stream = oclient.chat.completions.create(model="tiny", messages=_ask("weather?"), tools=[CITY_TOOL],
                                             tool_choice="required", temperature=1.0, seed=9, max_tokens=200,
                                             stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)),
                        CITY_TOOL["function"]["parameters"])


def test_forced_call_overrides_a_reply_that_would_be_prose(oclient) -> None:
    # The scripted processor pushes prose; the grammar still makes it a call.
    r = oclient.chat.completions.create(model="tiny", messages=_ask("SCRIPT:PROSE"), tools=[CITY_TOOL],
                                        tool_choice="required", max_tokens=200, seed=1)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def _anthropic_tools() -> list[dict]:
    return [{"name": t["function"]["name"], "description": "a tool", "input_schema": t["function"]["parameters"]}
            for t in (CITY_TOOL, TIME_TOOL)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_choice_always_yields_tool_use(aclient, choice) -> None:
    for seed in range(3):
        msg = aclient.messages.create(model="tiny", max_tokens=200, tools=_anthropic_tools(), tool_choice=choice,
                                      messages=[{"role": "user", "content": f"weather {seed}?"}])
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1, msg.content
        assert choice["type"] == "any" or uses[0].name == "get_weather"


def test_anthropic_forced_tool_use_streamed(aclient) -> None:
    with aclient.messages.stream(model="tiny", max_tokens=200, tools=_anthropic_tools(),
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "weather?"}]) as stream:
        msg = stream.get_final_message()
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, CITY_TOOL["function"]["parameters"])


RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}


def test_a_schema_no_finite_value_matches_is_refused_before_generating(oclient, aclient, server) -> None:
    import anthropic
    import requests

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}
    with pytest.raises(openai.BadRequestError, match="no finite JSON value"):
        oclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], response_format=fmt)
    tool = {"type": "function", "function": {"name": "nest", "parameters": RECURSIVE}}
    with pytest.raises(openai.BadRequestError, match="tools.nest.parameters"):
        oclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[tool],
                                        tool_choice="required")
    with pytest.raises(anthropic.BadRequestError, match="no finite JSON value"):
        aclient.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "x"}],
                                tools=[{"name": "nest", "input_schema": RECURSIVE}], tool_choice={"type": "any"})
    r = requests.post(server.url + "/v1/responses", timeout=30, json={"model": "tiny", "input": "x", "text": {
        "format": {"type": "json_schema", "name": "r", "schema": RECURSIVE}}})
    assert r.status_code == 400 and "no finite JSON value" in r.json()["error"]["message"]
    # A recursion with a way out is fine (and read strictly: no keys beyond "child").
    ok = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["child"]}
    reply = oclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                            response_format={"type": "json_schema", "json_schema": {"name": "o",
                                                                                                    "schema": ok}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), {**ok, "additionalProperties": False})
    else:  # cut at max_tokens: reported as such
        assert choice.finish_reason == "length"


def test_an_unfinished_grammar_reports_length(oclient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": _obj({"a": S, "b": S, "c": S})}}
    reply = oclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                            response_format=fmt)
    assert reply.choices[0].finish_reason == "length"


OPEN = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


def test_forced_calls_with_an_open_schema_close_on_the_demo_model() -> None:
    """JSON Schema's open default (any other key) read strictly: a forced call on the demo model
    ends with a parsed call within 64 tokens in both APIs (unread, it invented keys until max_tokens)."""
    import anthropic

    from hearth.engine.checkpoint.demo import demo_model_dir
    from tests.serving_helpers import running_server

    with running_server(demo_model_dir(), scripted=False) as srv:
        a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        o = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for seed in range(3):
            m = a.messages.create(model="tiny", max_tokens=64, tool_choice={"type": "any"},
                                  tools=[{"name": "get_weather", "input_schema": OPEN}],
                                  messages=[{"role": "user", "content": f"weather {seed}"}])
            assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use", m
            assert set(m.content[-1].input) <= {"city", "days"}
            c = o.chat.completions.create(model="tiny", max_tokens=64, tool_choice="required", seed=seed,
                                          messages=[{"role": "user", "content": f"weather {seed}"}], tools=[
                                              {"type": "function", "function": {"name": "get_weather",
                                                                                "parameters": OPEN}}])
            assert c.choices[0].finish_reason == "tool_calls", c
            assert set(json.loads(c.choices[0].message.tool_calls[0].function.arguments)) <= {"city", "days"}


def test_grammars_never_compile_on_the_engine_thread(agent_checkpoint, monkeypatch) -> None:
    """The tokenizer view is built while the server loads, and each request's matcher on a worker
    thread: the thread that steps the engine (every stream's tokens) never waits for either."""
    import threading

    from hearth.engine.text.grammar import Grammars
    from tests.serving_helpers import running_server

    threads: list[str] = []
    original = Grammars.matcher

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Grammars, "matcher", recording)
    with running_server(agent_checkpoint, scripted=False) as srv:
        grammars = srv.state.client.engine.grammars
        assert grammars._tokenizer is not None  # built while loading (its warm-up matcher too)
        threads.clear()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[1]}}
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=40, response_format=fmt)
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[1])
    assert threads and "hearth-engine" not in threads, threads
