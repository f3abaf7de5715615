"""Request intake under hostile input: the body limit (413), bounded JSON (nesting, number size),
the chat-template rule, intake off the event loop with its time limit, clipped echoes, 405's
Allow, and the refusal to serve the network without a key."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from hearth.config import ConfigError, ServingConfig
from tests.serving_helpers import running_server, wait_until

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def limited(agent_checkpoint):
    with running_server(agent_checkpoint, {"max_model_len": 2048, "max_num_seqs": 2}, max_body_bytes=LIMIT,
                        intake_timeout=1.0) as srv:
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


def test_openapi_declares_every_request_body(limited):
    doc = requests.get(limited.url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops and path != "/v1/embeddings"}
    assert set(posts) == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                          "/v1/messages/count_tokens", "/admin/expert-cache"}
    for path, op in posts.items():
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in schemas, path
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["MessagesRequest"]["properties"]["model"]["enum"] == ["tiny"]  # the names served here
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert set(posts[path]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    # answers checked against the declared response bodies (what the schema fuzzer does at length)
    import jsonschema

    def body_schema(path, method="post", status="200"):
        return doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]

    r = post(limited, "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=2))
    jsonschema.validate(r.json(), body_schema("/v1/chat/completions"))
    r = post(limited, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
    jsonschema.validate(r.json(), body_schema("/v1/completions"))
    r = post(limited, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})
    jsonschema.validate(r.json(), body_schema("/v1/responses"))
    jsonschema.validate(requests.get(limited.url + f"/v1/responses/{r.json()['id']}", timeout=10).json(),
                        body_schema("/v1/responses/{response_id}", "get"))
    said = [{"role": "user", "content": "x"}]
    r = post(limited, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": said})
    jsonschema.validate(r.json(), body_schema("/v1/messages"))
    r = post(limited, "/v1/messages/count_tokens", {"model": "tiny", "messages": said})
    jsonschema.validate(r.json(), body_schema("/v1/messages/count_tokens"))
    for headers in ({}, {"anthropic-version": "2023-06-01"}):
        models = requests.get(limited.url + "/v1/models", headers=headers, timeout=10).json()
        jsonschema.validate(models, body_schema("/v1/models", "get"))
    r = post(limited, "/v1/messages", {"model": "tiny"})
    jsonschema.validate(r.json(), body_schema("/v1/messages", status="default"))
    r = post(limited, "/v1/chat/completions", {"model": "nope", "messages": []})
    jsonschema.validate(r.json(), body_schema("/v1/chat/completions", status="default"))
    with pytest.raises(jsonschema.ValidationError):  # the schemas do constrain
        jsonschema.validate({"object": "chat.completion"}, body_schema("/v1/chat/completions"))
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and all(r.split("/")[-1] in schemas for r in refs)  # every reference resolves


def test_a_queued_stream_starts_at_once_and_is_kept_alive(limited, monkeypatch):
    from hearth.serving import transport

    monkeypatch.setattr(transport, "KEEPALIVE_S", 0.3)
    stall = limited.state.client.call(lambda engine: time.sleep(4))  # the engine thread is busy for 4 s
    start = time.monotonic()
    with requests.post(limited.url + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=3),
                       stream=True, timeout=30) as r:
        assert r.status_code == 200 and time.monotonic() - start < 3.5  # headers while still queued
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    stall.result(10)
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data:")]
    assert len(comments) >= 2 and lines.index(comments[0]) < lines.index(data[1])  # (data[0]: the role delta)
    assert data[-1] == "data: [DONE]" and len(data) >= 3
    for protocol in ("openai", "anthropic"):  # the SDKs read past the comments
        stall = limited.state.client.call(lambda engine: time.sleep(1.0))
        if protocol == "openai":
            import openai

            client = openai.OpenAI(base_url=limited.url + "/v1", api_key="unused", max_retries=0)
            chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=3, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason is not None
        else:
            import anthropic

            client = anthropic.Anthropic(base_url=limited.url, api_key="unused", max_retries=0)
            with client.messages.stream(model="tiny", max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
                assert stream.get_final_message().stop_reason in ("max_tokens", "end_turn")
        stall.result(10)


def test_a_request_that_would_wait_too_long_gets_429_at_once(limited, monkeypatch):
    from hearth.serving.admission import AdmissionLimits

    client = limited.state.client
    slots = client.engine.config.scheduler.max_num_seqs
    monkeypatch.setattr(client, "limits", AdmissionLimits(max_waiting=64, max_wait_s=1.0))
    monkeypatch.setattr(client, "_service_s", 30.0)  # as if requests had held their slots for 30 s
    stall = client.call(lambda engine: time.sleep(4))
    first: list[requests.Response] = []
    threads = [threading.Thread(target=lambda: first.append(post(limited, "/v1/chat/completions", chat_body())))
               for _ in range(slots)]  # they fill the slots (not started yet: the engine is stalled)
    for thread in threads:
        thread.start()
    assert wait_until(lambda: client.stats()["in_flight"] == slots, 3)
    start = time.monotonic()
    r = post(limited, "/v1/chat/completions", chat_body())
    assert r.status_code == 429 and time.monotonic() - start < 2.0  # at once, not after the 4 s stall
    assert "estimated wait" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 29
    messages = [{"role": "user", "content": "x"}]
    r = post(limited, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": messages})
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    stall.result(10)
    for thread in threads:
        thread.join(30)
    assert len(first) == slots and all(f.status_code == 200 for f in first)


def test_free_slots_go_to_tenants_in_turn(limited):
    client = limited.state.client
    slots = client.engine.config.scheduler.max_num_seqs
    done: list[str] = []

    def ask(name: str, tenant: str) -> None:
        r = requests.post(limited.url + "/v1/completions", timeout=60, headers={"x-session-id": tenant},
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 12, "ignore_eos": True})
        assert r.status_code == 200
        done.append(name)

    stall = client.call(lambda engine: time.sleep(1.5))  # all of them are admitted before any runs
    threads = [threading.Thread(target=ask, args=(f"a{i}", "busy-client")) for i in range(2 * slots)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    assert wait_until(lambda: client.stats()["in_flight"] == 2 * slots, 5)
    threads.append(threading.Thread(target=ask, args=("b", "other-client")))
    threads[-1].start()
    stall.result(10)
    for thread in threads:
        thread.join(60)
    assert len(done) == 2 * slots + 1
    # "b" came last but got the second free slot: it is not queued behind all of "busy-client"'s requests
    assert done.index("b") < slots + 1, done


def test_several_keys_from_a_key_file(agent_checkpoint, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha-key\n\nbeta-key  # the laptop\n")
    assert ServingConfig(api_key="main", api_key_file=str(keys)).api_keys() == ("main", "alpha-key", "beta-key")
    assert ServingConfig(host="0.0.0.0", api_key_file=str(keys)).host == "0.0.0.0"  # a key file is a key
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no keys"):
        ServingConfig(host="0.0.0.0", api_key_file=str(tmp_path / "empty"))
    with running_server(agent_checkpoint, {"max_model_len": 512}, api_key_file=str(keys)) as srv:
        for key, status in (("alpha-key", 200), ("beta-key", 200), ("gamma", 401), ("alpha", 401)):
            r = requests.post(srv.url + "/v1/chat/completions", json=chat_body(), timeout=60,
                              headers={"authorization": f"Bearer {key}"})
            assert r.status_code == status, key
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200  # open


def test_a_slow_start_reports_where_it_is(capsys):
    from types import SimpleNamespace
    from unittest import mock

    from hearth.cli import serve

    waits = iter([TimeoutError(), TimeoutError(), None])

    def wait_ready(timeout=None):
        outcome = next(waits)
        if outcome is not None:
            raise outcome

    client = SimpleNamespace(wait_ready=wait_ready, phase="loading the weights and building the engine",
                             model=SimpleNamespace(max_model_len=4096))
    state = SimpleNamespace(client=client, model_name="tiny")
    started = threading.Event()
    started.set()
    with mock.patch.object(serve, "STILL_LOADING_S", 0.01):
        serve._announce(state, ServingConfig(), serve.Path("/models/tiny"), started)
    err = capsys.readouterr().err
    assert err.count("still loading the weights and building the engine after") == 2 and "model ready" in err


def test_concurrent_first_requests_share_one_frontend(agent_checkpoint):
    with running_server(agent_checkpoint, {"max_model_len": 512}) as srv:  # nothing built before these
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda i: post(srv, "/v1/chat/completions" if i % 2 else "/v1/completions",
                                                    chat_body() if i % 2 else {"model": "tiny", "prompt": "x",
                                                                               "max_tokens": 2}).status_code,
                                     range(8)))
        assert statuses == [200] * 8


def test_extreme_sampling_values_are_served_and_a_failing_request_fails_alone(limited, monkeypatch):
    """Valid but extreme sampling values (found by the schema fuzzer: each made the sampler raise,
    which failed the whole engine step) get tokens; a request whose sampling does raise ends with an
    error of its own while the one beside it completes."""
    extremes = [{"top_p": 5e-324}, {"repetition_penalty": 5e-324, "temperature": 1}, {"temperature": 1e-300},
                {"min_p": 1, "temperature": 2}]
    with ThreadPoolExecutor(len(extremes)) as pool:
        replies = list(pool.map(lambda extra: post(limited, "/v1/chat/completions", chat_body(**extra)), extremes))
    assert [r.status_code for r in replies] == [200] * len(extremes), [r.text for r in replies]
    r = post(limited, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, "top_p": 5e-324,
                                          "repetition_penalty": 5e-324})
    assert r.status_code == 200, r.text

    from hearth.engine import llm_engine

    real = llm_engine.sample_token

    def failing(logits, params, prompt, output, generator):
        if params.presence_penalty == 1.5:  # the marked request
            raise RuntimeError("a sampler bug")
        return real(logits, params, prompt, output, generator)

    monkeypatch.setattr(llm_engine, "sample_token", failing)
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, limited, "/v1/chat/completions", chat_body(presence_penalty=1.5, max_tokens=8))
        good = pool.submit(post, limited, "/v1/chat/completions", chat_body(max_tokens=8))
        bad, good = bad.result(), good.result()
    assert good.status_code == 200 and good.json()["choices"][0]["message"] is not None
    assert bad.status_code == 500 and "a sampler bug" not in bad.text and "retry" in bad.json()["error"]["message"]
    assert requests.get(limited.url + "/health", timeout=10).status_code == 200
