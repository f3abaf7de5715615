"""SDK features beyond plain chat, through the official openai SDK: log-probabilities and n > 1."""

from __future__ import annotations

import math

import openai
import pytest
import requests

from tests.serving_helpers import metrics


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt(words: int = 80) -> list[dict]:
    return [{"role": "user", "content": " ".join(f"word{i % 37}" for i in range(words))}]


def test_chat_logprobs_with_alternatives(client) -> None:
    r = client.chat.completions.create(model="tiny", messages=_prompt(8), max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    plain = client.chat.completions.create(model="tiny", messages=_prompt(8), max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_non_streamed_ones(client) -> None:
    kwargs = dict(model="tiny", messages=_prompt(8), max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [(e.token, round(e.logprob, 6)) for e in whole]


def test_completions_logprobs_in_the_legacy_shape(client) -> None:
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_n_seeded_samples_share_one_prompt_computation(server, client) -> None:
    messages = [{"role": "user", "content": "zebra quartz " + _prompt()[0]["content"]}]  # a prefix no test used
    kwargs = dict(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=11, n=3)
    before = metrics(server).get("hearth_cached_prompt_tokens_total", 0)
    r = client.chat.completions.create(**kwargs)
    cached = metrics(server)["hearth_cached_prompt_tokens_total"] - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # three different samples
    # Sample 0 computes the prompt; 1 and 2 start once it is cached and read every whole block but
    # the one holding the last prompt token.
    prompt, block = r.usage.prompt_tokens, 16
    assert cached == 2 * ((prompt - 1) // block * block)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # what sample 0 (the request's own) found
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == texts  # each sample is seeded
    streamed = client.chat.completions.create(stream=True, **kwargs)
    parts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
    assert [parts[i] for i in range(3)] == texts


def test_n_on_completions_and_limits(server, client) -> None:
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=5, temperature=0.8, seed=2, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    bad = requests.post(server.url + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": _prompt(2), "n": 17})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    bad = requests.post(server.url + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": _prompt(2), "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    assert math.isfinite(r.usage.total_tokens)


def test_embeddings_get_a_clear_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError, match="embeddings are not served") as err:
        client.embeddings.create(model="tiny", input="hello")
    assert err.value.body["code"] == "model_not_found"
