"""The router's status page, in a real headless browser (Debian's Chromium through Playwright; no
browser download) against a two-node cluster: the machines, each replica's bandwidths and q table
are rendered, and the page updates. Set HEARTH_STATUS_SCREENSHOT=PATH to keep a screenshot.
Marked ``multinode``."""

from __future__ import annotations

import os
import shutil

import pytest
import requests

ray = pytest.importorskip("ray")
sync_api = pytest.importorskip("playwright.sync_api")

from hearth.cluster.specs import DeployOptions  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402
from tests.cluster_helpers import deployed_on_two_nodes  # noqa: E402

pytestmark = pytest.mark.multinode
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "status-page-key"
ENGINE = {"expert_device": "virtual", "expert_cache": "0.5", "cpu_experts": "external", "q_mode": "table",
          "max_model_len": 512}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, agent_checkpoint):
    if CHROMIUM is None:
        pytest.skip("no system Chromium (Debian package chromium); .ci/run installs it")
    options = DeployOptions(str(agent_checkpoint), "tiny", port=free_port(), grpc_port=None, api_key=KEY,
                            engine_options=ENGINE, health_interval_s=0.5, monitor_interval_s=0.5)
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options) as (_, desc):
        yield desc


def test_the_status_page_shows_machines_bandwidths_and_q_tables_live(deployment) -> None:
    url = deployment["url"]
    assert requests.get(f"{url}/", timeout=30).status_code == 401  # behind the API key
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            page.goto(f"{url}/?key={KEY}")
            polls = lambda: int(page.inner_text("#polls"))  # noqa: E731
            page.wait_for_function("Number(document.getElementById('polls').textContent) >= 2", timeout=30_000)
            machines = page.inner_text("#nodes tbody")
            assert "desktop" in machines and "laptop" in machines and "up" in machines
            # Both replicas, serving, with the monitors' bandwidths and a q table (numbers, not "-").
            page.wait_for_function("""() => [...document.querySelectorAll('#replicas tbody tr')].length === 2 &&
                [...document.querySelectorAll('#replicas td.bp, #replicas td.bh')].every(td => td.textContent !== '-')
                && [...document.querySelectorAll('#replicas td.qtable')].every(td => td.textContent.includes('1:'))""",
                                   timeout=60_000)
            rows = page.inner_text("#replicas tbody")
            assert "tiny@desktop" in rows and "tiny@laptop" in rows and rows.count("serving") == 2
            # It updates: requests show up in the list, and the poll count keeps rising.
            before = polls()
            for i in range(3):
                reply = requests.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                      json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4}, timeout=120)
                assert reply.status_code == 200
            page.wait_for_function("document.querySelectorAll('#recent tbody tr').length >= 3", timeout=30_000)
            assert polls() > before
            assert "completions" in page.inner_text("#recent tbody")
            if os.environ.get("HEARTH_STATUS_SCREENSHOT"):
                page.screenshot(path=os.environ["HEARTH_STATUS_SCREENSHOT"], full_page=True)
        finally:
            browser.close()
