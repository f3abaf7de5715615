"""The serving surface's security and isolation rows of ``bench/reliability.py``: what a hostile web
page, another key's holder, a buggy agent or a slow client can do to a ``hearth serve`` on loopback.

Each function takes a running :class:`bench.reliability.Server` (some need their own flags: see
:data:`SERVER_FLAGS`) and returns one row with ``holds``."""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

KEY_A, KEY_B = "bench-key-a-0123456789", "bench-key-b-0123456789"
STORE_BYTES = 8 << 20
READ_TIMEOUT_S = 10.0
# The flags of the server these rows run against: two keys (two people), a small response store.
SERVER_FLAGS = ["--response-store-size", str(STORE_BYTES), "--read-timeout", str(READ_TIMEOUT_S)]
JSON = {"Content-Type": "application/json"}


def key_file() -> str:
    """A file of the two keys, for ``--api-key-file``."""
    path = Path(tempfile.mkdtemp(prefix="hearth-bench-")) / "keys.txt"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    return str(path)


def _auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **JSON}


def cross_key(server: Any, model: str) -> dict:
    """Key B on key A's stored response: GET, continue and DELETE all 404 (ids do not leak)."""
    url = server.url + "/v1/responses"
    made = requests.post(url, json={"model": model, "input": "A's secret", "max_output_tokens": 4}, headers=_auth(),
                         timeout=60).json()["id"]
    codes = [requests.get(f"{url}/{made}", headers=_auth(KEY_B), timeout=30).status_code,
             requests.post(url, json={"model": model, "input": "more", "previous_response_id": made,
                                      "max_output_tokens": 4}, headers=_auth(KEY_B), timeout=60).status_code,
             requests.delete(f"{url}/{made}", headers=_auth(KEY_B), timeout=30).status_code]
    own = requests.get(f"{url}/{made}", headers=_auth(), timeout=30).status_code
    return {"row": "cross-key", "get_continue_delete": codes, "owner_get": own,
            "holds": codes == [404, 404, 404] and own == 200}


def browser(server: Any, model: str) -> dict:
    """A rebinding page's Host, and a cross-site text/plain POST, are refused."""
    evil = {**_auth(), "Host": "evil.example"}
    hosts = [requests.get(server.url + p, headers=evil, timeout=30).status_code
             for p in ("/v1/models", "/admin/status", "/")]
    hosts.append(requests.post(server.url + "/admin/expert-cache", json={"size": "0.5"}, headers=evil,
                               timeout=30).status_code)
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    plain = [requests.post(server.url + "/v1/chat/completions", data=body, timeout=30,
                           headers={"Authorization": f"Bearer {KEY_A}", **extra}).status_code
             for extra in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {})]
    cors = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}).headers
    return {"row": "browser", "rebinding_host": hosts, "text_plain_post": plain,
            "cors_allowed": "access-control-allow-origin" in cors,
            "holds": set(hosts) == {403} and set(plain) == {415} and "access-control-allow-origin" not in cors}


def store_budget(server: Any, model: str, count: int = 2000) -> dict:
    """2,000 stored responses with the largest metadata OpenAI allows: resident memory grows by no
    more than the store's budget + 10 %, beyond what the same requests unstored grow it by (the
    control: a router process grows by a few hundred KB per 2,000 requests of its own)."""
    metadata = {f"k{i:062d}": "v" * 512 for i in range(16)}
    body = {"model": model, "input": "x", "max_output_tokens": 1, "metadata": metadata}

    def send(store: bool) -> int:
        return requests.post(server.url + "/v1/responses", json={**body, "store": store}, headers=_auth(),
                             timeout=60).status_code

    with ThreadPoolExecutor(4) as pool:
        warm = list(pool.map(lambda _: send(False), range(count)))  # the heap grown to its working size
        before = server.rss_mb()
        control = list(pool.map(lambda _: send(False), range(count)))
        middle = server.rss_mb()
        stored = list(pool.map(lambda _: send(True), range(count)))
    growth, control_growth = server.rss_mb() - middle, middle - before
    limit = STORE_BYTES * 1.1 / (1 << 20)
    codes = warm + control + stored
    return {"row": "store-budget", "stored": count, "budget_mb": STORE_BYTES / (1 << 20), "rss_growth_mb": growth,
            "control_growth_mb": control_growth, "errors": sum(c != 200 for c in codes),
            "holds": growth - max(control_growth, 0.0) <= limit and set(codes) == {200}}


