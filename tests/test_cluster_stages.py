"""One replica split by layers over two machines (pipeline stages): each machine lets hearth use
600 KiB of RAM (``HEARTH_RAM_LIMIT``) and the tiny model needs about 920 KiB, so no machine holds it
and the deployment splits it. The first stage (the replica's executor, on one machine) schedules,
embeds and samples; the second (a stage actor on the other) runs the remaining layers and the head
each step. Its tokens and log-probabilities are one machine's. Prints the per-step cost of the hop.
Marked ``multinode``."""

from __future__ import annotations

import time

import pytest
import requests

ray = pytest.importorskip("ray")

from hearth.cluster.deploy import find_router  # noqa: E402
from hearth.cluster.specs import DeployOptions  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402
from tests.cluster_helpers import deployed_on_two_nodes  # noqa: E402

pytestmark = pytest.mark.multinode
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def staged(tmp_path_factory, agent_checkpoint):
    from hearth.cluster.sizing import layer_sizes

    sizes, embed, head = layer_sizes(str(agent_checkpoint))
    assert 600 * 1024 < sum(sizes) + embed + head < 2 * 600 * 1024
    options = DeployOptions(str(agent_checkpoint), "tiny", port=free_port(), grpc_port=None,
                            engine_options={"max_model_len": 512, "kv_cache_tokens": 2048, "expert_device": "virtual",
                                            "expert_cache": "0.3"}, health_interval_s=0.5)
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options,
                               env={"HEARTH_RAM_LIMIT": "600KiB"}) as (cluster, desc):
        yield desc | {"cluster": cluster}


def test_two_stages_on_two_machines_match_one_machine(staged, agent_checkpoint) -> None:
    import torch

    from hearth.engine import LLM, SamplingParams
    from tests.helpers import record_logits

    stages = staged["stages"]
    assert [s["node_name"] for s in stages] == ["desktop", "laptop"] or [s["node_name"] for s in stages] == [
        "laptop", "desktop"]
    assert stages[0]["first_layer"] == 0 and stages[0]["end_layer"] == stages[1]["first_layer"]
    llm = LLM(agent_checkpoint, max_model_len=512)
    recorded = record_logits(llm)
    ids = llm.engine.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    reference = [float(torch.log_softmax(step, -1)[token]) for step, token in
                 zip(recorded[out.request_id], out.token_ids, strict=True)]
    llm.close()
    reply = requests.post(f"{staged['url']}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "logprobs": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == out.token_ids
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], reference, strict=True)) <= 1e-4
    # Concurrent requests: each step goes through the stages in micro-batches (the later stage works
    # on one while the first computes the next), and every reply is still one machine's.
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120),
                                range(4)))
    assert [r.json()["choices"][0]["token_ids"] for r in replies] == [out.token_ids] * 4
    # The status page lists both stages, serving, with their machines and layers (in a browser where
    # the system Chromium is installed).
    status = requests.get(f"{staged['url']}/admin/status", timeout=30).json()
    assert [(t["index"], t["node_name"], t["healthy"]) for t in status["stages"]] == [
        (s["index"], s["node_name"], True) for s in stages]
    _check_stage_table(staged["url"])
    # Each stage ran the expert hierarchy over its own layers (a device cache; misses filled or on the CPU).
    for name in (staged["replicas"][0]["replica_actor_name"], f"hearth:stage:{staged['replicas'][0]['replica_id']}/1"):
        experts = ray.get(ray.get_actor(name, namespace="hearth").stats.remote())["experts"]
        assert experts["fill_calls"] + experts["cpu_calls"] > 0, experts
    # The hop: the first stage's time in the later stage, per step, against a step's whole time.
    start = time.perf_counter()
    reply = requests.post(f"{staged['url']}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True})
    took = time.perf_counter() - start
    executor = ray.get_actor(staged["replicas"][0]["replica_actor_name"], namespace="hearth")
    stats = ray.get(executor.stats.remote())
    per_step = stats["stage_seconds"] / stats["stage_calls"]
    print(f"\nstage hop (later stage's compute included): {per_step * 1e3:.2f} ms a step; "
          f"64 tokens in {took:.2f} s ({64 / took:.1f} tok/s)")
    assert find_router() is not None


def test_killing_a_stage_mid_stream_ends_it_with_an_error_and_the_next_request_succeeds(staged) -> None:
    """The later stage's process dies while a reply streams: the stream ends with one error event
    that says what happened; Ray restarts the stage on its machine (empty), and the next request
    gets one machine's tokens again."""
    import json

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    stage = ray.get_actor(f"hearth:stage:{staged['replicas'][0]['replica_id']}/1", namespace="hearth")
    pid = ray.get(stage.ping.remote())["pid"]
    events, killed = [], False
    with requests.post(f"{staged['url']}/v1/completions", stream=True, timeout=120,
                       json=body | {"max_tokens": 400, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3 and not killed:
                ray.kill(stage, no_restart=False)
                killed = True
    assert killed and "error" in events[-1], events[-1]
    message = events[-1]["error"]["message"]
    assert "pipeline stage" in message and "retried" in message, message
    assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])  # it did not just finish
    start = time.perf_counter()
    after = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=300)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["token_ids"] == before
    assert ray.get(stage.ping.remote())["pid"] != pid  # a new process
    executor = ray.get_actor(staged["replicas"][0]["replica_actor_name"], namespace="hearth")
    assert ray.get(executor.stats.remote())["stages_lost"] >= 1
    print(f"\nnext request after the stage died: {time.perf_counter() - start:.1f} s (the stage reloading included)")


