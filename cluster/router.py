"""The router: one named, detached actor per cluster serving the HTTP and gRPC API over replicas.

:class:`RouterEngineClient` implements the serving layer's engine-client contract on top of the
replica actors, so the OpenAI, Anthropic and gRPC front ends run unchanged. Per request it picks
a replica with :func:`cluster.routing.choose_replica` and streams the replica actor's chunks back.
A replica that fails is out of rotation at once; a request that has not streamed anything yet is
retried on another replica; one that has gets :class:`ReplicaLost` (an error event in its
protocol, then the stream closes). A health loop brings restarted replicas back and refreshes
their measured decode speed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from hearth.cluster.cluster_api import run_request
from hearth.cluster.membership import Membership
from hearth.cluster.placement import ModelSpec, NodeInfo
from hearth.cluster.routing import ReplicaLoad, choose_replica
from hearth.cluster.specs import NAMESPACE, DeployOptions, ReplicaInfo, stage_actor_name
from hearth.cluster.stages import StagePlan
from hearth.config import ServingConfig
from hearth.proto.contracts import EngineNotReady, EngineOverloaded, GenerateRequest, GenerationChunk, ModelInfo
from hearth.proto.prefix import block_hashes
from hearth.serving.app import ServedModel, ServerState
from hearth.serving.server import BackgroundServer, guard_options

log = logging.getLogger("hearth.router")


class ReplicaLost(RuntimeError):
    """The replica serving a request left after the request had started streaming."""


@dataclass
class _ReplicaState:
    info: ReplicaInfo
    handle: Any
    healthy: bool = False
    in_flight: int = 0
    assigned: int = 0
    decode_tok_s: float = 0.0
    last_error: str | None = None
    engine_stats: dict[str, Any] = field(default_factory=dict)  # the latest, from the health loop
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False  # out of rotation for new requests; removed once its requests finish
    cached: frozenset[int] = frozenset()  # its prefix cache's block hashes (health loop)
    block_size: int = 0
    prompt_tokens: int = 0  # of the requests it finished
    cached_prompt_tokens: int = 0  # of those, served from its prefix cache
    note: str | None = None  # why it is out of rotation, where more is known than the last error

    def load(self) -> ReplicaLoad:
        warmth = float((self.engine_stats.get("experts") or {}).get("hit_rate") or 0.0)
        return ReplicaLoad(self.info.replica_id, self.info.model, self.healthy and not self.draining, self.in_flight,
                           self.decode_tok_s, self.assigned, self.cached, self.block_size, warmth)


def _app_error(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The application exception inside a task error (so the API maps it like a local one)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else RuntimeError(str(exc).splitlines()[0])


def _let_go(gen: Any, cancel: bool) -> None:
    """Abort a replica stream the caller left (or whose replica failed); the generator then goes
    out of scope on this thread."""
    if cancel:
        ray.cancel(gen)


class RouterEngineClient:
    """The engine client of the router's API server: one model, several replicas."""

    def __init__(self, model: ModelInfo, replicas: list[ReplicaInfo], health_interval_s: float = 1.0,
                 call_timeout_s: float = 5.0) -> None:
        self.model = model
        self.health_interval_s = health_interval_s
        self.call_timeout_s = call_timeout_s
        self.replicas: dict[str, _ReplicaState] = {}
        for r in replicas:
            self.replicas[r.replica_id] = _ReplicaState(r, ray.get_actor(r.replica_actor_name, namespace=NAMESPACE))
        self._health_task: asyncio.Task | None = None
        self.routed = [0, 0.0]  # requests routed, seconds spent choosing (hashing the prompt included)
        self._loaded = threading.Event()
        self.load_error: BaseException | None = None
        # Starting a replica stream, cancelling one and letting go of its generator each hold the GIL
        # for about 1-2 ms; 64 clients arriving or leaving at once would hold the server's loop (and
        # every other request on it) for over 100 ms, so those calls run on a thread of their own.
        self._ray_calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hearth-router-ray")

    # -- the engine-client contract ------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._loaded.wait(timeout):
            raise TimeoutError("no replica became ready in time")

    def unavailable(self) -> str | None:
        """Why no replica serves, once the deployment served (None while it still loads)."""
        if not self._loaded.is_set() or self.ready:
            return None
        return f"no replica of '{self.model.name}' is available ({self._describe_unavailable()})"

    def stats(self) -> dict[str, Any]:
        states = list(self.replicas.values())
        in_flight = sum(r.in_flight for r in states)
        routed = self.routed
        return {"running": in_flight, "waiting": 0, "in_flight": in_flight,
                "route_seconds_mean": routed[1] / routed[0] if routed[0] else 0.0,
                "replicas": {r.info.replica_id: {"healthy": r.healthy, "in_flight": r.in_flight, "assigned": r.assigned,
                                                 "decode_tok_s": r.decode_tok_s, "last_error": r.last_error,
                                                 "node": r.info.node_name, "executor": r.engine_stats,
                                                 "prefix_blocks": len(r.cached), "prompt_tokens": r.prompt_tokens,
                                                 "cached_prompt_tokens": r.cached_prompt_tokens}
                             for r in states}}

    def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        self._ray_calls.shutdown(wait=False)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Stream from a replica; before the first chunk, a failed replica means a retry elsewhere."""
        self._ensure_health_loop()
        tried: set[str] = set()
        overloaded: EngineOverloaded | None = None
        started = time.perf_counter()
        sizes = {r.block_size for r in self.replicas.values() if r.cached}
        prompt_hashes = {size: block_hashes(request.prompt_ids, size) for size in sizes}
        while True:
            rid = choose_replica([r.load() for r in self.replicas.values()], self.model.name, request.session_key,
                                 frozenset(tried), prompt_hashes)
            if not tried:
                self.routed[0] += 1
                self.routed[1] += time.perf_counter() - started
            if rid is None:
                if overloaded is not None:
                    raise overloaded
                raise EngineNotReady(f"no replica of '{self.model.name}' is available "
                                     f"({self._describe_unavailable()})")
            state = self.replicas[rid]
            state.in_flight += 1
            state.assigned += 1
            streamed = False
            try:
                async for chunk in self._stream(state, request):
                    streamed = True
                    if chunk.finished and chunk.metrics is not None:
                        state.prompt_tokens += chunk.metrics.num_prompt_tokens
                        state.cached_prompt_tokens += chunk.metrics.num_cached_tokens
                    yield chunk
                return
            except EngineOverloaded as exc:
                overloaded = exc
            except ray.exceptions.RayTaskError as exc:
                raise _app_error(exc) from None
            except (ray.exceptions.RayError, _Lost) as exc:
                self._mark_down(state, exc)
                if streamed:
                    raise ReplicaLost(f"replica {rid} on node {state.info.node_name} left while this request was "
                                      "streaming; the partial reply is incomplete, retry the request") from None
                log.warning("replica %s failed before streaming request %s; retrying elsewhere", rid,
                            request.request_id)
            finally:
                state.in_flight -= 1
            tried.add(rid)

    async def _stream(self, state: _ReplicaState, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """The replica's chunks; raises :class:`_Lost` as soon as the replica is declared down."""
        loop = asyncio.get_running_loop()
        gen = await loop.run_in_executor(self._ray_calls, state.handle.generate.remote, request)
        lost = asyncio.ensure_future(state.lost.wait())
        ended = False
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                done, _ = await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    raise _Lost(state.last_error or "replica down")
                try:
                    ref = nxt.result()
                except StopAsyncIteration:
                    ended = True
                    return
                chunk = await ref
                ended = chunk.finished
                yield chunk
                if chunk.finished:
                    return
        finally:
            lost.cancel()
            # The thread holds the last reference, so the generator's cleanup runs there too.
            self._ray_calls.submit(_let_go, gen, not ended)
            del gen

    async def resize_expert_cache(self, size: str, replica: str | None = None) -> dict[str, dict[str, Any]]:
        """Resize the device expert cache of one replica, or of every replica in rotation (each at its
        next step boundary); {replica: report, or {"error": why} where that replica could not}."""
        if replica is not None and replica not in self.replicas:
            raise LookupError(f"no replica '{replica}' (the replicas: {', '.join(sorted(self.replicas))})")
        targets = [self.replicas[replica]] if replica is not None else \
            [r for r in self.replicas.values() if r.healthy]
        if not targets:
            raise EngineNotReady(f"no replica of '{self.model.name}' is available ({self._describe_unavailable()})")
        results = await asyncio.gather(*(_as_future(r.handle.resize_expert_cache.remote(size)) for r in targets),
                                       return_exceptions=True)
        errors = [_app_error(x) if isinstance(x, ray.exceptions.RayTaskError) else x
                  for x in results if isinstance(x, BaseException)]
        if len(errors) == len(results):
            raise errors[0]  # e.g. no replica has a cache: the API answers with its message
        return {r.info.replica_id: ({"error": str(x).splitlines()[0]} if isinstance(x, BaseException) else x)
                for r, x in zip(targets, results, strict=True)}

    # -- membership ----------------------------------------------------------------------------
    def add_replica(self, info: ReplicaInfo) -> None:
        """A replica started after deployment (a machine joined); the health loop brings it into
        rotation at its first good check. Called on the server's loop."""
        handle = ray.get_actor(info.replica_actor_name, namespace=NAMESPACE)
        self.replicas[info.replica_id] = _ReplicaState(info, handle)

    # -- health --------------------------------------------------------------------------------
    def _mark_down(self, state: _ReplicaState, exc: BaseException) -> None:
        if state.healthy:
            log.warning("replica %s is out of rotation: %s", state.info.replica_id, str(exc).splitlines()[0][:200])
        state.healthy = False
        state.last_error = type(exc).__name__
        state.lost.set()  # ends the other streams on it now

    def _describe_unavailable(self) -> str:
        return ", ".join(f"{r.info.replica_id}: {r.note or r.last_error or 'not ready'}"
                         for r in self.replicas.values())

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def start(self) -> None:
        """First health check (marks ready replicas) and the periodic loop."""
        await self.check_health()
        self._loaded.set()
        self._ensure_health_loop()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(state) for state in list(self.replicas.values())))

    async def _check(self, state: _ReplicaState) -> None:
        try:
            stats, prefix = await asyncio.wait_for(asyncio.gather(_as_future(state.handle.stats.remote()),
                                                                  _as_future(state.handle.prefix_summary.remote())),
                                                   self.call_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            self._mark_down(state, exc)
            return
        if prefix:
            state.cached, state.block_size = frozenset(prefix["hashes"]), int(prefix["block_size"])
        if not stats.get("ready") or state.note is not None:  # loading, or taken out (see ``note``)
            return
        if not state.healthy:
            log.info("replica %s is in rotation", state.info.replica_id)
            state.lost = asyncio.Event()
            state.last_error = None
        state.healthy = True
        state.decode_tok_s = float(stats.get("decode_tok_s") or 0.0)
        state.engine_stats = stats


class _Lost(Exception):
    """Internal: the health loop declared the replica down while a stream waited on it."""


def _as_future(ref) -> asyncio.Future:
    return asyncio.wrap_future(ref.future())


class ModelSetClient:
    """The router's engine clients of several models as one, for what is not per model: readiness,
    statistics (every replica), expert-cache resizing and shutdown. Requests go to each model's own
    client (the serving layer's :class:`~hearth.serving.app.ServedModel`)."""

    def __init__(self, clients: list[RouterEngineClient]) -> None:
        self.clients = clients
        self.model = clients[0].model

    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.clients)

    @property
    def load_error(self) -> BaseException | None:
        return next((c.load_error for c in self.clients if c.load_error is not None), None)

    def wait_ready(self, timeout: float | None = None) -> None:
        for c in self.clients:
            c.wait_ready(timeout)

    def stats(self) -> dict[str, Any]:
        parts = [c.stats() for c in self.clients]
        routed = sum(c.routed[0] for c in self.clients)
        return {"running": sum(p["running"] for p in parts), "waiting": 0,
                "in_flight": sum(p["in_flight"] for p in parts),
                "route_seconds_mean": sum(c.routed[1] for c in self.clients) / routed if routed else 0.0,
                "replicas": {rid: r for p in parts for rid, r in p["replicas"].items()}}

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.clients))

    def close(self) -> None:
        for c in self.clients:
            c.close()

    async def resize_expert_cache(self, size: str, replica: str | None = None) -> dict[str, dict[str, Any]]:
        if replica is not None:
            owner = next((c for c in self.clients if replica in c.replicas), None)
            if owner is None:
                raise LookupError(f"no replica '{replica}' (the replicas: "
                                  f"{', '.join(sorted(r for c in self.clients for r in c.replicas))})")
            return await owner.resize_expert_cache(size, replica)
        results: dict[str, dict[str, Any]] = {}
        for c in self.clients:
            results.update(await c.resize_expert_cache(size))
        return results


