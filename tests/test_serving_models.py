"""One server, several models (what a cluster router serves): each answers by its own name with its
own tokenizer and engine, /v1/models lists them all, an unknown name is a 404 in each API's format,
and /health waits for every model."""

from __future__ import annotations

import pytest
import requests

from hearth.config import EngineConfig, ServingConfig
from hearth.serving.app import ServedModel, ServerState
from hearth.serving.server import BackgroundServer, build_state
from tests.checkpoints import make_checkpoint
from tests.serving_helpers import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    paths = {name: make_checkpoint(tmp_path_factory.mktemp(name), family)[0]
             for name, family in (("qwen", "qwen3_moe"), ("olmo", "olmoe"))}
    serving = ServingConfig(host="127.0.0.1", port=free_port(), grpc_port=None)
    states = {name: build_state(path, EngineConfig(max_model_len=512), serving) for name, path in paths.items()}
    models = [ServedModel([name, f"{name}-alias"], s.client) for name, s in states.items()]
    state = ServerState(models[0].client, models=models)
    server = BackgroundServer(state, serving).start()
    try:
        for m in models:
            m.client.wait_ready(120)
        yield server
    finally:
        server.stop()  # (closes every model's client)


def test_every_model_is_listed_and_answers_by_its_names(server) -> None:
    listed = requests.get(f"{server.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in listed["data"]] == ["qwen", "qwen-alias", "olmo", "olmo-alias"]
    assert requests.get(f"{server.url}/health", timeout=30).json()["models"] == {
        "qwen": {"status": "ready"}, "olmo": {"status": "ready"}}
    replies = {}
    for name in ("qwen", "olmo-alias", "olmo"):
        body = {"model": name, "prompt": [5, 17, 33, 99], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name.removesuffix("-alias")
        replies[name] = reply.json()["choices"][0]["token_ids"]
    assert replies["olmo"] == replies["olmo-alias"] and replies["olmo"] != replies["qwen"]  # other weights
    chat = requests.post(f"{server.url}/v1/messages", json={
        "model": "olmo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "olmo"


def test_an_unknown_model_is_a_404_in_each_format(server) -> None:
    openai = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert openai.status_code == 404
    assert openai.json()["error"]["param"] == "model" and "'qwen'" in openai.json()["error"]["message"]
    anthropic = requests.post(f"{server.url}/v1/messages", json={
        "model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "not_found_error"
