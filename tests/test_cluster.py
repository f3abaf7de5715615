"""The deployed system on a two-node Ray cluster (``desktop`` and ``laptop`` on 127.0.0.2).

Replicas on both nodes behind the router; session affinity; a killed executor comes back attached
to its pool without re-reading it; a node that leaves mid-stream ends that stream with an error
event and the queued requests finish on the survivor. Marked ``multinode`` (``make test-cluster``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import requests

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from hearth.cluster.deploy import cluster_status, deploy  # noqa: E402
from hearth.cluster.launch import teardown  # noqa: E402
from hearth.cluster.routing import ReplicaLoad, choose_replica  # noqa: E402
from hearth.cluster.specs import DeployOptions  # noqa: E402
from hearth.engine import LLM  # noqa: E402
from hearth.engine.experts.mechanism.host_pool import cleanup  # noqa: E402
from hearth.engine.sampling import SamplingParams  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402

pytestmark = pytest.mark.multinode
# Every miss is filled over a slow virtual link: a token takes tens of milliseconds, long enough to
# act mid-stream. One running request per replica, so further ones queue.
ENGINE = {"expert_device": "virtual", "expert_cache": "8slots", "cpu_experts": "external", "q_mode": "all",
          "virtual_link_gbps": 0.002, "max_num_seqs": 1, "max_model_len": 2048}
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    old = os.environ.get("HEARTH_CACHE")
    os.environ["HEARTH_CACHE"] = str(tmp_path_factory.mktemp("hearth-cache"))  # inherited by the nodes
    cluster = Cluster(initialize_head=True, head_node_args={
        "resources": {"desktop": 1}, "num_cpus": 2, "node_ip_address": "127.0.0.2", "include_dashboard": False})
    laptop = cluster.add_node(resources={"laptop": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    ray.init(address=cluster.address)
    try:
        yield cluster, laptop
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("HEARTH_CACHE", None)
        else:
            os.environ["HEARTH_CACHE"] = old


@pytest.fixture(scope="module")
def deployment(two_nodes, agent_checkpoint):
    desc = deploy(DeployOptions(str(agent_checkpoint), "tiny", port=free_port(), grpc_port=None, engine_options=ENGINE,
                                health_interval_s=0.5), log=lambda *_: None)
    try:
        yield desc
    finally:
        try:
            teardown(log=lambda *_: None)
        finally:  # the pool and ring of the node removed mid-test had no chance to clean up
            for segment in Path("/dev/shm").glob("hearth-tiny-*"):
                cleanup(segment.name)


@pytest.fixture(scope="module")
def expected(agent_checkpoint):
    """Greedy tokens of the plain in-process engine for PROMPT."""
    llm = LLM(agent_checkpoint)
    ids = llm.engine.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    llm.engine.close()
    return out


def complete(url: str, max_tokens: int = 12, session: str | None = None, **extra) -> requests.Response:
    headers = {"x-session-id": session} if session else {}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def assigned(desc) -> dict[str, int]:
    return {row["replica"]: row["assigned"] for row in cluster_status()["rows"]}


def session_for(replica: str, desc) -> str:
    """A session id that the router maps to ``replica`` while both replicas are healthy."""
    loads = [ReplicaLoad(r["replica_id"], "tiny", True) for r in desc["replicas"]]
    return next(s for s in (f"s{i}" for i in range(1000)) if choose_replica(loads, "tiny", f"id:{s}") == replica)


def restarted(call, old_pid: int, timeout: float = 120) -> dict:
    """Poll ``call()`` (an actor method returning a dict with ``pid``) until a new process answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = ray.get(call(), timeout=30)
            if info["pid"] != old_pid:
                return info
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the actor did not come back"
        time.sleep(0.2)


