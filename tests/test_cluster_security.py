"""The security rows of ``bench/reliability.py`` (``bench/security.py``) against the cluster's router
on two nodes: the router serves the same app, so every guard must hold there too (``-m multinode``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench import security
from hearth.cluster.specs import DeployOptions
from hearth.config import ServingConfig
from hearth.serving.server import free_port
from tests.cluster_helpers import deployed_on_two_nodes

pytestmark = pytest.mark.multinode


@dataclass(frozen=True)
class Router:
    """What the rows need of a server: its address and ports."""

    url: str
    port: int
    grpc_port: int


@pytest.fixture(scope="module")
def router(tmp_path_factory, agent_checkpoint):
    port, grpc_port = free_port(), free_port()
    serving = ServingConfig(api_key_file=security.key_file(), read_timeout=security.READ_TIMEOUT_S,
                            response_store_bytes=security.STORE_BYTES)
    options = DeployOptions(str(agent_checkpoint), "tiny", port=port, grpc_port=grpc_port, health_interval_s=0.5,
                            engine_options={"max_model_len": 2048}, serving_config=serving)
    with deployed_on_two_nodes(tmp_path_factory.mktemp("hearth-cache"), options) as (_, desc):
        yield Router(desc["url"], port, grpc_port)


@pytest.mark.parametrize("row", [security.cross_key, security.browser, security.unsatisfiable, security.logit_bias,
                                 security.grpc_rows, security.big_bodies],
                         ids=lambda f: f.__name__)
def test_a_security_row_holds_through_the_router(router, row) -> None:
    result = row(router, "tiny")
    assert result["holds"], result


def test_slow_connections_to_the_router_are_closed(router) -> None:
    result = security.slow_connections(router, count=100)
    assert result["holds"], result