@dataclass(frozen=True)
class RouterConfig:
    """How the router serves: the first model and its replicas, any further (model, replicas), and
    the listeners."""

    model: ModelInfo
    replicas: tuple[ReplicaInfo, ...]
    serving: ServingConfig = ServingConfig()
    health_interval_s: float = 1.0
    more: tuple[tuple[ModelInfo, tuple[ReplicaInfo, ...]], ...] = ()
    deploy: DeployOptions | None = None  # to start replicas on machines that join (None: no membership)
    membership_interval_s: float = 5.0
    nodes: tuple[NodeInfo, ...] = ()  # each machine at deployment (for the status page)
    stage_plan: tuple[StagePlan, ...] = ()  # a staged deployment's stages (planned again when a machine leaves)
    # What each model needs of a machine, as deployment measured it: the router then never builds a
    # model to size one (seconds of the GIL in the router's process, stalling every request it serves).
    specs: tuple[ModelSpec, ...] = ()

    @property
    def groups(self) -> list[tuple[ModelInfo, tuple[ReplicaInfo, ...]]]:
        return [(self.model, self.replicas), *self.more]


class RouterActor:
    """Runs the API server (HTTP + gRPC) on its own thread and event loop inside the actor."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.started = time.time()
        serving = config.serving
        clients = [RouterEngineClient(model, list(replicas), config.health_interval_s)
                   for model, replicas in config.groups]
        self._clients = clients
        self.client = clients[0] if len(clients) == 1 else ModelSetClient(clients)
        # One model answers to every --served-model-name; several answer to their own names.
        names = [list(serving.model_names) or [config.model.name]] if len(clients) == 1 else \
            [[c.model.name] for c in clients]
        models = [ServedModel(n, c, serving.tool_parser) for n, c in zip(names, clients, strict=True)]
        state = ServerState(self.client, None, serving.api_keys(), serving.tool_parser, serving.max_body_bytes,
                            serving.intake_timeout, models=models, **guard_options(serving))
        self.membership = None
        self.nodes = {n.node_id: n for n in config.nodes}  # what each machine reported of itself
        if config.deploy is not None:
            self.membership = Membership(config.deploy, {c.model.name: c for c in clients},
                                         config.membership_interval_s, self.nodes, config.stage_plan, config.specs)
        state.node_provider = self.node_rows
        state.stage_provider = self.stage_rows
        self.server = BackgroundServer(state, serving, on_loop_start=self._start)
        self.server.start()

    def node_rows(self) -> list[dict[str, Any]]:
        """The machines for the status page: what each reported, and whether Ray sees it alive."""
        alive = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
        return [{**asdict(n), "name": n.name, "alive": alive.get(n.node_id, False)} for n in list(self.nodes.values())]

    def stage_rows(self) -> list[dict[str, Any]]:
        """A split model's stages for the status page: machine, layers and whether each answers (the
        first stage is the replica actor: its health is the replica's)."""
        stages = self.membership.stages if self.membership is not None else ()
        if not stages:
            return []
        replica = next(iter(self.membership.clients[stages[0].model].replicas.values()), None)
        rows = [{**s.__dict__, "healthy": bool(replica and replica.healthy), "error": None} for s in stages]
        if replica is None or replica.note or not replica.healthy:
            why = "not started" if replica is None else "out: " + (replica.note or replica.last_error or "not ready")
            return [row | {"error": why} for row in rows]
        pings = {}  # the later stages, asked at once (the page polls every second)
        for s in stages[1:]:
            try:
                pings[s.index] = ray.get_actor(stage_actor_name(replica.info.replica_id, s.index),
                                               namespace=NAMESPACE).ping.remote()
            except ValueError as exc:  # gone for good
                rows[s.index] |= {"healthy": False, "error": type(exc).__name__}
        if pings:
            ray.wait(list(pings.values()), num_returns=len(pings), timeout=1.0)
        for index, ref in pings.items():
            try:
                ray.get(ref, timeout=0)  # done, or GetTimeoutError
            except Exception as exc:  # noqa: BLE001 - down, restarting, or not answering in time
                rows[index] |= {"healthy": False, "error": type(exc).__name__}
        return rows

    async def _start(self) -> None:
        await self.client.start()
        if self.membership is not None:
            self.membership.start()

    def drain(self, node: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Take every replica on ``node`` out of rotation, let its requests (queued ones included)
        finish, then stop its actors; the node gets no replica again. The replicas drained."""
        if self.membership is None:
            raise RuntimeError("this deployment does not manage its machines (no membership)")
        future = asyncio.run_coroutine_threadsafe(self.membership.drain(node, timeout_s), self.server.loop)
        return future.result()

    def url(self) -> str:
        return self.server.url

    def describe(self) -> dict[str, Any]:
        """The deployment: model, replicas and listeners (for status, down and the client)."""
        c = self.config
        return {"model": c.model.name, "path": c.model.path, "models": [m.name for m, _ in c.groups],
                "url": self.server.url, "grpc_port": c.serving.grpc_port,
                "replicas": [r.info.__dict__ for client in self._clients for r in list(client.replicas.values())],
                "started": self.started,
                "pid": os.getpid(), "joined": list(self.membership.joined) if self.membership else [],
                "stages": [s.__dict__ for s in self.membership.stages] if self.membership else []}

    def replica_stats(self) -> dict[str, Any]:
        return self.client.stats()["replicas"]

    # -- the cluster API (Ray calls from drivers, jobs and Ray clients) -------------------------
    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """One completion for ``{"prompt": str | [ids]} | {"messages": [...]}`` plus sampling fields
        (max_tokens, temperature, top_p, top_k, min_p, seed, stop, ignore_eos, session_id).
        Errors come back as ``{"error": {"status", "message"}}`` so one bad line of a batch does
        not fail the others."""
        future = asyncio.run_coroutine_threadsafe(run_request(self.server.state, request), self.server.loop)
        return future.result()

    def stream(self, request: dict[str, Any]):
        """Like :meth:`generate`, as a Ray streaming generator of ``{"text", "token_ids"}`` deltas
        ending with the full result."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        future = asyncio.run_coroutine_threadsafe(run_request(self.server.state, request, chunks.put),
                                                  self.server.loop)
        future.add_done_callback(lambda _: chunks.put(None))
        while (delta := chunks.get()) is not None:
            yield delta
        yield future.result()

    def stop(self) -> None:
        self.server.stop()