def test_requests_reach_both_replicas_with_exact_output(deployment, expected):
    """A burst of identical prompts (one derived session key) spreads once its replica is busy."""
    url = deployment["url"]
    before = assigned(deployment)
    results: list[requests.Response] = []
    threads = [threading.Thread(target=lambda: results.append(complete(url))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["choices"][0]["token_ids"] == expected for r in results)
    after = assigned(deployment)
    assert all(after[k] > before[k] for k in after), (before, after)
    assert {row["node"] for row in cluster_status()["rows"]} == {"desktop", "laptop"}


def test_a_session_sticks_to_one_replica(deployment):
    url = deployment["url"]
    before = assigned(deployment)
    for _ in range(4):
        assert complete(url, max_tokens=2, session="agent-session-7").status_code == 200
    after = assigned(deployment)
    grew = {k: after[k] - before[k] for k in after}
    assert sorted(grew.values()) == [0, 4], grew


def long_prompt_homed_on(replica: str, desc, checkpoint) -> str:
    """A prompt over 256 tokens (so that its derived session key, from the leading 256, is the same
    whatever is appended) whose derived key the router maps to ``replica``: prefix routing must
    beat it to send the prompt elsewhere."""
    from hearth.engine.text.tokenizer import load_tokenizer
    from hearth.serving.session import prefix_key

    tok = load_tokenizer(checkpoint)
    loads = [ReplicaLoad(r["replica_id"], "tiny", True) for r in desc["replicas"]]
    for j in range(100):
        text = f"# case {j}\n{PROMPT}\n" + "\n".join(f"    x{i} = fibonacci({i}) + {i * i}" for i in range(40))
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) > 300 and choose_replica(loads, "tiny", prefix_key(ids)) == replica:
            return text
    raise AssertionError("no prompt found")


def rows_by_replica() -> dict[str, dict]:
    return {row["replica"]: row for row in cluster_status()["rows"]}


def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return found


def test_prefix_routing_sends_a_cached_prefix_home_until_load_overrides(deployment, agent_checkpoint):
    """A prompt whose prefix the laptop's prefix cache holds goes to the laptop without a session id;
    with the laptop PREFIX_SLACK requests busier than the desktop, it goes to the desktop."""
    from hearth.cluster.routing import PREFIX_SLACK

    url = deployment["url"]
    laptop = next(r["replica_id"] for r in deployment["replicas"] if r["node_name"] == "laptop")
    desktop = next(r["replica_id"] for r in deployment["replicas"] if r["node_name"] == "desktop")
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    prompt = long_prompt_homed_on(desktop, deployment, agent_checkpoint)  # its derived key says desktop
    first = requests.post(f"{url}/v1/completions", json={**body, "prompt": prompt},
                          headers={"x-session-id": session_for(laptop, deployment)}, timeout=120)
    assert first.status_code == 200
    wait_for(lambda: (rows_by_replica()[laptop]["prefix_blocks"] or 0) >= 2)  # published by the health loop
    for i in range(3):  # different endings, no session id: the cached opening decides
        before = assigned(deployment)
        reply = requests.post(f"{url}/v1/completions", json={**body, "prompt": prompt + f"\n# variant {i}"},
                              timeout=120)
        assert reply.status_code == 200
        after = assigned(deployment)
        assert after[laptop] == before[laptop] + 1 and after[desktop] == before[desktop], (before, after)
    row = rows_by_replica()[laptop]
    assert row["cached_prompt_tokens"] >= 3 * 32 and row["cached_prompt_tokens"] <= row["prompt_tokens"]
    assert "hearth_replica_prefix_hit_ratio" in requests.get(f"{url}/metrics", timeout=30).text
    # Keep the laptop busy: long replies pinned to it by session id.
    pinned = [threading.Thread(target=complete, args=(url, 120, session_for(laptop, deployment)))
              for _ in range(PREFIX_SLACK)]
    for t in pinned:
        t.start()
    try:
        wait_for(lambda: rows_by_replica()[laptop]["in_flight"] >= PREFIX_SLACK)
        before = assigned(deployment)
        reply = requests.post(f"{url}/v1/completions", json={**body, "prompt": prompt + "\n# busy"},
                              timeout=120)
        assert reply.status_code == 200
        after = assigned(deployment)
        assert after[desktop] == before[desktop] + 1, (before, after)
    finally:
        for t in pinned:
            t.join()


