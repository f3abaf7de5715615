"""Operations: health, metrics, client disconnects, the bounded queue, API keys, gRPC, generated code."""

from __future__ import annotations

import filecmp
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import grpc
import openai
import pytest
import requests

from hearth.config import ServingConfig
from hearth.proto import hearth_pb2, hearth_pb2_grpc
from hearth.serving.app import ServerState
from hearth.serving.client import InProcessEngineClient
from hearth.serving.server import BackgroundServer, free_port
from tests.serving_helpers import metrics, running_server, wait_until

ROOT = Path(__file__).resolve().parents[1]


def chat(server, text: str, **extra) -> requests.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=60, stream=extra.get("stream", False))


def test_health_ready(server):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ready", "model": "tiny"}


def test_health_while_loading(agent_checkpoint):
    gate = threading.Event()

    def slow_factory():
        from hearth.engine.llm_engine import LLMEngine

        gate.wait(60)
        return LLMEngine(agent_checkpoint)

    opts = ServingConfig(port=free_port(), grpc_port=None, model_names=("tiny",))
    state = ServerState(InProcessEngineClient(agent_checkpoint, slow_factory, "tiny"), ["tiny"])
    server = BackgroundServer(state, opts)
    server._thread.start()
    try:
        assert server._started.wait(30)
        r = requests.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = chat(server, "hi", max_tokens=2)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.set()
        state.client.wait_ready(60)
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        assert chat(server, "hi", max_tokens=2).status_code == 200
    finally:
        gate.set()
        server.stop()


def test_metrics_parse_and_move(server):
    before = metrics(server)
    r = chat(server, "count", max_tokens=5, temperature=0, ignore_eos=True)
    assert r.status_code == 200
    after = metrics(server)
    key = "hearth_requests_total{endpoint=chat,status=ok}"
    assert after[key] == before.get(key, 0) + 1
    assert after["hearth_generation_tokens_total"] == before.get("hearth_generation_tokens_total", 0) + 5
    assert after["hearth_prompt_tokens_total"] > before.get("hearth_prompt_tokens_total", 0)
    assert after["hearth_time_to_first_token_seconds_count"] == before.get(
        "hearth_time_to_first_token_seconds_count", 0) + 1
    assert after["hearth_inter_token_latency_seconds_count"] == before.get(
        "hearth_inter_token_latency_seconds_count", 0) + 4
    assert after["hearth_ready"] == 1 and "hearth_queue_length" in after


def test_metrics_include_expert_hierarchy(agent_checkpoint):
    with running_server(agent_checkpoint, {"expert_device": "virtual", "expert_cache": 0.5,
                                           "expert_bandwidths": (2e9, 4e9)}, scripted=False) as srv:
        assert chat(srv, "hello", max_tokens=4).status_code == 200
        m = metrics(srv)
    assert m["hearth_expert_hits_total"] + m["hearth_expert_misses_total"] > 0
    assert 0 <= m["hearth_expert_cache_hit_ratio"] <= 1
    assert m["hearth_bandwidth_link_bytes_per_second"] == 2e9 and m["hearth_bandwidth_host_bytes_per_second"] == 4e9
    assert "hearth_qtable_fills{m=1}" in m


def test_disconnect_frees_the_request_and_others_continue(server):
    expected = chat(server, "the other one", max_tokens=40, temperature=0, ignore_eos=True).json()
    results = {}

    def other():
        time.sleep(0.3)
        results["other"] = chat(server, "the other one", max_tokens=40, temperature=0, ignore_eos=True).json()

    thread = threading.Thread(target=other)
    thread.start()
    r = chat(server, "a long one", max_tokens=1500, ignore_eos=True, stream=True)
    lines = r.iter_lines()
    for _ in range(6):
        next(lines)
    r.close()  # the client goes away mid-generation
    thread.join(60)
    client = server.state.client

    def idle():
        s = client.stats()
        return s["running"] == 0 and s["waiting"] == 0 and s["in_flight"] == 0 \
            and s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"]

    assert wait_until(idle, 30), client.stats()
    assert results["other"]["choices"][0]["message"] == expected["choices"][0]["message"]
    assert metrics(server)["hearth_requests_total{endpoint=chat,status=aborted}"] >= 1


