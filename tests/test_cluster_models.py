"""Several models on one two-node cluster: ``hearth up --model A --model B`` places both with the
planner, the router serves each by its name (``/v1/models`` lists both, gRPC too), an unknown name
is a 404 in each API's format, and ``hearth status`` shows every replica. Marked ``multinode``."""

from __future__ import annotations

import pytest
import requests

ray = pytest.importorskip("ray")

from hearth.cluster.deploy import cluster_status  # noqa: E402
from hearth.cluster.specs import DeployOptions  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.cluster_helpers import deployed_on_two_nodes  # noqa: E402

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, agent_checkpoint):
    other, _ = make_checkpoint(tmp_path_factory.mktemp("olmo"), "olmoe")
    options = DeployOptions(str(agent_checkpoint), "tiny", port=free_port(), grpc_port=None,
                            engine_options={"max_model_len": 512}, health_interval_s=0.5,
                            more_models=((str(other), "olmo"),))
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options, ("tiny", "olmo")) as (_, desc):
        yield desc


def test_two_models_are_placed_together_and_served_by_name(two_models) -> None:
    url = two_models["url"]
    assert two_models["models"] == ["tiny", "olmo"]
    placed = {(r["model"], r["node_name"]) for r in two_models["replicas"]}
    assert placed == {("tiny", "desktop"), ("tiny", "laptop"), ("olmo", "desktop"), ("olmo", "laptop")}
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]] == ["tiny", "olmo"]
    replies = {}
    for name in ("tiny", "olmo"):
        body = {"model": name, "prompt": [5, 17, 33, 99], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reply = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name
        replies[name] = reply.json()["choices"][0]["token_ids"]
    assert replies["tiny"] != replies["olmo"]
    chat = requests.post(f"{url}/v1/messages", json={"model": "olmo", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]}, timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == "olmo"
    rows = cluster_status()["rows"]
    assert {r["replica"] for r in rows} == {"tiny@desktop", "tiny@laptop", "olmo@desktop", "olmo@laptop"}
    assert all(r["state"] == "ready" for r in rows)


def test_an_unknown_model_is_a_404_in_each_format(two_models) -> None:
    url = two_models["url"]
    openai = requests.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert openai.status_code == 404 and openai.json()["error"]["param"] == "model"
    assert "'tiny', 'olmo'" in openai.json()["error"]["message"]
    anthropic = requests.post(f"{url}/v1/messages", json={
        "model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
