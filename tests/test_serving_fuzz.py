"""Fuzzing: hypothesis-generated request bodies (mutations of valid requests, random JSON, random
bytes) against every POST endpoint. No input may produce a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving_helpers import running_server

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BASES = {
    "/v1/chat/completions": {"model": "tiny", "messages": USER, "max_tokens": 2, "temperature": 0.5, "seed": 1,
                             "tools": [TOOL], "stream": False, "stop": ["x"], "top_p": 0.9},
    "/v1/completions": {"model": "tiny", "prompt": "def f", "max_tokens": 2, "top_k": 5, "stream": False},
    "/v1/messages": {"model": "tiny", "messages": USER, "max_tokens": 2, "system": "s", "stream": False,
                     "tools": [{"name": "f", "input_schema": {"type": "object"}}], "stop_sequences": ["x"]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": USER},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
message_values = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]),
    "content": st.one_of(st.text(max_size=20), json_values),
}), max_size=3)


@st.composite
def mutated(draw, base: dict) -> bytes:
    body = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(base) + ["extra", "n", "tool_choice", "thinking"]),
                             max_size=3, unique=True)):
        action = draw(st.sampled_from(["drop", "replace", "messages"]))
        if action == "drop":
            body.pop(key, None)
        elif action == "messages" and key == "messages":
            body[key] = draw(message_values)
        else:
            body[key] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = draw(st.sampled_from([8, 10**9, -body["max_tokens"]]))  # keep generation short
    return json.dumps(body).encode()


bodies = st.sampled_from(sorted(BASES)).flatmap(lambda path: st.tuples(st.just(path), st.one_of(
    mutated(BASES[path]),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=60),
)))


@pytest.fixture(scope="module")
def fuzz_server(agent_checkpoint):
    with running_server(agent_checkpoint, {"max_model_len": 96}, scripted=False) as srv:
        yield srv


def test_fuzzed_bodies_never_get_5xx(fuzz_server):
    fuzz(fuzz_server, 600, derandomize=True)


@pytest.mark.slow
def test_a_long_random_fuzz_never_gets_5xx(fuzz_server):
    """The long fuzz (``-m slow``): 6000 bodies from a fresh seed each run."""
    fuzz(fuzz_server, 6000, derandomize=False)


def fuzz(fuzz_server, examples: int, derandomize: bool) -> None:
    session = requests.Session()
    seen: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies)
    def check(case):
        path, raw = case
        r = session.post(fuzz_server.url + path, data=raw, headers={"content-type": "application/json"}, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, raw, r.status_code, r.text)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.status_code == 200 and "data:" in r.text
        else:
            assert ("error" in r.json()) == (r.status_code >= 400)

    check()
    print("status counts:", seen)
    assert sum(seen.values()) >= examples * 5 // 6
    assert seen.get(200, 0) > 20 and sum(v for k, v in seen.items() if 400 <= k < 500) > 200, seen
    ok = session.post(fuzz_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                      timeout=30)
    assert ok.status_code == 200
