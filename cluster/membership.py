"""Machines that come and go, carried out by the router: a machine that joins the Ray cluster gets
the replicas the planner gives it, without a redeploy; a machine that is drained (``hearth drain
NODE``) stops taking requests, finishes what it holds, then loses its replicas.

The decisions are :func:`cluster.placement.plan_joiners` over the machines' own reports; this
module only watches, starts and stops. Every ``interval_s`` it compares Ray's live nodes with the
ones it has already planned for: only new machines are described (a task on each) and planned.
With a fixed replica count, a model that lost replicas to a machine that left is topped up on the
machines without one.

A model split into pipeline stages (``stages``) is watched differently: when a machine holding one
of its stages leaves, the stages are planned again (``plan_stages``) over the machines there are,
as soon as they hold the model (at once, or when the machine comes back), and the new replica
replaces the broken one. Until then its requests end with a clear error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from hearth.cluster.launch import describe_nodes, replica_info, replica_specs, start_replica, start_stages, teardown
from hearth.cluster.placement import ModelSpec, NodeInfo, PlacementError, ReplicaPlan, plan_joiners
from hearth.cluster.sizing import model_spec, plan_model_stages
from hearth.cluster.specs import DeployOptions, ReplicaInfo
from hearth.cluster.stages import StagePlan

log = logging.getLogger("hearth.membership")


class Membership:
    """Watches the cluster's machines for one deployment (``options``: what it deploys; ``clients``:
    the router's engine client per model name)."""

    def __init__(self, options: DeployOptions, clients: dict[str, Any], interval_s: float = 5.0,
                 nodes: dict[str, NodeInfo] | None = None, stages: tuple[StagePlan, ...] = (),
                 specs: tuple[ModelSpec, ...] = ()) -> None:
        self.options, self.clients, self.interval_s = options, clients, interval_s
        self.stages = stages  # the stages of a staged deployment (empty: replicas)
        self._restage_tried: frozenset[str] | None = None  # the live machines of the last plan that failed
        self.nodes = nodes if nodes is not None else {}  # node id -> its report (shared with the router)
        self.paths = {name: path for path, name in options.models}
        self.planned: set[str] = {r.info.node_id for c in clients.values() for r in c.replicas.values()}
        self.drained: set[str] = set()  # node ids that get no replica again
        self.specs: list[ModelSpec] | None = list(specs) or None  # (None: sized at the first round)
        self.joined: list[tuple[str, float]] = []  # (replica id, seconds from noticing its machine to serving)
        self._task: asyncio.Task | None = None
        self._busy = asyncio.Lock()

    def start(self) -> None:
        """Run the watch loop on the current event loop (the router's)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                async with self._busy:
                    await self.reconcile()
            except Exception:  # noqa: BLE001 - a failed round is logged and tried again next time
                log.exception("membership round failed")

    async def reconcile(self) -> list[str]:
        """One round: start the replicas new machines get; returns their ids once they serve."""
        if self.stages:
            return await self._restage()
        noticed = time.monotonic()
        added = await asyncio.to_thread(self._plan_round)
        started = []
        for plan, info, actor in await asyncio.to_thread(self._start, added):
            try:
                await asyncio.wrap_future(actor.ready.remote().future())
            except Exception as exc:  # noqa: BLE001 - a replica that fails to load stays out; logged
                log.warning("replica %s did not start: %s", plan.replica_id, exc)
                continue
            self.clients[plan.model].add_replica(info)
            await self.clients[plan.model].check_health()  # in rotation now, not at the next check
            self.joined.append((plan.replica_id, time.monotonic() - noticed))
            log.info("replica %s joined on %s", plan.replica_id, plan.node_name)
            started.append(plan.replica_id)
        return started

    async def _restage(self) -> list[str]:
        """A staged deployment's round: if a machine holding a stage left, stop the broken replica and
        plan the stages again over the live machines (now, or in a later round once machines join);
        returns the new replica's id once it serves."""
        live = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in self.drained}
        if all(s.node_id in live for s in self.stages) or self._restage_tried == frozenset(live):
            return []  # intact, or no machine came or went since the last plan that failed
        noticed = time.monotonic()
        self._restage_tried = frozenset(live)
        name = self.stages[0].model
        client = self.clients[name]
        broken = [r for r in client.replicas.values() if r.note is None]
        for state in broken:  # its requests end with a clear error from now on
            state.healthy, state.note = False, (f"a machine holding its pipeline stages left or was drained; the "
                                                f"stages of '{name}' are planned again as soon as the machines "
                                                "hold them")
            state.lost.set()
        await asyncio.to_thread(lambda: [teardown(lambda *_: None, r.info.replica_id) for r in broken])
        try:
            stages, info = await asyncio.to_thread(self._start_stages, live)
        except PlacementError as exc:
            log.warning("the stages of '%s' lost a machine; waiting for machines that hold it: %s", name, exc)
            return []
        except Exception:
            self._restage_tried = None  # a start that failed (not the plan) is tried again next round
            raise
        client.replicas.clear()
        client.add_replica(info)
        await client.check_health()
        self.stages, self._restage_tried = stages, None
        self.joined.append((info.replica_id, time.monotonic() - noticed))
        log.info("'%s' planned again as %d stage(s): %s", name, len(stages), ", ".join(
            f"layers {s.first_layer}-{s.end_layer - 1} on {s.node_name}" for s in stages))
        return [info.replica_id]

    async def _drain_stage(self, node: str, timeout_s: float) -> dict[str, Any]:
        """Drain a machine that holds a pipeline stage: refused (nothing changes) when the other
        machines cannot hold the model; else the split replica takes no new request, finishes what
        it holds, and the stages are planned again without the machine."""
        node_id = next(s.node_id for s in self.stages if node in (s.node_name, s.node_id))
        others = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in self.drained | {node_id}]
        try:
            await asyncio.to_thread(lambda: plan_model_stages(self.options, describe_nodes(others)))
        except PlacementError as exc:
            raise LookupError(f"cannot drain '{node}': it holds a pipeline stage of '{self.stages[0].model}', and "
                              f"the other machines cannot hold the model without it ({exc})") from None
        client = self.clients[self.stages[0].model]
        async with self._busy:
            old = list(client.replicas.values())
            for r in old:
                r.draining = True
            left = await _finish(old, timeout_s)
            self.drained.add(node_id)
            self._restage_tried = None
            started = await self._restage()
            log.info("drained %s: its stage moved; replica %s", node, started)
            return {"node": node, "replicas": [r.info.replica_id for r in old], "unfinished": left,
                    "stages": [s.__dict__ for s in self.stages]}

    def _start_stages(self, live: dict[str, dict]) -> tuple[tuple[StagePlan, ...], ReplicaInfo]:
        nodes = describe_nodes(list(live.values()))
        self.nodes.update({n.node_id: n for n in nodes})
        stages = plan_model_stages(self.options, nodes)
        return stages, start_stages(self.options, stages)[0]

    def _plan_round(self) -> tuple[ReplicaPlan, ...]:
        live = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        holders = {name: frozenset(r.info.node_id for r in c.replicas.values() if r.info.node_id in live)
                   for name, c in self.clients.items()}
        if self.specs is None:
            self.specs = [model_spec(path, name, self.options.replicas, self.options.require)
                          for path, name in self.options.models]
        short = any(s.replicas is not None and len(holders[s.name]) < s.replicas for s in self.specs)
        fresh = [nid for nid in live if nid not in self.drained and (nid not in self.planned or short)]
        if not fresh:
            return ()
        nodes: list[NodeInfo] = describe_nodes([live[nid] for nid in fresh])
        self.nodes.update({n.node_id: n for n in nodes})
        self.planned.update(fresh)
        return plan_joiners(nodes, self.specs, {k: len(v) for k, v in holders.items()}, holders)

    def _start(self, added: tuple[ReplicaPlan, ...]) -> list[tuple[ReplicaPlan, Any, Any]]:
        out = []
        for plan in added:
            spec = replica_specs([plan], self.options, self.paths[plan.model], plan.model)[0]
            log.info("starting replica %s on a machine that joined (%s)", plan.replica_id, plan.executor)
            out.append((plan, replica_info(plan, spec), start_replica(spec)))
        return out

    async def drain(self, node: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Drain the machine named (or with the id) ``node``; see ``RouterActor.drain``."""
        if any(node in (s.node_name, s.node_id) for s in self.stages):
            return await self._drain_stage(node, timeout_s)
        targets = [(c, r) for c in self.clients.values() for r in list(c.replicas.values())
                   if node in (r.info.node_name, r.info.node_id)]
        if not targets:
            known = sorted({r.info.node_name for c in self.clients.values() for r in c.replicas.values()})
            raise LookupError(f"no replica on a machine named '{node}' (machines with replicas: {known})")
        async with self._busy:
            self.drained.update(r.info.node_id for _, r in targets)
            for _, r in targets:
                r.draining = True
            left = await _finish([r for _, r in targets], timeout_s)
            for client, r in targets:
                await asyncio.to_thread(teardown, lambda *_: None, r.info.replica_id)
                client.replicas.pop(r.info.replica_id, None)
                r.lost.set()
            log.info("drained %s: %s", node, [r.info.replica_id for _, r in targets])
            return {"node": node, "replicas": [r.info.replica_id for _, r in targets], "unfinished": left}


async def _finish(replicas: list[Any], timeout_s: float) -> int:
    """Wait until draining ``replicas`` hold no request, for ``timeout_s`` at most; the requests left."""
    deadline = time.monotonic() + timeout_s
    while any(r.in_flight for r in replicas) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return sum(r.in_flight for r in replicas)