def test_a_machine_that_leaves_gets_its_stages_planned_again_when_it_comes_back(staged) -> None:
    """The laptop (holding a stage) leaves: requests get a clear error while the desktop alone cannot
    hold the model; once a laptop joins again the stages are planned anew over both machines, and
    the replies are one machine's again (within 60 s of the join)."""
    cluster = staged["cluster"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    laptop = next(node for node in cluster.worker_nodes)
    cluster.remove_node(laptop)
    deadline = time.perf_counter() + 30  # Ray declares the node dead; the membership round notices
    while True:
        reply = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120)
        assert reply.status_code in (500, 503), reply.text
        message = reply.json()["error"]["message"]
        if "pipeline stage" in message or time.perf_counter() > deadline:
            break
        time.sleep(1)
    assert "pipeline stage" in message, message
    cluster.add_node(resources={"laptop": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    joined = time.perf_counter()
    while True:
        reply = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120)
        if reply.status_code == 200 or time.perf_counter() - joined > 60:
            break
        time.sleep(1)
    took = time.perf_counter() - joined
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == before
    stages = ray.get(find_router().describe.remote())["stages"]
    assert sorted(s["node_name"] for s in stages) == ["desktop", "laptop"]
    print(f"\nstages planned again and serving {took:.1f} s after the machine came back")


def _check_stage_table(url: str) -> None:
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return
    if chromium is None:
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{url}/")
            page.wait_for_function("[...document.querySelectorAll('#stages tbody tr')].length === 2", timeout=30_000)
            table = page.inner_text("#stages tbody")
            assert table.count("serving") == 2 and "desktop" in table and "laptop" in table, table
        finally:
            browser.close()


def test_draining_a_stage_machine_moves_its_stage_or_says_why_not(staged) -> None:
    """``hearth drain`` of a machine that holds a stage: refused, with the reason, while the other
    machine cannot hold the model alone; once a third machine joins, the split replica finishes its
    requests and the stages are planned again over the others, and the replies stay one machine's."""
    from concurrent.futures import ThreadPoolExecutor

    cluster, router = staged["cluster"], find_router()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    with pytest.raises(ray.exceptions.RayTaskError, match="cannot drain 'laptop'.*cannot hold the model"):
        ray.get(router.drain.remote("laptop", 60))
    cluster.add_node(resources={"attic": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    with ThreadPoolExecutor(1) as pool:  # a request in flight while the drain starts finishes normally
        running = pool.submit(requests.post, f"{staged['url']}/v1/completions", json=body | {"max_tokens": 64},
                              timeout=120)
        time.sleep(0.3)
        done = ray.get(router.drain.remote("laptop", 60), timeout=180)
        assert running.result().status_code == 200
    assert done["unfinished"] == 0 and sorted(s["node_name"] for s in done["stages"]) == ["attic", "desktop"]
    reply = requests.post(f"{staged['url']}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == before