def test_disconnect_of_a_non_streaming_client_aborts_it(server, caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/v1/completions", timeout=(5, 0.5), json={
            "model": "tiny", "prompt": "long", "max_tokens": 1500, "ignore_eos": True})
    client = server.state.client
    assert wait_until(lambda: client.stats()["in_flight"] == 0 and client.stats()["running"] == 0, 30), \
        client.stats()
    # One info line says so; nothing at error level, no traceback.
    assert wait_until(lambda: any("client disconnected" in r.getMessage() for r in caplog.records), 10)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text[-2000:]
    s = client.stats()
    assert s["kv_blocks_free"] + s["kv_blocks_cached"] == s["kv_blocks_total"]  # nothing pinned


def test_bounded_queue_rejects_in_each_protocol(agent_checkpoint):
    with running_server(agent_checkpoint, {"max_num_seqs": 1}, scripted=False, max_waiting=0) as srv:
        long = chat(srv, "occupy the engine", max_tokens=1000, ignore_eos=True, stream=True)
        lines = long.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)
        r = chat(srv, "one more", max_tokens=2)
        assert r.status_code == 429 and "overloaded" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        r = requests.post(srv.url + "/v1/messages", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                model="tiny", prompt="x", max_tokens=2)
        long.close()
        assert wait_until(lambda: chat(srv, "after", max_tokens=2).status_code == 200, 30)
        assert metrics(srv)["hearth_rejected_requests_total"] == 3


def test_api_key(agent_checkpoint):
    with running_server(agent_checkpoint, scripted=False, api_key="s3cret") as srv:
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
        r = chat(srv, "x", max_tokens=2)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = requests.post(srv.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert requests.get(srv.url + "/metrics", timeout=10).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret").models.list().data[0].id == "tiny"
        m = anthropic.Anthropic(base_url=srv.url, api_key="s3cret").messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert m.usage.output_tokens >= 1
        with grpc.insecure_channel(f"127.0.0.1:{srv.options.grpc_port}") as channel:
            stub = hearth_pb2_grpc.HearthStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.ListModels(hearth_pb2.ListModelsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            models = stub.ListModels(hearth_pb2.ListModelsRequest(), timeout=10,
                                     metadata=[("authorization", "Bearer s3cret")])
            assert models.models[0].id == "tiny"


def test_grpc_matches_http_for_the_same_seed(server):
    http = requests.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 20, "temperature": 0.8, "seed": 42,
        "ignore_eos": True, "return_token_ids": True}).json()
    with grpc.insecure_channel(f"127.0.0.1:{server.options.grpc_port}") as channel:
        stub = hearth_pb2_grpc.HearthStub(channel)
        assert stub.Health(hearth_pb2.HealthRequest(), timeout=10).status == hearth_pb2.HealthResponse.READY
        assert [m.id for m in stub.ListModels(hearth_pb2.ListModelsRequest(), timeout=10).models] == ["tiny"]
        request = hearth_pb2.GenerateRequest(model="tiny", text="def fibonacci(n):", sampling=hearth_pb2.SamplingParams(
            max_tokens=20, temperature=0.8, seed=42, ignore_eos=True))
        replies = list(stub.Generate(request, timeout=60))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(hearth_pb2.GenerateRequest(model="nope", text="x"), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            bad = hearth_pb2.GenerateRequest(model="tiny", text="x", sampling=hearth_pb2.SamplingParams(top_p=3))
            list(stub.Generate(bad, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
        for raw in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab"):  # not GenerateRequest bytes
            call = channel.unary_stream("/hearth.v1.Hearth/Generate", request_serializer=None,
                                        response_deserializer=hearth_pb2.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                list(call(raw, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in err.value.details()
        for sampling, field in ((hearth_pb2.SamplingParams(stop_token_ids=[1] * 257), "stop_token_ids"),
                                (hearth_pb2.SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
                                (hearth_pb2.SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
                                (hearth_pb2.SamplingParams(logit_bias={1: 500.0}), "logit_bias")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(hearth_pb2.GenerateRequest(model="tiny", text="x", sampling=sampling), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), field
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == http["choices"][0]["token_ids"]
    assert "".join(r.text for r in replies) == http["choices"][0]["text"]
    last = replies[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 20
    assert last.usage.prompt_tokens == http["usage"]["prompt_tokens"]


def test_generated_grpc_code_is_current(tmp_path):
    """Regenerate from proto/hearth.proto and compare with the committed modules."""
    (tmp_path / "proto").mkdir()
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path / "proto")],
                   cwd=ROOT, check=True)
    for name in ("hearth_pb2.py", "hearth_pb2.pyi", "hearth_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "proto" / name, ROOT / "proto" / name, shallow=False), \
            f"proto/{name} is stale: run `make proto` and commit the result"
