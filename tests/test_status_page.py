"""The status page and its data on a single server (the browser test against a cluster is in
test_cluster_status_page.py): the page is one static file behind the API key (``/?key=``), and
``/admin/status`` reports the replica, the queue and the requests just served."""

from __future__ import annotations

import requests

from tests.serving_helpers import running_server


def test_status_page_and_its_data(agent_checkpoint) -> None:
    engine = {"max_model_len": 512, "expert_device": "virtual", "expert_cache": "0.5"}
    with running_server(agent_checkpoint, engine, scripted=False, api_key="k1") as server:
        auth = {"Authorization": "Bearer k1"}
        assert requests.get(f"{server.url}/", timeout=30).status_code == 401
        assert requests.get(f"{server.url}/?key=wrong", timeout=30).status_code == 401
        page = requests.get(f"{server.url}/?key=k1", timeout=30)
        assert page.status_code == 200 and "/admin/status" in page.text and "cdn" not in page.text.lower()
        assert requests.get(f"{server.url}/admin/status", timeout=30).status_code == 401
        for i in range(2):
            reply = requests.post(f"{server.url}/v1/completions", headers=auth, timeout=60,
                                  json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 3})
            assert reply.status_code == 200
        status = requests.get(f"{server.url}/admin/status", headers=auth, timeout=30).json()
        assert status["models"] == [{"name": "tiny", "ready": True}] and status["nodes"] is None
        (replica,) = status["replicas"]
        assert replica["healthy"] and replica["b_p"] > 0 and replica["b_h"] > 0 and replica["qtable"][0] == 0
        assert [r["status"] for r in status["recent"]] == ["ok", "ok"]
        assert status["recent"][0]["completion_tokens"] == 3 and status["queue"]["in_flight"] == 0
