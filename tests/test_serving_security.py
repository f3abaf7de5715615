"""The serving surface against a hostile web page and against other keys: Host names (DNS
rebinding), non-JSON bodies (cross-site writes without a preflight), CORS, stored responses scoped to
the key that stored them, and the response store's byte budget."""

from __future__ import annotations

import json

import pytest
import requests

from hearth.serving.responses_format import ResponseStore
from hearth.serving.security import AllowedHosts, is_json_media_type
from tests.serving_helpers import running_server

JSON = {"Content-Type": "application/json"}
KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"


def test_allowed_hosts_on_loopback() -> None:
    hosts = AllowedHosts.for_server("127.0.0.1")
    for ok in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "app.localhost", "10.0.0.5", None):
        assert hosts.permits(ok), ok
    for bad in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", "", "[::1"):
        assert not hosts.permits(bad), bad


def test_allowed_hosts_named_and_beyond_loopback() -> None:
    hosts = AllowedHosts.for_server("127.0.0.1", ("box.lan", ".home.arpa"))
    assert hosts.permits("box.lan:8000") and hosts.permits("gpu.home.arpa") and not hosts.permits("home.arpa.evil")
    assert AllowedHosts.for_server("127.0.0.1", ("*",)).permits("anything.example")
    lan = AllowedHosts.for_server("0.0.0.0")
    import socket

    assert lan.anywhere and lan.permits(socket.gethostname()) and lan.permits("192.168.1.20:8000")
    assert not lan.permits("evil.example")


def test_json_media_types() -> None:
    assert is_json_media_type("application/json") and is_json_media_type("Application/JSON; charset=utf-8")
    assert is_json_media_type("application/merge-patch+json")
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                "text/json"):
        assert not is_json_media_type(bad), bad


@pytest.fixture(scope="module")
def keyed(agent_checkpoint):
    """A server with two keys (two people), and CORS for one origin."""
    key_file = agent_checkpoint.parent / "security-keys.txt"
    key_file.write_text(f"{KEY_A}\n{KEY_B}  # the second person\n")
    with running_server(agent_checkpoint, {"max_model_len": 2048}, api_key_file=str(key_file),
                        cors_origins=("http://localhost:3000",)) as srv:
        yield srv


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **JSON}


def test_rebinding_host_and_text_plain_are_refused(server) -> None:
    evil = {"Host": "evil.example"}
    for path in ("/v1/models", "/admin/status", "/admin/expert-cache", "/"):
        r = requests.get(server.url + path, headers=evil, timeout=30)
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"], (path, r.text)
    r = requests.post(server.url + "/admin/expert-cache", json={"size": "0.5"}, headers=evil, timeout=30)
    assert r.status_code == 403
    r = requests.post(server.url + "/v1/messages", json={"model": "tiny"}, headers=evil, timeout=30)
    assert r.status_code == 403 and r.json()["type"] == "error"  # in the API's own shape
    assert requests.get(server.url + "/health", headers=evil, timeout=30).status_code == 200
    assert requests.get(server.url + "/v1/models", headers={"Host": "localhost:1234"}, timeout=30).status_code == 200

    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        r = requests.post(server.url + "/v1/chat/completions", data=body.encode(), headers=headers, timeout=30)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], headers
    r = requests.post(server.url + "/v1/chat/completions", data=body.encode(), headers=JSON, timeout=60)
    assert r.status_code == 200


