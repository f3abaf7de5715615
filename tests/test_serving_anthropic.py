"""The Anthropic-compatible API, driven by the official ``anthropic`` SDK against a real engine."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
import requests

from tests.serving_helpers import SCRIPTS

WEATHER = {"name": "get_weather", "description": "Weather forecast for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_events(response: requests.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_plain_message_and_usage(server, client):
    m = client.messages.create(model="tiny", max_tokens=6, system="Be brief.", messages=user("hello"))
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("max_tokens", "end_turn")
    tok = server.state.frontend.tokenizer
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *user("hello")], tokenize=False,
                                       add_generation_prompt=True)
    assert m.usage.input_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert 1 <= m.usage.output_tokens <= 6
    count = client.messages.count_tokens(model="tiny", system="Be brief.", messages=user("hello"))
    assert count.input_tokens == m.usage.input_tokens


def test_stream_equals_non_stream_and_event_order(server, client):
    # The Anthropic API has no seed (and this SDK version no sampling fields): compare greedy replies,
    # passing the sampling fields the server accepts through extra_body.
    kwargs = dict(model="tiny", max_tokens=20, messages=user("Write something."), extra_body={"temperature": 0})
    full = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in full.content if b.type == "text")
    assert final.usage.output_tokens == full.usage.output_tokens
    body = {"model": "tiny", "max_tokens": 20, "messages": user("Write something."), "stream": True}
    r = requests.post(server.url + "/v1/messages", json=body, stream=True, timeout=60)
    names = [n for n, _ in sse_events(r)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) <= {"content_block_delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_blocks(client, stream):
    kwargs = dict(model="tiny", max_tokens=200, tools=[WEATHER], messages=user("SCRIPT:THINK_TOOL weather?"),
                  thinking={"type": "enabled", "budget_tokens": 100})
    if stream:
        with client.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kwargs)
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "tool_use"], kinds
    assert m.content[0].thinking == "I need the weather."
    tool = m.content[1]
    assert tool.name == "get_weather" and tool.input == {"city": "Oslo"} and tool.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"


def test_tool_result_round_trip(client):
    messages = [
        *user("weather?"),
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "call it", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "SCRIPT:THINK thanks"}]},
    ]
    m = client.messages.create(model="tiny", max_tokens=100, tools=[WEATHER], messages=messages)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == "Hello there!" and m.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_call_is_text(client, stream):
    kwargs = dict(model="tiny", max_tokens=100, tools=[WEATHER], messages=user("SCRIPT:BAD_CALL"))
    if stream:
        with client.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == SCRIPTS["BAD_CALL"]
    assert m.stop_reason == "end_turn"


def test_stop_sequences(client):
    m = client.messages.create(model="tiny", max_tokens=50, stop_sequences=[" STOP"], messages=user("SCRIPT:STOPWORD"))
    assert m.content[0].text == "alpha beta"
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " STOP"


def test_async_concurrent_streams(server):
    async def main():
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
        try:
            async def one(i):
                async with client.messages.stream(model="tiny", max_tokens=8, extra_body={"temperature": 0},
                                                  messages=user(f"prompt {i}")) as s:
                    return (await s.get_final_message()).usage.output_tokens
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await client.close()

    assert all(1 <= n <= 8 for n in asyncio.run(main()))


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "messages.0.content.0"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "tool", "name": "zzz"}, "tools": [WEATHER]}, "tool_choice.name"),
]


@pytest.mark.parametrize(("patch", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_requests_in_anthropic_shape(server, patch, field):
    body = {"model": "tiny", "max_tokens": 4, "messages": user("hi"), **patch}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"].startswith(field), data


def test_sdk_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=user("x"))
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model="tiny", max_tokens=4, messages=user("x"), extra_body={"temperature": 3})
