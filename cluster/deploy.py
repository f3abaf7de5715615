"""Carrying a placement plan out on a running Ray cluster: ``hearth up``, ``status`` and ``down``.

The decisions are made elsewhere (:func:`cluster.placement.plan_placement` over what
:func:`discover_nodes` finds); this module creates the actors of each replica pinned to their
node, waits until they serve, and starts the router. Every actor is named and detached in the
``hearth`` namespace, so a later ``hearth status`` or ``hearth down`` (another driver, or a Ray
client) finds them.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hearth.cluster.actors import NAMESPACE, CpuWorkerActor, ExecutorActor, HostPoolActor, MonitorActor, ReplicaSpec
from hearth.cluster.node_info import describe_this_node
from hearth.cluster.placement import ModelSpec, NodeInfo, PlacementError, ReplicaPlan, plan_placement
from hearth.cluster.router import ROUTER_NAME, ReplicaInfo, RouterActor, RouterConfig
from hearth.config import EngineConfig, ServingConfig
from hearth.proto.contracts import ModelInfo

_BUILTIN_RESOURCES = re.compile(r"^(CPU|GPU|memory|object_store_memory|node:.*|accelerator_type:.*)$")


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
        return ServingConfig(host=self.host, port=self.port, grpc_port=self.grpc_port, api_key=self.api_key,
                             model_names=tuple(name for _, name in self.models), max_waiting=self.max_waiting,
                             tool_parser=self.tool_parser)

    @property
    def name(self) -> str:
        return self.model_name or Path(self.model_path).name

    @property
    def models(self) -> list[tuple[str, str]]:
        """Every (checkpoint path, name) to serve, the first one first."""
        return [(self.model_path, self.name)] + [(path, name or Path(path).name) for path, name in self.more_models]


def _labels(resources: dict[str, float]) -> frozenset[str]:
    return frozenset(k for k in resources if not _BUILTIN_RESOURCES.match(k))


def _on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=0)
def _describe(node_id: str, address: str, labels: frozenset[str]) -> NodeInfo:
    return describe_this_node(node_id, address, labels)


def discover_nodes() -> list[NodeInfo]:
    """Every live node's capabilities, measured on the node itself."""
    return describe_nodes([n for n in ray.nodes() if n.get("Alive")])


def describe_nodes(nodes: list[dict[str, Any]]) -> list[NodeInfo]:
    """The capabilities of these nodes (entries of ``ray.nodes()``), each measured on itself."""
    refs = [_describe.options(scheduling_strategy=_on_node(n["NodeID"])).remote(
        n["NodeID"], n["NodeManagerAddress"], _labels(n.get("Resources", {}))) for n in nodes]
    return list(ray.get(refs, timeout=120))


def model_spec(path: str, name: str, replicas: int | None = None, require: str | None = None) -> ModelSpec:
    """Pool and dense sizes of the checkpoint at ``path``, from its config (and, for a quantized
    one, its files' size)."""
    from hearth.engine.checkpoint.dispatch import load_config
    from hearth.engine.checkpoint.inspect import summarize

    _, cfg = load_config(path)
    s = summarize(cfg)
    item = s.expert_pool_bytes // max(s.expert_params, 1)
    scale = stored_fraction(path, cfg, s.total_params * item)
    return ModelSpec(name, path, int(s.expert_pool_bytes * scale),
                     int((s.total_params - s.expert_params) * item * scale), replicas, require)


def stored_fraction(path: str, cfg: Any, float_bytes: int) -> float:
    """The weights' bytes on disk over ``float_bytes`` (their size as floats), at most 1, for a model
    that runs in float32: its quantized weights (a GGUF file's, an FTW directory's, an FP8 or MXFP4
    checkpoint's) stay in their blocks in memory too, so it needs about what it takes on disk. In
    another dtype they are decoded: 1."""
    import torch

    if cfg.dtype != torch.float32:
        return 1.0
    p = Path(path)
    files = [p] if p.is_file() else [*p.glob("*.safetensors"), *p.glob("*.ftw"), *p.glob("*.gguf")]
    stored = sum(f.stat().st_size for f in files if f.is_file())
    return min(1.0, stored / float_bytes) if stored and float_bytes else 1.0


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
    """Create the replica's actors on its node; returns the executor handle."""
    common = {"namespace": NAMESPACE, "lifetime": "detached", "num_cpus": 0, "max_restarts": -1,
              "scheduling_strategy": _on_node(spec.node_id)}
    ray.remote(HostPoolActor).options(name=spec.actor_name("pool"), **common).remote(spec)
    if spec.uses_cpu_worker:
        ray.remote(CpuWorkerActor).options(name=spec.actor_name("cpu"), max_concurrency=4, **common).remote(spec)
    gpus = 1 if spec.engine.experts.device == "cuda" else 0
    executor = ray.remote(ExecutorActor).options(name=spec.actor_name("executor"), num_gpus=gpus,
                                                 **common).remote(spec)
    ray.remote(MonitorActor).options(name=spec.actor_name("monitor"), **common).remote(spec)
    return executor