def test_expert_cache_resized_through_the_router(deployment, expected):
    """Elastic VRAM over the cluster's control path: the router's admin route resizes every
    replica's cache, or one named replica's, at their next step boundaries; output stays exact."""
    url = deployment["url"]

    def view() -> dict:
        return requests.get(f"{url}/admin/expert-cache", timeout=30).json()["replicas"]

    replicas = sorted(view())
    assert len(replicas) == 2 and all(v["slots"] == 8 for v in view().values())
    r = requests.post(f"{url}/admin/expert-cache", json={"size": "2slots"}, timeout=60)
    assert r.status_code == 200, r.text
    assert {k: v["slots"] for k, v in r.json()["replicas"].items()} == dict.fromkeys(replicas, 2)
    assert complete(url).json()["choices"][0]["token_ids"] == expected
    r = requests.post(f"{url}/admin/expert-cache", json={"size": "8slots", "replica": replicas[0]}, timeout=60)
    assert r.status_code == 200 and list(r.json()["replicas"]) == [replicas[0]]
    r = requests.post(f"{url}/admin/expert-cache", json={"size": "8slots", "replica": "attic"}, timeout=60)
    assert r.status_code == 404 and replicas[1] in r.json()["error"]["message"]
    r = requests.post(f"{url}/admin/expert-cache", json={"size": "8slots"}, timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 30  # the router's view follows its health loop
    while any(v["slots"] != 8 for v in view().values()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert complete(url).json()["choices"][0]["token_ids"] == expected


def test_killed_replica_actor_reattaches_to_its_pool(deployment, expected):
    replica = "tiny@laptop"
    pool = ray.get_actor(f"hearth:pool:{replica}", namespace="hearth")
    executor = ray.get_actor(f"hearth:replica:{replica}", namespace="hearth")
    loads_before = ray.get(pool.info.remote())["loads"]
    cold = ray.get(executor.ready.remote())
    assert cold["attached_pool"] is True  # the pool actor filled it; the executor never read experts
    started = time.perf_counter()
    ray.kill(executor, no_restart=False)  # Ray restarts it
    info = restarted(executor.ready.remote, cold["pid"])
    restart_s = time.perf_counter() - started
    assert info["attached_pool"] is True
    assert ray.get(pool.info.remote())["loads"] == loads_before  # the pool was not read again
    # Served again through the router (it puts the replica back in rotation), with the same output.
    session = session_for(replica, deployment)
    deadline = time.monotonic() + 30
    while not next(r for r in cluster_status()["rows"] if r["replica"] == replica)["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    r = complete(deployment["url"], session=session)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected
    print(f"\nexecutor restart: {restart_s:.2f} s until ready (engine load {info['load_seconds']:.2f} s); "
          f"cold start of the replica: {cold['load_seconds']:.2f} s engine load")


def test_killed_pool_actor_is_rebuilt_from_ftw(deployment, expected):
    """A killed pool actor is recreated by Ray and reads the pool again from the FTW files; the
    running executor keeps serving, and a later executor restart attaches to the new pool."""
    from hearth.engine.experts.mechanism.host_pool import HostExpertPool

    replica = "tiny@desktop"
    pool = ray.get_actor(f"hearth:pool:{replica}", namespace="hearth")
    before = ray.get(pool.info.remote())
    ray.kill(pool, no_restart=False)
    after = restarted(pool.info.remote, before["pid"])
    assert after["loads"] == 1 and after["path"] == before["path"]  # a new process read it from FTW
    with HostExpertPool.attach(after["pool_name"]) as segment:
        assert segment.filled and segment.meta["owner_pid"] == after["pid"]
    session = session_for(replica, deployment)
    r = complete(deployment["url"], session=session)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected
    executor = ray.get_actor(f"hearth:replica:{replica}", namespace="hearth")
    old = ray.get(executor.ready.remote())["pid"]
    ray.kill(executor, no_restart=False)
    info = restarted(executor.ready.remote, old)
    assert info["attached_pool"] and ray.get(pool.info.remote())["loads"] == 1


def test_python_client_generate_stream_and_errors(deployment, expected):
    from hearth.cluster.sdk import HearthClient, HearthError

    client = HearthClient(ray.get_actor("hearth:router", namespace="hearth"))
    out = client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert out["token_ids"] == expected and out["usage"]["completion_tokens"] == 12
    assert "".join(client.stream(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)) == out["text"]
    chat = client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=3, session_id="s")
    assert chat["usage"]["completion_tokens"] <= 3
    with pytest.raises(HearthError, match="400"):
        client.generate(PROMPT, max_tokens=-1)
    with pytest.raises(HearthError, match="unknown field"):
        client.generate(PROMPT, bogus=1)


def test_node_leaving_mid_stream(two_nodes, deployment, expected):
    """The laptop leaves while streaming: that stream ends with an error event; the requests
    queued behind it there finish on the desktop; the next requests go to the desktop."""
    cluster, laptop = two_nodes
    url = deployment["url"]
    session = session_for("tiny@laptop", deployment)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stream = requests.post(f"{url}/v1/completions", json=body, headers={"x-session-id": session}, stream=True,
                           timeout=120)
    assert stream.status_code == 200
    lines = stream.iter_lines()
    first = next(line for line in lines if line.startswith(b"data: "))
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    # Two more requests of the same session queue behind it on the laptop (one running at a time).
    queued: list[requests.Response] = []
    workers = [threading.Thread(target=lambda: queued.append(complete(url, session=session))) for _ in range(2)]
    for t in workers:
        t.start()
    time.sleep(1.0)
    cluster.remove_node(laptop, allow_graceful=False)  # the lid closes: no goodbye
    started = time.monotonic()
    rest = [line for line in lines if line]
    assert time.monotonic() - started < 60
    events = [json.loads(line[6:]) for line in rest if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert any("error" in e for e in events), rest[-3:]
    for t in workers:
        t.join(timeout=120)
    assert [r.status_code for r in queued] == [200, 200]
    assert all(r.json()["choices"][0]["token_ids"] == expected for r in queued)
    rows = {row["replica"]: row for row in cluster_status()["rows"]}
    assert rows["tiny@laptop"]["healthy"] is False
    r = complete(url)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    assert 'hearth_replica_healthy{node="laptop",replica="tiny@laptop"} 0.0' in metrics
    assert 'hearth_replica_healthy{node="desktop",replica="tiny@desktop"} 1.0' in metrics


class _FakeReplica:
    """Stands in for a replica actor: expert counters whose link rate halves after 10 readings."""

    def __init__(self) -> None:
        self.readings = 0
        self.total = {"fill_bytes": 0.0, "fill_seconds": 0.0, "fill_calls": 0, "cpu_bytes": 0.0, "cpu_seconds": 0.0,
                      "cpu_calls": 0}
        self.pushed: list[tuple[float, float]] = []

    def stats(self) -> dict:
        self.readings += 1
        link = 8e9 if self.readings <= 10 else 4e9
        for path, rate in (("fill", link), ("cpu", 20e9)):
            self.total[f"{path}_bytes"] += rate * 0.1
            self.total[f"{path}_seconds"] += 0.1
            self.total[f"{path}_calls"] += 10
        qtable = [0, 1, 1] if self.pushed else [0, 1, 2]
        experts = dict(self.total, b_p=8e9, b_h=20e9, link_fixed_s=0.0, cpu_fixed_s=0.0, qtable=qtable)
        return {"ready": True, "pid": 1, "experts": experts}

    def set_bandwidths(self, b_p: float, b_h: float) -> list[int]:
        self.pushed.append((b_p, b_h))
        return [0, 1, 1]

    def probe(self):
        return None

    def get_pushed(self) -> list[tuple[float, float]]:
        return self.pushed


def test_monitor_actor_pushes_a_new_table_when_the_link_slows(two_nodes):
    from hearth.cluster.actors import MonitorActor
    from hearth.cluster.specs import ReplicaSpec

    spec = ReplicaSpec("fake@desktop", "fake", "/nowhere", "", "fake-pool", monitor_interval_s=0.05)
    on_desktop = {"resources": {"desktop": 0.01}, "num_cpus": 0}  # the laptop may have left already
    executor = ray.remote(_FakeReplica).options(name=spec.actor_name("replica"), namespace="hearth",
                                                **on_desktop).remote()
    monitor = ray.remote(MonitorActor).options(namespace="hearth", **on_desktop).remote(spec)
    try:
        deadline = time.monotonic() + 30
        while not ray.get(executor.get_pushed.remote()):
            assert time.monotonic() < deadline, "the monitor pushed nothing"
            time.sleep(0.1)
        (b_p, b_h), *_ = ray.get(executor.get_pushed.remote())
        assert b_p == pytest.approx(4e9) and b_h == pytest.approx(20e9)
        status = ray.get(monitor.status.remote())
        assert status["changes"] == 1 and status["qtable"] == [0, 1, 1] and status["history"][0]["b_p"] == b_p
    finally:
        ray.kill(monitor)
        ray.kill(executor)
