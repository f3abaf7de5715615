"""The OpenAI-compatible API, driven by the official ``openai`` SDK against a real engine."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests

from tests.serving_helpers import SCRIPTS, TIME_TOOL, WEATHER_TOOL

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_usage_matches_tokenizer(server, client):
    messages = [{"role": "system", "content": "Be brief."}, *user("Count to three.")]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    tok = server.state.frontend.tokenizer
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == 7 and timings["prompt_n"] == r.usage.prompt_tokens


def test_stream_equals_non_stream_with_seed(client):
    kwargs = dict(model="tiny", messages=user("Tell me a story."), max_tokens=24, temperature=0.9, top_p=0.95,
                  seed=1234, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    other = client.chat.completions.create(**{**kwargs, "seed": 99})
    assert other.choices[0].message.content != full.choices[0].message.content


def test_text_completions_plain_and_stream(client):
    kwargs = dict(model="tiny", prompt="def fibonacci(n):", max_tokens=12, temperature=0.7, seed=5)
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    ids = client.completions.create(model="tiny", prompt=[5, 17, 33], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_async_eight_concurrent_streams_match_sequential(server, client):
    prompts = [f"Request number {i} asks for something." for i in range(8)]
    expected = [client.chat.completions.create(model="tiny", messages=user(p), max_tokens=16, temperature=0.8,
                                               seed=i, extra_body={"ignore_eos": True}).choices[0].message.content
                for i, p in enumerate(prompts)]

    async def one(aclient, i, p):
        stream = await aclient.chat.completions.create(model="tiny", messages=user(p), max_tokens=16,
                                                       temperature=0.8, seed=i, stream=True,
                                                       extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(aclient, i, p) for i, p in enumerate(prompts)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == expected


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parsed_by_sdk(client, stream):
    kwargs = dict(model="tiny", messages=user("SCRIPT:TWO_CALLS weather and time?"), tools=[WEATHER_TOOL, TIME_TOOL],
                  max_tokens=200)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        content = msg.content
        ids = [c.id for c in msg.tool_calls]
    else:
        calls_by_index: dict[int, dict] = {}
        content, finish = "", None
        for c in client.chat.completions.create(**kwargs, stream=True):
            delta = c.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls_by_index.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                entry["name"] += tc.function.name or ""
                entry["args"] += tc.function.arguments or ""
            finish = c.choices[0].finish_reason or finish
        calls = [(e["name"], json.loads(e["args"])) for _, e in sorted(calls_by_index.items())]
        ids = [e["id"] for e in calls_by_index.values()]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert content == "Checking both."
    assert finish == "tool_calls"
    assert all(i and i.startswith("call_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_separate(client, stream):
    kwargs = dict(model="tiny", messages=user("SCRIPT:THINK hi"), max_tokens=100)
    if stream:
        reasoning, content = "", ""
        for c in client.chat.completions.create(**kwargs, stream=True):
            delta = c.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    else:
        msg = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = msg.model_extra["reasoning_content"], msg.content
    assert reasoning == "The user greets me. I greet back."
    assert content == "Hello there!"


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_call_returned_as_text(client, stream):
    kwargs = dict(model="tiny", messages=user("SCRIPT:BAD_CALL"), tools=[WEATHER_TOOL], max_tokens=100)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert not r.choices[0].message.tool_calls
    assert text == SCRIPTS["BAD_CALL"] and finish == "stop"


def test_named_tool_choice_forces_the_call(client):
    r = client.chat.completions.create(model="tiny", messages=user("SCRIPT:NAMED_REST where?"), tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=50)
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})


def test_tool_choice_none_leaves_markup_as_text(client):
    r = client.chat.completions.create(model="tiny", messages=user("SCRIPT:WEATHER"), tools=[WEATHER_TOOL],
                                       tool_choice="none", max_tokens=100)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == SCRIPTS["WEATHER"]


def test_multi_turn_with_tool_results_renders(client):
    messages = [
        *user("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "SCRIPT:THINK "}, {"type": "text", "text": "thanks"}]},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=100)
    assert r.choices[0].message.content == "Hello there!"


def test_stop_strings(client):
    r = client.chat.completions.create(model="tiny", messages=user("SCRIPT:STOPWORD"), stop=[" STOP"], max_tokens=50)
    assert r.choices[0].message.content == "alpha beta" and r.choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"n": 17}, "n"),
    ({"stop": [""]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": [WEATHER_TOOL]}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),
]


@pytest.mark.parametrize(("patch", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_requests_get_400_naming_the_field(server, patch, field):
    body = {"model": "tiny", "messages": user("hi"), "max_tokens": 4, **patch}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field) or error["param"] == field, error


def test_unknown_model_invalid_json_and_utf8(server):
    url = server.url + "/v1/chat/completions"
    r = requests.post(url, json={"model": "nope", "messages": user("hi")}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = requests.post(url, data=b'{"model": "tiny", "messages": [', headers=JSON, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = requests.post(url, data=b'{"model": "tiny\xff\xfe"}', headers=JSON, timeout=30)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = requests.post(url, data=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                      headers=JSON, timeout=30)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    r = requests.post(url, data=b"[1, 2]", headers=JSON, timeout=30)
    assert r.status_code == 400


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=user("x"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=user("x"), temperature=5)


def test_logit_bias_is_applied_exactly(server):
    """OpenAI's semantics: added to the logits before sampling. At temperature 0 a +100 bias makes its
    token the only one chosen; a -100 bias on the unbiased reply's first token moves it; ids outside the
    vocabulary and more than 300 entries are a 400."""
    url = server.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = requests.post(url, json=base, timeout=60).json()["choices"][0]["token_ids"]
    forced = requests.post(url, json={**base, "logit_bias": {"42": 100}}, timeout=60).json()
    assert forced["choices"][0]["token_ids"] == [42] * 6
    banned = requests.post(url, json={**base, "logit_bias": {str(plain[0]): -100}}, timeout=60).json()
    assert banned["choices"][0]["token_ids"][0] != plain[0]
    assert requests.post(url, json={**base, "logit_bias": {}}, timeout=60).json()["choices"][0]["token_ids"] == plain
    for bias in ({"99999999": 1}, {"abc": 1}, {"5": 101}, {str(i): 1 for i in range(301)}):
        r = requests.post(url, json={**base, "logit_bias": bias}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), (bias, r.text)
    chat = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": user("hi"), "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
