"""The admin route of elastic VRAM: ``/admin/expert-cache`` reads and resizes the running server's
expert cache; a stream in flight gets the same tokens as without the resize; bad input gets a
clear error in the OpenAI shape."""

from __future__ import annotations

import json
import threading

import requests

from tests.serving_helpers import metrics, running_server

VIRTUAL = {"expert_device": "virtual", "expert_cache": "0.5", "q_mode": "table",
           "expert_bandwidths": (10e9, 25e9), "stream_min_tokens": 1 << 20}


def complete(server, max_tokens: int = 160, started: threading.Event | None = None) -> list[str]:
    """A greedy streamed completion's text deltas; ``started`` is set at the first."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    deltas = []
    with requests.post(server.url + "/v1/completions", json=body, timeout=120, stream=True) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["text"])
                if started is not None:
                    started.set()
    return deltas


def resize(server, **body) -> requests.Response:
    return requests.post(server.url + "/admin/expert-cache", json=body, timeout=60)


def test_resize_while_a_request_streams(agent_checkpoint):
    with running_server(agent_checkpoint, VIRTUAL, scripted=False) as server:
        unresized = complete(server)
        view = requests.get(server.url + "/admin/expert-cache", timeout=30).json()
        local = view["replicas"]["local"]
        assert view["object"] == "expert_cache" and local["slots"] > 0 and local["bytes"] == \
            local["slots"] * local["expert_bytes"]

        result: list[list[str]] = []
        started = threading.Event()
        streaming = threading.Thread(target=lambda: result.append(complete(server, started=started)))
        streaming.start()
        assert started.wait(60)
        reports = [resize(server, size=size) for size in ("0.1", "0slots", "1.0")]
        assert streaming.is_alive()  # resized while the request was generating
        streaming.join(120)
        assert result == [unresized]  # the stream in flight was not disturbed
        for r in reports:
            assert r.status_code == 200, r.text
        slots = [r.json()["replicas"]["local"]["slots"] for r in reports]
        assert slots[1] == 0 and 0 < slots[0] < slots[2]
        assert requests.get(server.url + "/admin/expert-cache", timeout=30).json()["replicas"]["local"]["slots"] \
            == slots[2]
        assert complete(server) == unresized
        samples = metrics(server)  # what the server holds where: the arena follows the resize
        assert samples["hearth_memory_bytes{device=virtual,use=expert_cache}"] == slots[2] * local["expert_bytes"]
        assert samples["hearth_memory_bytes{device=cpu,use=weights}"] > 0
        assert samples["hearth_memory_bytes{device=cpu,use=kv_cache}"] > 0

        r = resize(server, size="lots")
        assert r.status_code == 400 and r.json()["error"]["param"] == "size"
        assert "cannot read 'lots'" in r.json()["error"]["message"]
        r = resize(server, size="0.5", replica="laptop")
        assert r.status_code == 404 and "'local'" in r.json()["error"]["message"]
        r = resize(server, size="0.5", extra=1)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = requests.post(server.url + "/admin/expert-cache", data=b"{", headers={"Content-Type": "application/json"},
                          timeout=30)
        assert r.status_code == 400
        r = requests.post(server.url + "/admin/expert-cache", data=b'{"size": "0.5"}', timeout=30)  # a form's type
        assert r.status_code == 415 and "Content-Type" in r.json()["error"]["message"]


def test_no_cache_to_resize(server):
    r = resize(server, size="0.5")
    assert r.status_code == 400 and "no expert cache" in r.json()["error"]["message"]
    assert requests.get(server.url + "/admin/expert-cache", timeout=30).json()["replicas"] == {"local": None}