def _stream_gaps(server: Any, model: str, tokens: int, started: threading.Event | None = None) -> list[float]:
    body = {"model": model, "stream": True, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "def fibonacci(n):"}]}
    gaps, last = [], None
    with requests.post(server.url + "/v1/chat/completions", json=body, headers=_auth(), stream=True,
                       timeout=(5, 60)) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                elif started is not None:
                    started.set()
                last = now
    return gaps[1:]


def _gap_during(server: Any, model: str, action: Callable[[], Any], tokens: int = 160) -> tuple[float, Any]:
    """The largest gap of a stream while ``action`` runs beside it (started once it streams), and what
    ``action`` returned."""
    started, result = threading.Event(), {}
    with ThreadPoolExecutor(1) as pool:
        gaps = pool.submit(_stream_gaps, server, model, tokens, started)
        started.wait(30)
        time.sleep(0.3)
        result["value"] = action()
        return max(gaps.result()), result["value"]


def constrained_stalls(server: Any, model: str) -> dict:
    """A concurrent stream's largest gap stays within 2x its baseline during the server's first
    constrained request (this row runs first) and during each pathological pattern. The baseline is
    the same stream's largest gap while the same request without its schema runs beside it: on the
    demo model a token takes ~6 ms, so a request's mere arrival (its prompt joins a step) shows."""
    def request(schema: dict | None) -> int:
        body = {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "x"}]}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        return requests.post(server.url + "/v1/chat/completions", headers=_auth(), timeout=120, json=body).status_code

    def pattern(regex: str) -> dict:
        return {"type": "object", "properties": {"s": {"type": "string", "pattern": regex}}, "required": ["s"]}

    # The baseline first: it also brings the engine's two-sequence steps up (a first batch shape
    # may compile), which is not what this row is about; then the server's first constrained request.
    baseline = statistics.median(_gap_during(server, model, lambda: request(None))[0] for _ in range(7))
    first, status = _gap_during(server, model, lambda: request(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    patterns = {}
    for regex in ("(a+)+$", "^(.*a){25}$", "a{1000000}"):
        runs = [_gap_during(server, model, lambda r=regex: request(pattern(r))) for _ in range(7)]
        patterns[regex] = (round(statistics.median(g for g, _ in runs) * 1e3, 1), sorted({c for _, c in runs}))
    worst = max([first] + [g / 1e3 for g, _ in patterns.values()])
    return {"row": "constrained-stalls", "baseline_max_gap_ms": baseline * 1e3, "first_request_gap_ms": first * 1e3,
            "first_status": status, "patterns_gap_ms_status": patterns, "holds": worst <= 2 * baseline}


def unsatisfiable(server: Any, model: str) -> dict:
    """Schemas no finite value matches get a 400 before generation, in each API."""
    rec = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    msg = [{"role": "user", "content": "x"}]
    cases = {
        "chat": ("/v1/chat/completions", {"model": model, "messages": msg, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": rec}}}),
        "chat-tool": ("/v1/chat/completions", {"model": model, "messages": msg, "tool_choice": "required",
                                               "tools": [{"type": "function", "function": {"name": "f",
                                                                                           "parameters": rec}}]}),
        "messages-tool": ("/v1/messages", {"model": model, "max_tokens": 8, "messages": msg,
                                           "tool_choice": {"type": "any"}, "tools": [{"name": "f",
                                                                                      "input_schema": rec}]}),
        "responses": ("/v1/responses", {"model": model, "input": "x", "text": {"format": {
            "type": "json_schema", "name": "r", "schema": rec}}}),
    }
    codes = {name: requests.post(server.url + path, json=body, headers=_auth(), timeout=60).status_code
             for name, (path, body) in cases.items()}
    return {"row": "unsatisfiable-schema", "status": codes, "holds": set(codes.values()) == {400}}


def big_bodies(server: Any, model: str) -> dict:
    """/health p99 stays under 50 ms while multi-megabyte bodies are parsed and tokenized."""
    msg = [{"role": "user", "content": "x"}]
    bodies = [("/v1/responses", {"model": model, "input": "x", "max_output_tokens": 1,
                                 "instructions": "word " * (1 << 20)}),
              ("/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": 1, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "d", "schema": {
                      "type": "object", "description": "d" * (6 << 20)}}}}),
              ("/v1/messages/count_tokens", {"model": model, "messages": [{"role": "user",
                                                                            "content": "tok " * (7 << 18)}]})]

    def send_all() -> list[int]:
        return [requests.post(server.url + path, data=json.dumps(body), headers=_auth(), timeout=120).status_code
                for _ in range(3) for path, body in bodies]

    health, codes = _health_during(server, send_all, every_s=0.02)
    p99 = sorted(health)[min(len(health) - 1, int(0.99 * len(health)))]
    return {"row": "big-bodies", "status": sorted(set(codes)), "health_polls": len(health),
            "health_p99_ms": p99 * 1e3, "holds": p99 <= 0.05 and all(c < 500 for c in codes)}


def config_fuzz(files: int = 200, command: str = "serve") -> dict:
    """200 fuzzed settings files for ``hearth serve`` (or ``up``, the cluster's): each a one-line
    error (exit 2) or accepted; never a traceback. The model does not exist, so an accepted file
    ends there, before any model or cluster is started."""
    from hearth.cli.main import main as hearth_main

    rng = random.Random(11)
    own = b'served-model-name = ["m"]' if command == "serve" else b"replicas = 1"  # a setting of this command only
    base = b'port = 8000\nhost = "127.0.0.1"\n' + own + b'\nmax-num-seqs = 4\nprefix-caching = true\n'
    pieces = [b"[", b"]", b"{", b"=", b'"', b"\n", b"\xff", b"\x00", b"nan", b"[[t]]", b"a.b = 1", b"1979-05-27"]
    tracebacks, outcomes = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(files):
            raw = bytearray(base)
            for _ in range(rng.randint(1, 6)):
                at = rng.randrange(len(raw) + 1)
                raw[at:at] = rng.choice(pieces) * rng.choice([1, 2, 5000])
            path = Path(tmp) / f"{i}.toml"
            path.write_bytes(bytes(raw))
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    rc = hearth_main([command, "--config", str(path), "--model", str(Path(tmp) / "none")])
                except BaseException as exc:  # noqa: BLE001 - what the row counts
                    rc, tracebacks = type(exc).__name__, tracebacks + 1
            tracebacks += "Traceback" in err.getvalue() or err.getvalue().count("\n") > 1
            outcomes[str(rc)] = outcomes.get(str(rc), 0) + 1
    return {"row": "config-fuzz", "command": command, "files": files, "exit_codes": outcomes, "tracebacks": tracebacks,
            "holds": tracebacks == 0}


def grpc_rows(server: Any, model: str) -> dict:
    """Malformed gRPC messages get INVALID_ARGUMENT; oversized repeated fields (1M stop_token_ids,
    100k logit_bias, 2M token_ids) are refused; 64 streams cancelled together, or 2M token_ids,
    leave /health under 100 ms."""
    import grpc

    from hearth.proto import hearth_pb2, hearth_pb2_grpc

    meta = [("authorization", f"Bearer {KEY_A}")]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    raw = channel.unary_stream("/hearth.v1.Hearth/Generate", request_serializer=None,
                               response_deserializer=hearth_pb2.GenerateResponse.FromString)
    codes = [_code_of(lambda d=data: list(raw(d, timeout=30, metadata=meta)))
             for data in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab", b"\x1a\x03\x08")]
    stub = hearth_pb2_grpc.HearthStub(channel)
    S = hearth_pb2.SamplingParams
    for sampling in (S(stop_token_ids=[1] * 1_000_000), S(logit_bias={i: 1.0 for i in range(100_000)})):
        request = hearth_pb2.GenerateRequest(model=model, text="x", sampling=sampling)
        codes.append(_code_of(lambda r=request: list(stub.Generate(r, timeout=60, metadata=meta))))
    storm_times, _ = _health_during(server, lambda: _cancel_storm(stub, model, meta))
    storm = max(storm_times)
    big = hearth_pb2.GenerateRequest(model=model, token_ids=hearth_pb2.TokenIds(ids=[5] * 2_000_000))
    big_times, big_code = _health_during(server, lambda: _code_of(
        lambda: list(stub.Generate(big, timeout=60, metadata=meta))))
    big_health = max(big_times)
    codes.append(big_code)
    channel.close()
    return {"row": "grpc", "malformed_and_oversized": codes, "cancel_storm_health_max_ms": storm * 1e3,
            "2M_token_ids_health_max_ms": big_health * 1e3,
            "holds": set(codes) == {"INVALID_ARGUMENT"} and storm < 0.1 and big_health < 0.1}


def _code_of(call: Callable[[], Any]) -> str:
    import grpc

    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def _cancel_storm(stub: Any, model: str, meta: list) -> None:
    """64 streams started, then all cancelled at once: once 8 of them stream (or after 15 s). The
    rest are running or wait for a slot (a server runs ``max_num_seqs`` at once), so the storm
    ends both kinds. Which 8 stream first is up to the server, so each stream is read on a thread."""
    from hearth.proto import hearth_pb2

    request = hearth_pb2.GenerateRequest(model=model, text="def f(x):", sampling=hearth_pb2.SamplingParams(
        max_tokens=2000, ignore_eos=True))
    calls = [stub.Generate(request, timeout=120, metadata=meta) for _ in range(64)]
    streaming = threading.Semaphore(0)

    def first_chunk(call: Any) -> None:
        with contextlib.suppress(Exception):
            next(call)
            streaming.release()

    readers = [threading.Thread(target=first_chunk, args=(call,), daemon=True) for call in calls]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 15.0
    for _ in range(8):
        if not streaming.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            break
    for call in calls:
        call.cancel()
    for reader in readers:
        reader.join(5.0)
    time.sleep(2.0)


def _health_during(server: Any, action: Callable[[], Any], every_s: float = 0.01) -> tuple[list[float], Any]:
    """Each /health answer's time (seconds, polled every ``every_s``) while ``action`` runs, and its result."""
    times, done = [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            requests.get(server.url + "/health", timeout=30)
            times.append(time.monotonic() - start)
            time.sleep(every_s)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    try:
        result = action()
    finally:
        done.set()
        poller.join(30)
    return times, result


def disconnect_log(server: Any, model: str) -> dict:
    """A client that gives up on a non-streamed request leaves no traceback in the server's log
    (counted from this row's start: earlier rows may log what they provoke)."""
    before = server.log_text()
    with contextlib.suppress(requests.RequestException):
        requests.post(server.url + "/v1/completions", headers=_auth(), timeout=(5, 0.5), json={
            "model": model, "prompt": "x", "max_tokens": 400, "ignore_eos": True})
    time.sleep(2.0)
    log = server.log_text()
    log = log[len(before):] if log.startswith(before) else log
    tracebacks, asgi = log.count("Traceback"), log.count("Exception in ASGI application")
    return {"row": "disconnect-log", "tracebacks": tracebacks, "asgi_errors": asgi,
            "holds": tracebacks == 0 and asgi == 0}


def logit_bias(server: Any, model: str) -> dict:
    """``logit_bias`` applied exactly (a +100 token is all a greedy reply holds) or refused (too many)."""
    base = {"model": model, "prompt": "x", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    forced = requests.post(server.url + "/v1/completions", json={**base, "logit_bias": {"5": 100}}, headers=_auth(),
                           timeout=60).json()["choices"][0]["token_ids"]
    many = requests.post(server.url + "/v1/completions", headers=_auth(), timeout=60,
                         json={**base, "logit_bias": {str(i): 1 for i in range(100_000)}}).status_code
    return {"row": "logit-bias", "forced_tokens": forced, "100k_entries": many,
            "holds": forced == [5] * 5 and many == 400}


def slow_connections(server: Any, count: int = 250) -> dict:
    """250 connections sending a byte every 3 s are all closed within the read timeout (+ 2 s)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(count)]
    start, open_ = time.monotonic(), set(range(count))
    sent = 0
    while open_ and time.monotonic() - start < READ_TIMEOUT_S + 20:
        for i in list(open_):
            try:
                socks[i].sendall(head[sent % len(head):][:1])
                socks[i].settimeout(0.001)
                if socks[i].recv(1024) == b"":
                    open_.discard(i)
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                open_.discard(i)
        sent += 1
        time.sleep(3.0 if time.monotonic() - start < READ_TIMEOUT_S else 0.5)
    closed_s = time.monotonic() - start
    for s in socks:
        s.close()
    return {"row": "slow-connections", "connections": count, "still_open": len(open_), "all_closed_s": closed_s,
            "read_timeout_s": READ_TIMEOUT_S, "holds": not open_ and closed_s <= READ_TIMEOUT_S + 5}
