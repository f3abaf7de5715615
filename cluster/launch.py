"""Starting and stopping the actors of replicas and pipeline stages on a running Ray cluster, and
measuring the machines they may go to. Used by the deployment (``hearth up``, ``down``) and by the
membership loop (machines that join or leave); it decides nothing itself: the plans come from
:mod:`cluster.placement` and :mod:`cluster.stages`.

Every actor is named and detached in the ``hearth`` namespace, so a later ``hearth status`` or
``hearth down`` (another driver, or a Ray client) finds them.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hearth.cluster.actors import CpuWorkerActor, HostPoolActor, MonitorActor, ReplicaActor
from hearth.cluster.node_info import describe_this_node
from hearth.cluster.placement import NodeInfo, ReplicaPlan
from hearth.cluster.specs import NAMESPACE, DeployOptions, ReplicaInfo, ReplicaSpec
from hearth.cluster.stage_actor import StageActor
from hearth.cluster.stages import StagePlan
from hearth.config import EngineConfig

_BUILTIN_RESOURCES = re.compile(r"^(CPU|GPU|memory|object_store_memory|node:.*|accelerator_type:.*)$")


def _labels(resources: dict[str, float]) -> frozenset[str]:
    return frozenset(k for k in resources if not _BUILTIN_RESOURCES.match(k))


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    """The scheduling strategy that pins an actor or task to ``node_id``."""
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=0)
def _describe(node_id: str, address: str, labels: frozenset[str]) -> NodeInfo:
    return describe_this_node(node_id, address, labels)


def discover_nodes() -> list[NodeInfo]:
    """Every live node's capabilities, measured on the node itself."""
    return describe_nodes([n for n in ray.nodes() if n.get("Alive")])


def describe_nodes(nodes: list[dict[str, Any]]) -> list[NodeInfo]:
    """The capabilities of these nodes (entries of ``ray.nodes()``), each measured on itself."""
    refs = [_describe.options(scheduling_strategy=on_node(n["NodeID"])).remote(
        n["NodeID"], n["NodeManagerAddress"], _labels(n.get("Resources", {}))) for n in nodes]
    return list(ray.get(refs, timeout=120))


def replica_engine(replica: ReplicaPlan, overrides: dict[str, Any], pool_name: str) -> EngineConfig:
    """The engine settings of one replica: what its plan chooses, then the user's overrides. With an
    expert device, the CPU experts run in the replica's CPU-worker actor on the shared pool."""
    if replica.executor == "cuda":
        options: dict[str, Any] = {"expert_device": "cuda", "expert_cache": f"{replica.expert_cache_bytes}b"}
    else:
        options = {"expert_device": "none"}
    options.update(overrides)
    if options["expert_device"] != "none":
        options.setdefault("cpu_experts", "external")
    return EngineConfig(**options, host_pool_name=pool_name)


def _pool_name(model: str, replica: ReplicaPlan) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{model}-{replica.node_name}")[:40]
    return f"{safe}-{replica.node_id[:8]}"


def replica_specs(replicas: list[ReplicaPlan], options: DeployOptions, model_path: str,
                  model_name: str) -> list[ReplicaSpec]:
    specs = []
    for r in replicas:
        pool = _pool_name(model_name, r)
        specs.append(ReplicaSpec(r.replica_id, model_name, str(Path(model_path).resolve()), r.node_id, pool,
                                 replica_engine(r, options.engine_options, pool), max_waiting=options.max_waiting,
                                 monitor_interval_s=options.monitor_interval_s))
    return specs


def start_replica(spec: ReplicaSpec) -> Any:
    """Create the replica's actors on its node; returns the replica actor's handle."""
    common = {"namespace": NAMESPACE, "lifetime": "detached", "num_cpus": 0, "max_restarts": -1,
              "scheduling_strategy": on_node(spec.node_id)}
    ray.remote(HostPoolActor).options(name=spec.actor_name("pool"), **common).remote(spec)
    if spec.uses_cpu_worker:
        ray.remote(CpuWorkerActor).options(name=spec.actor_name("cpu"), max_concurrency=4, **common).remote(spec)
    gpus = 1 if spec.engine.experts.device == "cuda" else 0
    replica = ray.remote(ReplicaActor).options(name=spec.actor_name("replica"), num_gpus=gpus, **common).remote(spec)
    ray.remote(MonitorActor).options(name=spec.actor_name("monitor"), **common).remote(spec)
    return replica


