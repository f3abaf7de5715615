"""Carrying a placement plan out on a running Ray cluster: ``hearth up`` and ``status``.

The decisions are made elsewhere (:func:`cluster.placement.plan_placement` over what
:func:`cluster.launch.discover_nodes` finds); this module has the replicas' actors started
(:mod:`cluster.launch`), waits until they serve, and starts the router. ``hearth down`` is
:func:`cluster.launch.teardown`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray

from hearth.cluster.launch import (
    discover_nodes,
    on_node,
    replica_info,
    replica_specs,
    start_replica,
    start_stages,
    teardown,
)
from hearth.cluster.placement import NodeInfo, PlacementError, plan_placement
from hearth.cluster.router import RouterActor, RouterConfig
from hearth.cluster.sizing import model_spec, plan_model_stages
from hearth.cluster.specs import NAMESPACE, ROUTER_NAME, DeployOptions
from hearth.proto.contracts import ModelInfo


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
        model_specs = tuple(model_spec(path, name, options.replicas, options.require)
                            for path, name in options.models)
        plan = plan_placement(nodes, list(model_specs))
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
    actors = [[start_replica(spec) for spec in specs] for *_, specs in groups]
    try:
        infos = [ray.get([e.ready.remote() for e in group], timeout=options.ready_timeout_s) for group in actors]
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
                          nodes=tuple(nodes), specs=model_specs)
    return _start_router(config)


def _start_router(config: RouterConfig) -> dict[str, Any]:
    """The router on the head node, for ``config``; its description once it serves."""
    router = ray.remote(RouterActor).options(
        name=ROUTER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1, max_concurrency=64,
        scheduling_strategy=on_node(_head_node_id())).remote(config)
    return ray.get(router.describe.remote(), timeout=120)


def _deploy_stages(options: DeployOptions, nodes: list[NodeInfo], why: Exception, log) -> dict[str, Any]:
    """One replica split by layers over machines (``plan_stages``): the first stage is the replica
    actor, which schedules and samples; the later stages are stage actors it calls each step."""
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


def find_router():
    try:
        return ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


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
        stats = ray.get(ray.get_actor(r["replica_actor_name"], namespace=NAMESPACE).stats.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - a dead or restarting replica actor: the row says so
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