def replica_info(r: ReplicaPlan, spec: ReplicaSpec) -> ReplicaInfo:
    """What the router knows of a replica planned as ``r`` and specified as ``spec``."""
    return ReplicaInfo(r.replica_id, r.model, r.node_id, r.node_name, spec.actor_name("executor"),
                       spec.actor_name("monitor"), r.executor, r.gpu_index, r.expert_cache_bytes)


def _head_node_id() -> str:
    for n in ray.nodes():
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
            return n["NodeID"]
    return ray.get_runtime_context().get_node_id()


def deploy(options: DeployOptions, log=print) -> dict[str, Any]:
    """Deploy the model(s) onto the connected cluster, placed together by the planner; returns the
    router's description."""
    if find_router() is not None:
        raise RuntimeError("hearth is already deployed on this cluster (`hearth status`; `hearth down` first)")
    nodes = discover_nodes()
    try:
        if options.stages:
            raise PlacementError("pipeline stages asked for")
        plan = plan_placement(nodes, [model_spec(path, name, options.replicas, options.require)
                                      for path, name in options.models])
    except PlacementError as why:
        if len(options.models) > 1:
            raise
        return _deploy_stages(options, nodes, why, log)
    groups = []  # per model: (path, name, its replica plans, their specs)
    for path, name in options.models:
        replicas = [r for r in plan.replicas if r.model == name]
        groups.append((path, name, replicas, replica_specs(replicas, options, path, name)))
    for _, _, replicas, specs in groups:
        for r, spec in zip(replicas, specs, strict=True):
            log(f"hearth: replica {r.replica_id}: {r.executor} executor on {r.node_name} "
                f"({spec.engine.experts.device}), pool '{spec.pool_name}'")
    started = time.perf_counter()
    executors = [[start_replica(spec) for spec in specs] for *_, specs in groups]
    try:
        infos = [ray.get([e.ready.remote() for e in group], timeout=options.ready_timeout_s) for group in executors]
    except Exception:
        teardown()
        raise
    log(f"hearth: {sum(map(len, infos))} replica(s) ready in {time.perf_counter() - started:.1f} s")
    served = []
    for (path, name, replicas, specs), ready in zip(groups, infos, strict=True):
        model = ModelInfo(name, str(Path(path).resolve()), ready[0]["max_model_len"], ready[0]["vocab_size"],
                          int(time.time()))
        served.append((model, tuple(replica_info(r, s) for r, s in zip(replicas, specs, strict=True))))
    (first, first_replicas), *more = served
    config = RouterConfig(first, first_replicas, options.serving, options.health_interval_s, tuple(more), options,
                          nodes=tuple(nodes))
    return _start_router(config)


def _start_router(config: RouterConfig) -> dict[str, Any]:
    """The router on the head node, for ``config``; its description once it serves."""
    router = ray.remote(RouterActor).options(
        name=ROUTER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1, max_concurrency=64,
        scheduling_strategy=_on_node(_head_node_id())).remote(config)
    return ray.get(router.describe.remote(), timeout=120)


