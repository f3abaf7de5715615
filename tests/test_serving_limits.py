"""Request intake under hostile input: the body limit (413), bounded JSON (nesting, number size),
the chat-template rule, intake off the event loop with its time limit, clipped echoes, 405's
Allow, and the refusal to serve the network without a key."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from hearth.config import ConfigError, ServingConfig
from tests.serving_helpers import running_server

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def limited(agent_checkpoint):
    with running_server(agent_checkpoint, {"max_model_len": 2048}, max_body_bytes=LIMIT, intake_timeout=1.0) as srv:
        yield srv


def post(server, path: str, body: dict | str | bytes, **kw) -> requests.Response:
    if isinstance(body, dict):
        return requests.post(server.url + path, json=body, timeout=60, **kw)
    return requests.post(server.url + path, data=body, timeout=60,
                         headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def chat_body(text: str = "hi", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def test_body_over_the_limit_gets_413_in_each_format(limited):
    big = "x" * (LIMIT + 1)
    r = post(limited, "/v1/chat/completions", chat_body(big))
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "--max-body-size" in r.json()["error"]["message"]
    messages = [{"role": "user", "content": big}]
    r = post(limited, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": messages})
    assert r.status_code == 413 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced on the bytes as they arrive
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 4096 + 2):
            yield b"y" * 4096
        yield b'"}]}'

    r = requests.post(limited.url + "/v1/chat/completions", data=chunks(), timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = post(limited, "/v1/chat/completions", b"{}", headers={"content-length": "12abc"})
    assert r.status_code == 400
    r = post(limited, "/v1/chat/completions", chat_body("y " * (LIMIT // 4)))  # under the limit: read and tokenized
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert requests.get(limited.url + "/health", timeout=10).status_code == 200


def test_deep_nesting_and_long_numbers_get_400(limited):
    deep = '{"model": "tiny", "max_tokens": 2, "messages": ' + "[" * 10000 + "]" * 10000 + "}"
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        r = post(limited, path, deep)
        assert r.status_code == 400 and "levels deep" in r.text, (path, r.text)
    nested = {"type": "object", "properties": {}}
    inner = nested
    for _ in range(120):  # a tool schema nested past the bound, well under the recursion limit
        inner["properties"]["a"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["a"]
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    assert post(limited, "/v1/chat/completions", chat_body(tools=[tool])).status_code == 400
    digits = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 5000 + "}"
    r = post(limited, "/v1/chat/completions", digits)
    assert r.status_code == 400 and "digits" in r.json()["error"]["message"]
    r = post(limited, "/v1/chat/completions", chat_body(max_tokens=10**19))
    assert r.status_code == 200  # 20 digits parse, and a request for more than fits is clamped
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}
    r = post(limited, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}, call]})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["param"]


def test_the_chat_template_is_the_models(limited):
    hostile = "{% for i in range(4000) %}{% for j in range(4000) %}x{% endfor %}{% endfor %}"
    r = post(limited, "/v1/chat/completions", chat_body(chat_template_kwargs={"chat_template": hostile}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs.chat_template" and "enable_thinking" in error["message"]
    r = post(limited, "/v1/chat/completions", chat_body(chat_template_kwargs={"enable_thinking": "yes"}))
    assert r.status_code == 400 and "bool" in r.json()["error"]["message"]
    assert post(limited, "/v1/chat/completions", chat_body(chat_template_kwargs={"enable_thinking": False})) \
        .status_code == 200


def test_slow_intake_gets_503_while_health_answers(limited, monkeypatch):
    state = limited.state
    frontend = state.frontend
    render = frontend.render_chat

    def slow_render(*args, **kwargs):  # a request whose rendering takes far longer than the intake limit
        time.sleep(3)
        return render(*args, **kwargs)

    monkeypatch.setattr(frontend, "render_chat", slow_render)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=post(limited, "/v1/chat/completions", chat_body())))
    thread.start()
    time.sleep(0.2)
    health = [requests.get(limited.url + "/health", timeout=10) for _ in range(5)]
    thread.join(30)
    assert all(h.status_code == 200 for h in health)  # the loop was free while the request was rendered
    assert result["r"].status_code == 503 and "took longer than 1 s" in result["r"].json()["error"]["message"]
    assert result["r"].headers.get("retry-after") == "1"


def test_echoed_values_are_clipped_and_405_says_allow(limited):
    r = post(limited, "/v1/chat/completions", chat_body(model="m" * (LIMIT - 1024)))
    assert r.status_code == 404 and len(r.content) < 4000 and "more characters" in r.json()["error"]["message"]
    r = requests.get(limited.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers.get("allow") == "POST"


def test_the_network_needs_a_key():
    for host in ("0.0.0.0", "::", "192.168.1.20", "desktop.local"):
        with pytest.raises(ConfigError, match="without an API key"):
            ServingConfig(host=host)
        assert ServingConfig(host=host, api_key="k").host == host
        assert ServingConfig(host=host, insecure_no_auth=True).insecure_no_auth
    for host in ("127.0.0.1", "127.0.0.5", "::1", "localhost"):
        assert ServingConfig(host=host).api_key is None
