"""What a deployment is made of, as plain typed data: the options of ``hearth up``, each replica's
spec (what its actors need) and the router's view of it, and the names its actors are found by.

No Ray and no engine here: these cross process boundaries, and every other cluster module (the
actors, the router, the launch and membership code, the Python client) reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hearth.config import EngineConfig, ServingConfig

NAMESPACE = "hearth"  # the Ray namespace of every named, detached actor of a deployment
ROUTER_NAME = "hearth:router"


@dataclass(frozen=True)
class DeployOptions:
    """What ``hearth up`` deploys and how it listens. ``engine_options`` (engine settings by option
    name, see :class:`hearth.config.EngineConfig`) override what the plan chooses per replica; tests
    use the virtual device this way. They are checked when the options are made."""

    model_path: str
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051
    api_key: str | None = None
    replicas: int | None = None
    require: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    monitor_interval_s: float = 2.0
    health_interval_s: float = 1.0
    ready_timeout_s: float = 900.0
    max_waiting: int = 64
    tool_parser: str | None = None
    more_models: tuple[tuple[str, str | None], ...] = ()  # further (path, name) pairs, served beside the first
    stages: bool = False  # split the (one) model by layers over the machines even where one would hold it
    # The rest of `hearth up`'s serving settings (key file, allowed hosts, CORS, store budget, timeouts);
    # the fields above override theirs. A key file is read where the router runs (the head node).
    serving_config: ServingConfig | None = None

    def __post_init__(self) -> None:
        # A clear ConfigError now rather than inside an actor (each replica gets its own pool's name).
        EngineConfig(**{"host_pool_name": "check", **self.engine_options})
        names = [name for _, name in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique (give --model NAME=DIR), got {names}")
        if self.stages and len(names) > 1:
            raise ValueError("pipeline stages (--stages) split one model; deploy the others separately")

    @property
    def serving(self) -> ServingConfig:
        fields = dict(host=self.host, port=self.port, grpc_port=self.grpc_port, api_key=self.api_key,
                      model_names=tuple(name for _, name in self.models), max_waiting=self.max_waiting,
                      tool_parser=self.tool_parser)
        if self.serving_config is None:
            return ServingConfig(**fields)
        return dataclasses.replace(self.serving_config, **fields)

    @property
    def name(self) -> str:
        return self.model_name or Path(self.model_path).name

    @property
    def models(self) -> list[tuple[str, str]]:
        """Every (checkpoint path, name) to serve, the first one first."""
        return [(self.model_path, self.name)] + [(path, name or Path(path).name) for path, name in self.more_models]


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything the actors of one replica need (plain, typed data: it crosses process boundaries).
    ``engine`` names the replica's shared pool (``host_pool_name``)."""

    replica_id: str
    model_name: str
    model_path: str
    node_id: str
    pool_name: str
    engine: EngineConfig = EngineConfig()
    max_waiting: int = 64
    monitor_interval_s: float = 2.0
    probe_idle_s: float = 300.0
    # Pipeline stages: this actor's layers [first, end) (None: the whole model), and the actor
    # names of the later stages, in order (on the first stage).
    layers: tuple[int, int] | None = None
    next_stages: tuple[str, ...] = ()

    def actor_name(self, role: str) -> str:
        """The name of this replica's actor in ``role``: replica, pool, cpu, monitor or stage."""
        return f"hearth:{role}:{self.replica_id}"

    @property
    def staged(self) -> bool:
        return self.layers is not None

    @property
    def uses_cpu_worker(self) -> bool:
        return self.engine.experts.cpu_workers == "external"


def stage_actor_name(replica_id: str, index: int) -> str:
    """The actor name of stage ``index`` (1, 2, ...) of the split replica ``replica_id``."""
    return f"hearth:stage:{replica_id}/{index}"


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica as the router knows it: ids, where it runs, and its replica actor's name."""

    replica_id: str
    model: str
    node_id: str
    node_name: str
    replica_actor_name: str
    monitor_name: str
    executor_kind: str = "cpu"  # where its engine runs the model: "cuda" or "cpu"
    gpu_index: int | None = None
    expert_cache_bytes: int = 0