def test_no_cors_unless_an_origin_is_named(server, keyed) -> None:
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    r = requests.options(server.url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    r = requests.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    r = requests.options(keyed.url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert r.headers.get("access-control-allow-origin") != "http://evil.example"
    r = requests.options(keyed.url + "/v1/chat/completions", timeout=30,
                         headers={**preflight, "Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = requests.get(keyed.url + "/v1/models", headers={**_auth(KEY_A), "Origin": "http://localhost:3000"},
                     timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_stored_responses_belong_to_their_key(keyed) -> None:
    url = keyed.url + "/v1/responses"
    r = requests.post(url, json={"model": "tiny", "input": "secret of A", "max_output_tokens": 4}, headers=_auth(KEY_A),
                      timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    # Another key: the id reads as absent (404, never 403) in all three operations.
    assert requests.get(f"{url}/{rid}", headers=_auth(KEY_B), timeout=30).status_code == 404
    r = requests.post(url, json={"model": "tiny", "input": "go on", "previous_response_id": rid,
                                 "max_output_tokens": 4}, headers=_auth(KEY_B), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert requests.delete(f"{url}/{rid}", headers=_auth(KEY_B), timeout=30).status_code == 404
    # Its own key still has it, can continue it and delete it.
    assert requests.get(f"{url}/{rid}", headers=_auth(KEY_A), timeout=30).json()["id"] == rid
    r = requests.post(url, json={"model": "tiny", "input": "go on", "previous_response_id": rid,
                                 "max_output_tokens": 4}, headers=_auth(KEY_A), timeout=60)
    assert r.status_code == 200, r.text
    assert requests.delete(f"{url}/{rid}", headers=_auth(KEY_A), timeout=30).status_code == 200
    assert requests.get(f"{url}/{rid}", headers=_auth(KEY_A), timeout=30).status_code == 404


def test_metadata_limits(server) -> None:
    url = server.url + "/v1/responses"
    for metadata, field in (({f"k{i}": "v" for i in range(17)}, "metadata"), ({"k" * 65: "v"}, "metadata."),
                            ({"k": "v" * 513}, "metadata.k")):
        r = requests.post(url, json={"model": "tiny", "input": "hi", "metadata": metadata}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text
    metadata = {f"k{i:062d}": "v" * 512 for i in range(16)}  # the largest allowed: echoed whole
    r = requests.post(url, json={"model": "tiny", "input": "hi", "metadata": metadata, "max_output_tokens": 2},
                      timeout=60)
    assert r.status_code == 200 and r.json()["metadata"] == metadata


def test_the_store_is_bounded_by_bytes_and_owned() -> None:
    store = ResponseStore(capacity=1000, max_bytes=20_000)
    big = "x" * 3000
    for i in range(20):
        assert store.put({"id": f"r{i}", "metadata": {"m": big}}, [{"role": "user", "content": big}], "a")
        assert store.bytes <= store.max_bytes
    kept = [i for i in range(20) if store.get(f"r{i}", "a") is not None]
    assert kept == list(range(20 - len(kept), 20)) and 2 <= len(kept) < 5  # the oldest went first
    assert store.get("r19", "b") is None and not store.delete("r19", "b") and store.get("r19", "a") is not None
    assert store.get("r19", "a")[0] == {"id": "r19", "metadata": {"m": big}}
    assert not store.put({"id": "huge", "x": "y" * 30_000}, [], "a") and store.get("huge", "a") is None
    while kept:
        assert store.delete(f"r{kept.pop()}", "a")
    assert store.bytes == 0


def test_the_store_ring_wraps_and_reads_back_what_it_kept() -> None:
    """Entries of mixed sizes, some deleted, over many laps of the ring: every entry kept reads back
    exactly, the kept ones are the newest stored (less those deleted), and the budget holds."""
    import random

    rng = random.Random(0)
    store = ResponseStore(capacity=1000, max_bytes=50_000)
    stored, deleted = [], set()
    for i in range(600):
        store.put({"id": f"r{i}", "t": "x" * rng.randrange(0, 9000)}, [{"i": i}], "a")
        stored.append(i)
        if rng.random() < 0.2:
            victim = rng.choice(stored)
            deleted.add(victim)
            store.delete(f"r{victim}", "a")
        assert store.bytes <= store.max_bytes
    kept = [i for i in stored if store.get(f"r{i}", "a") is not None]
    assert kept and not set(kept) & deleted
    assert kept == [i for i in stored[kept[0]:] if i not in deleted]  # a suffix of what was stored
    for i in kept:
        body, conversation = store.get(f"r{i}", "a")
        assert body["id"] == f"r{i}" and conversation == [{"i": i}]


def test_slow_requests_are_cut_at_the_read_timeout(agent_checkpoint) -> None:
    """Connections that send nothing, a header a byte at a time, or a body a byte at a time are closed
    once their request has taken read_timeout to arrive; a whole request is answered as usual."""
    import socket
    import time

    with running_server(agent_checkpoint, {"max_model_len": 2048}, read_timeout=1.0) as srv:
        port = srv.options.port
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        socks = []
        for kind in ("idle", "head", "body") * 10:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if kind == "body":
                s.sendall(head + b"Content-Length: 100\r\n\r\n{")
            socks.append((kind, s))
        start, closed = time.monotonic(), {}
        while len(closed) < len(socks) and time.monotonic() - start < 8:
            for i, (kind, s) in enumerate(socks):
                if i in closed:
                    continue
                try:
                    s.sendall(head[len(closed) % 20:][:1] if kind == "head" else b" " if kind == "body" else b"")
                    s.settimeout(0.01)
                    if s.recv(1 << 16) == b"":
                        closed[i] = time.monotonic() - start
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:
                    closed[i] = time.monotonic() - start
            time.sleep(0.2)
        assert len(closed) == len(socks) and max(closed.values()) < 3.0, closed
        for _, s in socks:
            s.close()
        r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
