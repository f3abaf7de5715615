"""Machines that come and go on a running deployment: a third machine that joins the Ray cluster
gets a replica from the planner without a redeploy and serves; a drained machine stops taking
requests, finishes the ones it holds (queued ones included), then loses its replica. Marked
``multinode``."""

from __future__ import annotations

import threading
import time

import pytest
import requests

ray = pytest.importorskip("ray")

from hearth.cluster.deploy import cluster_status, find_router  # noqa: E402
from hearth.cluster.routing import ReplicaLoad, choose_replica  # noqa: E402
from hearth.cluster.specs import DeployOptions  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402
from tests.cluster_helpers import deployed_on_two_nodes  # noqa: E402

pytestmark = pytest.mark.multinode
# A slow virtual link (tens of milliseconds a token) and one running request per replica: further
# requests queue inside the engine, which a drain must let finish.
ENGINE = {"expert_device": "virtual", "expert_cache": "8slots", "cpu_experts": "external", "q_mode": "all",
          "virtual_link_gbps": 0.002, "max_num_seqs": 1, "max_model_len": 1024}


@pytest.fixture(scope="module")
def running(tmp_path_factory, agent_checkpoint):
    options = DeployOptions(str(agent_checkpoint), "tiny", port=free_port(), grpc_port=None, engine_options=ENGINE,
                            health_interval_s=0.5)
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options) as found:
        yield found


def rows() -> dict[str, dict]:
    return {row["replica"]: row for row in cluster_status()["rows"]}


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return found


def pinned_session(replica: str) -> str:
    loads = [ReplicaLoad(rid, "tiny", bool(r.get("healthy"))) for rid, r in rows().items()]
    return next(s for s in (f"s{i}" for i in range(2000)) if choose_replica(loads, "tiny", f"id:{s}") == replica)


def complete(url: str, session: str, max_tokens: int) -> requests.Response:
    body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return requests.post(f"{url}/v1/completions", json=body, headers={"x-session-id": session}, timeout=300)


def test_a_machine_that_joins_gets_a_replica_that_serves(running) -> None:
    cluster, desc = running
    joined = time.monotonic()
    cluster.add_node(resources={"spare": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    wait_for(lambda: (rows().get("tiny@spare") or {}).get("healthy"), timeout=60)
    took = time.monotonic() - joined
    print(f"\nmachine joined -> its replica in rotation: {took:.1f} s")
    before = rows()["tiny@spare"]["assigned"] or 0
    reply = complete(desc["url"], pinned_session("tiny@spare"), 4)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 4
    assert rows()["tiny@spare"]["assigned"] == before + 1
    assert [name for name, _ in ray.get(find_router().describe.remote())["joined"]] == ["tiny@spare"]


def test_draining_a_machine_loses_no_queued_request(running) -> None:
    _, desc = running
    url, session = desc["url"], pinned_session("tiny@laptop")
    results: list[requests.Response] = []
    threads = [threading.Thread(target=lambda: results.append(complete(url, session, 16))) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: (rows()["tiny@laptop"]["in_flight"] or 0) >= 3, timeout=60)  # one running, the rest queued
    done = ray.get(find_router().drain.remote("laptop"), timeout=600)
    for t in threads:
        t.join()
    assert done["replicas"] == ["tiny@laptop"] and done["unfinished"] == 0
    assert [r.status_code for r in results] == [200] * 4
    assert all(len(r.json()["choices"][0]["token_ids"]) == 16 for r in results)
    assert "tiny@laptop" not in rows()
    assert complete(url, session, 2).status_code == 200  # its session moves to a replica left
    with pytest.raises(ray.exceptions.RayTaskError, match="no replica on a machine named 'laptop'"):
        ray.get(find_router().drain.remote("laptop"), timeout=60)