def layer_sizes(path: str) -> tuple[list[int], int, int]:
    """(bytes of each decoder layer, experts included; embeddings; head) from the config alone."""
    from hearth.engine.checkpoint.dispatch import load_config
    from hearth.engine.checkpoint.inspect import summarize

    _, cfg = load_config(path)
    s = summarize(cfg)
    item = s.expert_pool_bytes // max(s.expert_params, 1)
    scale = stored_fraction(path, cfg, s.total_params * item)
    embed = cfg.vocab_size * cfg.hidden_size * item
    head = 0 if cfg.tie_word_embeddings else embed
    dense = (s.total_params - s.expert_params) * item - embed - head
    per_moe = cfg.num_experts * s.expert_bytes
    return ([int((dense // cfg.num_layers + (per_moe if cfg.moe_layers[i] else 0)) * scale)
             for i in range(cfg.num_layers)], int(embed * scale), int(head * scale))


def _deploy_stages(options: DeployOptions, nodes: list[NodeInfo], why: Exception, log) -> dict[str, Any]:
    """One replica split by layers over machines (``plan_stages``): the first stage is the replica's
    executor, which schedules and samples; the later stages are stage actors it calls each step."""
    path, name = options.models[0]
    stages = plan_model_stages(options, nodes)
    if len(stages) == 1 and not options.stages:
        raise why  # it fits one machine after all: the placement error stands
    log(f"hearth: '{name}' as {len(stages)} pipeline stage(s) ({why}): " + ", ".join(
        f"layers {s.first_layer}-{s.end_layer - 1} on {s.node_name}" for s in stages))
    info, ready = start_stages(options, stages)
    model = ModelInfo(name, str(Path(path).resolve()), ready["max_model_len"], ready["vocab_size"], int(time.time()))
    config = RouterConfig(model, (info,), options.serving, options.health_interval_s, deploy=options,
                          nodes=tuple(nodes), stage_plan=stages)
    return _start_router(config)


def plan_model_stages(options: DeployOptions, nodes: list[NodeInfo]) -> tuple[Any, ...]:
    """The stage plan of the (one) model of ``options`` over ``nodes`` (raises PlacementError)."""
    from hearth.cluster.stages import plan_stages

    path, name = options.models[0]
    sizes, embed, head = layer_sizes(path)
    return plan_stages(nodes, name, sizes, embed, head, min_stages=2 if options.stages else 1)


def start_stages(options: DeployOptions, stages: tuple[Any, ...]) -> tuple[ReplicaInfo, dict[str, Any]]:
    """Start the actors of a staged replica for the plan ``stages`` and wait until it serves; its
    router entry and the executor's ``ready`` report. A failed start removes what it started."""
    from hearth.cluster.stage_actor import StageActor

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
    # A stage that dies is restarted on its machine (empty: the executor ends the requests it held);
    # one whose machine left stays down until the stages are planned again.
    common = {"namespace": NAMESPACE, "lifetime": "detached", "num_cpus": 0, "max_restarts": -1}
    for spec in later:
        ray.remote(StageActor).options(name=spec.actor_name("stage"), scheduling_strategy=_on_node(spec.node_id),
                                       num_gpus=gpus[spec.node_id], **common).remote(spec)
    executor = ray.remote(ExecutorActor).options(name=first.actor_name("executor"), num_gpus=gpus[first.node_id],
                                                 scheduling_strategy=_on_node(first.node_id), **common).remote(first)
    try:
        ready = ray.get(executor.ready.remote(), timeout=options.ready_timeout_s)
        ray.get([ray.get_actor(spec.actor_name("stage"), namespace=NAMESPACE).ping.remote() for spec in later],
                timeout=options.ready_timeout_s)
    except Exception:
        teardown(lambda *_: None, replica_id)
        raise
    info = ReplicaInfo(replica_id, name, stages[0].node_id, stages[0].node_name, first.actor_name("executor"),
                       first.actor_name("monitor"), "cpu", None, 0)
    return info, ready


def find_router():
    try:
        return ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _hearth_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith("hearth:"))


def teardown(log=print, replica_id: str | None = None) -> list[str]:
    """Stop everything ``deploy`` started: router, monitors, executors, CPU workers, then the pools
    (closed first, so their shared memory is removed); or only the actors of ``replica_id``.
    Returns the names removed."""
    names = _hearth_actors()
    if replica_id is not None:  # its actors, and its later pipeline stages (named replica/index)
        names = [n for n in names if n.endswith(f":{replica_id}") or re.search(f":{re.escape(replica_id)}/\\d+$", n)]
    order = ("router", "monitor", "executor", "stage", "cpu", "pool")
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
            elif role in ("router", "executor"):
                with contextlib.suppress(Exception):  # a clean stop frees ports and shared memory; kill anyway
                    ray.get((handle.stop if role == "router" else handle.shutdown).remote(), timeout=30)
            ray.kill(handle, no_restart=True)
            removed.append(name)
    return removed


def cluster_status() -> dict[str, Any] | None:
    """The deployment and, per replica, the numbers ``hearth status`` prints; None when nothing runs."""
    router = find_router()
    if router is None:
        return None
    desc = ray.get(router.describe.remote(), timeout=30)
    routing = ray.get(router.replica_stats.remote(), timeout=30)
    rows = []
    for r in desc["replicas"]:
        seen = routing.get(r["replica_id"], {})
        row = {"replica": r["replica_id"], "node": r["node_name"], "executor": r["executor_kind"],
               "gpu": r["gpu_index"], "cache_bytes": r["expert_cache_bytes"],
               **{k: seen.get(k) for k in ("healthy", "in_flight", "assigned", "decode_tok_s", "last_error",
                                            "prefix_blocks", "prompt_tokens", "cached_prompt_tokens")}}
        row.update(_replica_numbers(r))
        rows.append(row)
    stage_rows = ray.get(router.stage_rows.remote(), timeout=30) if desc.get("stages") else []
    return {**desc, "rows": rows, "stage_rows": stage_rows}


def _replica_numbers(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        stats = ray.get(ray.get_actor(r["executor_name"], namespace=NAMESPACE).stats.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - a dead or restarting executor: the row says so
        return {"state": "down"}
    out["state"] = "ready" if stats.get("ready") else "loading"
    out["running"] = stats.get("running", 0)
    experts = stats.get("experts") or {}
    out["hit_rate"] = experts.get("hit_rate")
    out["b_p"], out["b_h"] = experts.get("b_p"), experts.get("b_h")
    out["qtable"] = experts.get("qtable")
    try:
        monitor = ray.get(ray.get_actor(r["monitor_name"], namespace=NAMESPACE).status.remote(), timeout=10)
        out["bandwidth_changes"] = monitor["changes"]
    except Exception:  # noqa: BLE001
        out["bandwidth_changes"] = None
    return out
