"""The security rows of ``bench/reliability.py`` (``bench/security.py``) against the cluster's router
on two nodes: the router serves the same app, so every guard must hold there too (``-m multinode``)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import security
from bench.reliability import rss_mb
from hearth.cluster.specs import DeployOptions
from hearth.config import ServingConfig
from hearth.serving.server import free_port
from tests.cluster_helpers import deployed_on_two_nodes

pytestmark = pytest.mark.multinode


@dataclass(frozen=True)
class Router:
    """What the rows need of a server: its address and ports, the router process's memory and log."""

    url: str
    port: int
    grpc_port: int
    pid: int

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def log_text(self) -> str:
        """The router actor's stderr and stdout (Ray writes each worker's to files named by its pid)."""
        files = glob.glob(f"/tmp/ray/session_*/logs/worker-*-{self.pid}.*")
        newest = sorted(files, key=os.path.getmtime)[-2:]  # this session's .err and .out
        return "".join(Path(f).read_text(errors="replace") for f in sorted(newest))


@pytest.fixture(scope="module")
def router(tmp_path_factory, agent_checkpoint):
    port, grpc_port = free_port(), free_port()
    # intake_timeout: counting 3.7M tokens takes ~10 s on one idle core here, and three times that on CI's two
    # cores beside two Ray nodes; the rows test the guards and /health, not the intake's 503 (test_serving_limits).
    serving = ServingConfig(api_key_file=security.key_file(), read_timeout=security.READ_TIMEOUT_S,
                            response_store_bytes=security.STORE_BYTES, intake_timeout=110.0)
    options = DeployOptions(str(agent_checkpoint), "tiny", port=port, grpc_port=grpc_port, health_interval_s=0.5,
                            engine_options={"max_model_len": 2048}, serving_config=serving)
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options) as (_, desc):
        yield Router(desc["url"], port, grpc_port, desc["pid"])


# constrained_stalls first: it measures the first constrained request the replicas see.
@pytest.mark.parametrize("row", [security.constrained_stalls, security.cross_key, security.browser,
                                 security.store_budget, security.unsatisfiable, security.logit_bias,
                                 security.grpc_rows, security.big_bodies, security.disconnect_log],
                         ids=lambda f: f.__name__)
def test_a_security_row_holds_through_the_router(router, row) -> None:
    result = row(router, "tiny")
    assert result["holds"], result


def test_slow_connections_to_the_router_are_closed(router) -> None:
    result = security.slow_connections(router, count=100)
    assert result["holds"], result


def test_the_cluster_settings_file_never_ends_in_a_traceback() -> None:
    result = security.config_fuzz(200, command="up")
    assert result["holds"], result
