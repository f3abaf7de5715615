"""A two-node Ray cluster on this machine (``desktop`` and ``laptop`` on 127.0.0.2) with a hearth
deployment on it, for the multinode tests: started, deployed, and everything torn down after."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def deployed_on_two_nodes(cache_dir: Path, options: Any, segments: tuple[str, ...] = ("tiny",),
                          env: dict[str, str] | None = None) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(the Ray test cluster, the deployment's description) for ``options`` (DeployOptions);
    ``segments``: the model names whose shared-memory pools are cleaned up at the end; ``env``:
    more environment for the nodes (such as ``HEARTH_RAM_LIMIT``)."""
    import ray
    from ray.cluster_utils import Cluster

    from hearth.cluster.deploy import deploy
    from hearth.cluster.launch import teardown
    from hearth.engine.experts.mechanism.host_pool import cleanup

    env = {"HEARTH_CACHE": str(cache_dir), **(env or {})}  # inherited by the nodes
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args={
        "resources": {"desktop": 1}, "num_cpus": 2, "node_ip_address": "127.0.0.2", "include_dashboard": False})
    cluster.add_node(resources={"laptop": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    ray.init(address=cluster.address)
    try:
        yield cluster, deploy(options, log=lambda *_: None)
    finally:
        try:
            teardown(log=lambda *_: None)
        finally:
            ray.shutdown()
            cluster.shutdown()
            for name in segments:
                for segment in Path("/dev/shm").glob(f"hearth-{name}-*"):
                    cleanup(segment.name)
            for key, value in old.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
