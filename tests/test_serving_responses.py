"""The Responses API through the official openai SDK: create and stream, function tools with a
round trip, reasoning items, structured output, previous_response_id and the bounded store."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serving_helpers import SCRIPTS, WEATHER_TOOL

TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
        "parameters": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_create_returns_a_message_and_usage(client) -> None:
    r = client.responses.create(model="tiny", input="SCRIPT:STOPWORD go", max_output_tokens=40)
    assert r.status == "completed" and r.output_text == SCRIPTS["STOPWORD"]
    assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client) -> None:
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_reasoning_becomes_a_reasoning_item(client) -> None:
    r = client.responses.create(model="tiny", input="SCRIPT:THINK hi", max_output_tokens=60)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user greets me. I greet back."
    assert r.output_text == "Hello there!" and r.usage.output_tokens_details.reasoning_tokens > 0


def test_stream_events_rebuild_the_same_response(client) -> None:
    events = list(client.responses.create(model="tiny", input="SCRIPT:THINK hi", max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert text == final.output_text == "Hello there!" and thought == final.output[0].content[0].text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2


def test_stream_helper_accumulates_the_final_response(client) -> None:
    with client.responses.stream(model="tiny", input="SCRIPT:STOPWORD go", max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == SCRIPTS["STOPWORD"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_with_previous_response_id(client, stream) -> None:
    kwargs = dict(model="tiny", tools=[TOOL], max_output_tokens=80)
    if stream:
        events = list(client.responses.create(input="SCRIPT:WEATHER in Paris?", stream=True, **kwargs))
        first = events[-1].response
        assert any(e.type == "response.function_call_arguments.done" for e in events)
    else:
        first = client.responses.create(input="SCRIPT:WEATHER in Paris?", **kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    follow = client.responses.create(
        previous_response_id=first.id, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                "output": "sunny, 21 C"}, {"role": "user", "content": "SCRIPT:THINK"}],
        **kwargs)
    assert follow.output_text == "Hello there!" and follow.previous_response_id == first.id
    # the stored history was rendered: the whole first turn is a cached prefix of the second
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_tool_round_trip_with_the_whole_history_as_input(client) -> None:
    first = client.responses.create(model="tiny", input="SCRIPT:WEATHER now", tools=[TOOL], max_output_tokens=80,
                                    store=False)
    call = next(item for item in first.output if item.type == "function_call")
    history = [{"role": "user", "content": "SCRIPT:WEATHER now"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "rain"},
               {"role": "user", "content": [{"type": "input_text", "text": "SCRIPT:STOPWORD"},
                                            {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]
    r = client.responses.create(model="tiny", input=history, tools=[TOOL], max_output_tokens=40)
    assert r.output_text == SCRIPTS["STOPWORD"]
    with pytest.raises(openai.NotFoundError):  # store=False: not kept
        client.responses.retrieve(first.id)


def test_forced_tool_and_structured_text(client) -> None:
    city = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 8}},
            "additionalProperties": False}
    r = client.responses.create(model="tiny", input="weather?", max_output_tokens=120, temperature=1.0,
                                extra_body={"seed": 4}, tools=[{**TOOL, "parameters": city}], tool_choice="required")
    assert [item.type for item in r.output] == ["function_call"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="a number", max_output_tokens=60, temperature=1.0,
                                extra_body={"seed": 4},
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_store_retrieve_delete_and_unknown_ids(client) -> None:
    r = client.responses.create(model="tiny", input="SCRIPT:STOPWORD", instructions="Be brief.", max_output_tokens=40)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.instructions == "Be brief."
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="text.format.schema is required"):
        client.responses.create(model="tiny", input="x", text={"format": {"type": "json_schema", "name": "x"}})
    with pytest.raises(openai.BadRequestError, match="input.0.call_id"):
        client.responses.create(model="tiny", input=[{"type": "function_call_output", "output": "x"}])
    with pytest.raises(openai.BadRequestError, match="tools.1.tools.0.name"):
        client.responses.create(model="tiny", input="x", tools=[TOOL, {"type": "namespace", "tools": [
            {"type": "function", "parameters": {"type": "object"}}]}])


def test_codex_tool_kinds_namespaces_flattened_hosted_tools_left_out(client) -> None:
    # What Codex sends: function tools, a namespace of more, and hosted tools this server cannot run.
    tools = [{"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [TOOL]},
             {"type": "web_search", "external_web_access": False}, {"type": "custom", "name": "apply_patch"}]
    r = client.responses.create(model="tiny", input="SCRIPT:WEATHER", tools=tools, max_output_tokens=80)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, c.namespace) for c in calls] == [("get_weather", "agents")]
    with pytest.raises(openai.BadRequestError, match="two tools are named 'get_weather'"):
        client.responses.create(model="tiny", input="x", tools=[TOOL, *tools])


def test_usage_reports_cache_reads_and_writes(client) -> None:
    first = client.responses.create(model="tiny", input="SCRIPT:STOPWORD cache me " * 20, max_output_tokens=20)
    again = client.responses.create(model="tiny", input="SCRIPT:STOPWORD cache me " * 20, max_output_tokens=20)
    details = again.usage.input_tokens_details
    assert first.usage.input_tokens_details.cache_write_tokens > 0
    assert details.cached_tokens + details.cache_write_tokens == again.usage.input_tokens and details.cached_tokens


def test_the_store_is_bounded() -> None:
    from hearth.serving.responses_format import ResponseStore

    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is None and store.get("r4") is not None
