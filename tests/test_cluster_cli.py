"""The deploy scripts and ``hearth up`` / ``status`` / ``down`` on two ``ray start`` nodes on 127.0.0.2
with Ray token authentication, and the example batch job through ``ray job submit`` and the Ray client."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from hearth.serving.server import free_port

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOST = "127.0.0.2"


def run(*cmd: str, env: dict[str, str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@pytest.fixture()
def ray_nodes(tmp_path):
    """Head and worker started by deploy/desktop-head.sh and deploy/laptop-join.sh."""
    ports = {"gcs": free_port(HOST), "dashboard": free_port(HOST), "client": free_port(HOST)}
    env = dict(os.environ, HEARTH_CACHE=str(tmp_path / "cache"), PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               HEARTH_ENV=str(tmp_path / "none.env"), HEARTH_HEAD_IP=HOST, HEARTH_NODE_IP=HOST,
               RAY_GCS_PORT=str(ports["gcs"]), RAY_DASHBOARD_PORT=str(ports["dashboard"]),
               RAY_CLIENT_PORT=str(ports["client"]), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               RAY=str(BIN / "ray"), HEARTH=str(BIN / "hearth"))
    try:
        run("bash", "deploy/desktop-head.sh", "--num-cpus", "2", env=env)
        run("bash", "deploy/laptop-join.sh", "--num-cpus", "2", env=env)
        yield env, ports
    finally:
        run(str(BIN / "ray"), "stop", "--force", env=env, check=False)


def test_up_status_job_client_down(ray_nodes, agent_checkpoint, tmp_path):
    env, ports = ray_nodes
    address = f"{HOST}:{ports['gcs']}"
    http = free_port()
    hearth = str(BIN / "hearth")
    # Without the cluster's token nothing connects.
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    assert run(hearth, "status", "--address", address, env=no_token, check=False, timeout=120).returncode != 0
    up_env = dict(env, HEARTH_MODEL=str(agent_checkpoint), HEARTH_HOST="127.0.0.1", HEARTH_PORT=str(http))
    up = run("bash", "deploy/hearth-up.sh", "--name", "tiny", "--grpc-port", "0", "--virtual-device",
             "--expert-cache", "8slots", env=up_env, timeout=600)
    assert "'tiny' is up: 2 replica(s)" in up.stderr
    r = requests.post(f"http://127.0.0.1:{http}/v1/completions",
                      json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    status = run(hearth, "status", "--address", address, env=env).stdout
    assert "REPLICA" in status and "tiny@desktop" in status and "tiny@laptop" in status
    rows = json.loads(run(hearth, "status", "--address", address, "--json", env=env).stdout)["rows"]
    assert {row["node"] for row in rows} == {"desktop", "laptop"} and all(row["state"] == "ready" for row in rows)

    prompts = ROOT / "deploy" / "examples" / "prompts.jsonl"
    n_prompts = len(prompts.read_text().splitlines())
    job_out = tmp_path / "job.jsonl"
    job = run(str(BIN / "ray"), "job", "submit", "--address", f"http://{HOST}:{ports['dashboard']}",
              "--working-dir", str(ROOT / "deploy" / "examples"), "--", "python", "batch_job.py",
              "--input", "prompts.jsonl", "--output", str(job_out), "--max-tokens", "8", env=env, timeout=600)
    assert f"wrote {n_prompts} result(s)" in job.stdout, job.stdout[-2000:]
    results = [json.loads(line) for line in job_out.read_text().splitlines()]
    assert len(results) == n_prompts and all("error" not in res and res["token_ids"] for res in results)

    client_out = tmp_path / "client.jsonl"
    client_cmd = (sys.executable, str(ROOT / "deploy" / "examples" / "batch_job.py"), "--address",
                  f"ray://{HOST}:{ports['client']}", "--input", str(prompts), "--output", str(client_out),
                  "--max-tokens", "8")
    via_client = run(*client_cmd, env=env, timeout=600)
    assert f"wrote {n_prompts} result(s)" in via_client.stdout
    by_id = {res["id"]: res["token_ids"] for res in results}
    assert {res["id"]: res["token_ids"] for res in map(json.loads, client_out.read_text().splitlines())} == by_id
    assert "wrote 0 result(s)" in run(*client_cmd, env=env, timeout=600).stdout  # resumed: nothing left

    down = run("bash", "deploy/hearth-down.sh", env=env)
    assert "removed 9 actor(s)" in down.stderr  # router + 2 x (pool, CPU worker, executor, monitor)
    assert run(hearth, "status", "--address", address, env=env, check=False).returncode == 1
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{http}/health", timeout=5)