def replica_info(r: ReplicaPlan, spec: ReplicaSpec) -> ReplicaInfo:
    """What the router knows of a replica planned as ``r`` and specified as ``spec``."""
    return ReplicaInfo(r.replica_id, r.model, r.node_id, r.node_name, spec.actor_name("replica"),
                       spec.actor_name("monitor"), r.executor, r.gpu_index, r.expert_cache_bytes)


def start_stages(options: DeployOptions, stages: tuple[StagePlan, ...]) -> tuple[ReplicaInfo, dict[str, Any]]:
    """Start the actors of a staged replica for the plan ``stages`` and wait until it serves; its
    router entry and the replica actor's ``ready`` report. A failed start removes what it started."""
    path, name = options.models[0]

    def engine(stage) -> EngineConfig:  # on a GPU, the stage's layers run the expert hierarchy there
        return EngineConfig(**{"expert_device": "cuda" if stage.executor == "cuda" else "none",
                               **options.engine_options, "static_decode": "off"})

    replica_id = f"{name}@{stages[0].node_name}"
    resolved = str(Path(path).resolve())
    later = [ReplicaSpec(f"{replica_id}/{s.index}", name, resolved, s.node_id, "", engine(s),
                         layers=(s.first_layer, s.end_layer)) for s in stages[1:]]
    first = ReplicaSpec(replica_id, name, resolved, stages[0].node_id, "", engine(stages[0]),
                        max_waiting=options.max_waiting, layers=(stages[0].first_layer, stages[0].end_layer),
                        next_stages=tuple(spec.actor_name("stage") for spec in later))
    gpus = {spec.node_id: 1 if spec.engine.experts.device == "cuda" else 0 for spec in (first, *later)}
    # A stage that dies is restarted on its machine (empty: the replica actor ends the requests it held);
    # one whose machine left stays down until the stages are planned again.
    common = {"namespace": NAMESPACE, "lifetime": "detached", "num_cpus": 0, "max_restarts": -1}
    for spec in later:
        ray.remote(StageActor).options(name=spec.actor_name("stage"), scheduling_strategy=on_node(spec.node_id),
                                       num_gpus=gpus[spec.node_id], **common).remote(spec)
    replica = ray.remote(ReplicaActor).options(name=first.actor_name("replica"), num_gpus=gpus[first.node_id],
                                               scheduling_strategy=on_node(first.node_id), **common).remote(first)
    try:
        ready = ray.get(replica.ready.remote(), timeout=options.ready_timeout_s)
        ray.get([ray.get_actor(spec.actor_name("stage"), namespace=NAMESPACE).ping.remote() for spec in later],
                timeout=options.ready_timeout_s)
    except Exception:
        teardown(lambda *_: None, replica_id)
        raise
    info = ReplicaInfo(replica_id, name, stages[0].node_id, stages[0].node_name, first.actor_name("replica"),
                       first.actor_name("monitor"), "cpu", None, 0)
    return info, ready


def _hearth_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith("hearth:"))


def teardown(log=print, replica_id: str | None = None) -> list[str]:
    """Stop everything ``deploy`` started: router, monitors, replica actors, stages, CPU workers, then the pools
    (closed first, so their shared memory is removed); or only the actors of ``replica_id``.
    Returns the names removed."""
    names = _hearth_actors()
    if replica_id is not None:  # its actors, and its later pipeline stages (named replica/index)
        names = [n for n in names if n.endswith(f":{replica_id}") or re.search(f":{re.escape(replica_id)}/\\d+$", n)]
    order = ("router", "monitor", "replica", "stage", "cpu", "pool")
    removed = []
    for role in order:
        for name in [n for n in names if n.split(":")[1] == role]:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # died meanwhile (its node left)
                continue
            if role == "pool":
                try:
                    ray.get(handle.close.remote(), timeout=30)
                except Exception as exc:  # noqa: BLE001 - a dead pool: its segment is cleaned on the node later
                    log(f"hearth: could not close {name} cleanly: {type(exc).__name__}")
            elif role in ("router", "replica"):
                with contextlib.suppress(Exception):  # a clean stop frees ports and shared memory; kill anyway
                    ray.get((handle.stop if role == "router" else handle.shutdown).remote(), timeout=30)
            ray.kill(handle, no_restart=True)
            removed.append(name)
    return removed
