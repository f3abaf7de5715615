"""The per-machine actors of a deployment (docs/design.md, the home cluster).

One group per replica, all pinned to the replica's node:

- :class:`HostPoolActor` owns the expert pool in named shared memory and outlives replica
  actor restarts. Killed, Ray recreates it and it reads the pool again from the FTW files.
- :class:`CpuWorkerActor` runs the CPU expert worker loop on the engine's task ring (shared
  memory), so per-layer work never crosses a Ray call.
- :class:`ReplicaActor` runs the replica's engine (the GPU executor of :mod:`hearth.engine` runs
  inside it). Restarted by Ray after a crash, it re-attaches to the pool by name instead of
  reading the experts again.
- :class:`MonitorActor` turns the engine's fill and CPU timings into live B_P/B_H estimates
  and pushes a new q table when they drift.

A replica split by layers runs its first stage in the replica actor and each later stage in a
:class:`~hearth.cluster.stage_actor.StageActor` on that stage's machine.

Actors only carry decisions out; placement and routing are pure functions elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

from hearth.cluster.bandwidth import BandwidthTracker, MonitorPolicy
from hearth.cluster.specs import NAMESPACE, ReplicaSpec
from hearth.config import cache_dir
from hearth.engine import LLMEngine
from hearth.engine.checkpoint import convert, is_ftw, load_checkpoint
from hearth.engine.experts import (
    HostExpertPool,
    TaskRing,
    bind_current_thread,
    cleanup_pool,
    list_pools,
    physical_cores,
    serve_ring,
)
from hearth.proto.contracts import GenerateRequest, GenerationChunk, StageLost
from hearth.serving.client import InProcessEngineClient

log = logging.getLogger("hearth.cluster")
STREAM_INTERVAL_S = 0.02  # a replica actor sends a stream's chunks at most this often (after the first)
STAGE_WAIT_S = 900.0  # how long a step waits for a restarting pipeline stage (it reads its layers again)


def _handle(name: str):
    return ray.get_actor(name, namespace=NAMESPACE)


def _wait_for_pool(spec: ReplicaSpec, timeout_s: float = 1800.0) -> dict[str, Any]:
    """The pool actor's info once its pool is filled. The pool may be restarting (it was killed with
    the replica actor, or reads the experts again): wait for it rather than fail, since a constructor
    that raises leaves the replica actor dead for good."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(_handle(spec.actor_name("pool")).info.remote())
        except (ray.exceptions.RayActorError, ValueError):  # restarting, or not created yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def ftw_path(model_path: str, cache: Path) -> Path:
    """The FTW directory for ``model_path``: itself when it is FTW, else a converted copy in the
    cache (made once per node; re-attaching a replica actor to a filled pool needs FTW)."""
    if is_ftw(model_path):
        return Path(model_path)
    src = Path(model_path).resolve()
    files = [src] if src.is_file() else [p for p in src.iterdir() if p.is_file()]  # a GGUF file, or a directory
    stamp = max((p.stat().st_mtime_ns for p in files), default=0)
    key = hashlib.blake2b(f"{src}\0{stamp}".encode(), digest_size=6).hexdigest()
    return cache / "ftw" / f"{src.name}-{key}"


class HostPoolActor:
    """Owns the replica's expert pool segment."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.loads = 0
        self.path = ftw_path(spec.model_path, cache_dir())
        if not is_ftw(self.path):
            started = time.perf_counter()
            tmp = self.path.with_name(self.path.name + f".tmp-{os.getpid()}")
            convert(spec.model_path, tmp)
            try:
                os.replace(tmp, self.path)
            except OSError:  # another replica on this machine converted it first
                if not is_ftw(self.path):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("converted %s to FTW in %.1f s", spec.model_path, time.perf_counter() - started)
        self.pool = None
        self._load()

    def _load(self) -> None:
        if cleanup_pool(self.spec.pool_name):  # left by this actor's previous life (killed): read it again
            log.warning("removed the stale expert pool '%s'; reading it again from %s", self.spec.pool_name, self.path)
        for stale in list_pools():  # pools of earlier deployments whose owner was killed (a node that left)
            if not stale["owner_alive"] and cleanup_pool(stale["name"]):
                log.warning("removed the expert pool '%s' of a process that is gone", stale["name"])
        started = time.perf_counter()

        def create(gate_up_shape, down_shape, dtype):
            self.pool = HostExpertPool.create(self.spec.pool_name, gate_up_shape, down_shape, dtype)
            return self.pool.tensors

        dtype = self.spec.engine.dtype
        load_checkpoint(self.path, None if dtype == "auto" else dtype, create)
        self.pool.mark_filled()
        self.loads += 1
        self.load_seconds = time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        return {"pool_name": self.pool.name, "bytes": self.pool.meta["bytes"], "loads": self.loads,
                "load_seconds": self.load_seconds, "path": str(self.path), "pid": os.getpid()}

    def close(self) -> None:
        """Remove the segment (the replica actor must be gone first; its mapping would keep the pages)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class CpuWorkerActor:
    """Serves CPU expert tasks from a replica's ring. On a restart it asks the replica actor for its
    ring and serves it again."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.served = 0
        self._rings: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._reattach, daemon=True).start()

    def _reattach(self) -> None:
        try:
            ring = ray.get(_handle(self.spec.actor_name("replica")).ring.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - no replica actor yet (first start): it will call serve()
            return
        if ring is not None:
            self.serve(*ring)

    def serve(self, pool_name: str, ring_name: str, owner_pid: int) -> int:
        """Serve ``ring_name`` until the replica actor closes it or dies; returns the tasks done."""
        with self._lock:
            if ring_name in self._rings:
                return 0  # already served by another call
            self._rings.add(ring_name)
        cores = physical_cores()
        bind_current_thread(cores)
        torch.set_num_threads(self.spec.engine.threads or len(cores))
        pool = HostExpertPool.attach(pool_name)
        ring = TaskRing.attach(ring_name)
        ring.words[1] = os.getpid()
        try:
            done = serve_ring(pool, ring, parent_pid=owner_pid)
            self.served += done
            return done
        finally:
            ring.close()
            pool.close()
            with self._lock:
                self._rings.discard(ring_name)

    def ping(self) -> int:
        return os.getpid()


class StageResult:
    """The later stages' logits for one (micro-)batch, once asked for; times the wait. A stage that
    failed (died, restarted, raised) turns into :class:`StageLost`."""

    def __init__(self, ref: Any, replica: ReplicaActor) -> None:
        self.ref, self.replica, self.sent = ref, replica, time.perf_counter()

    def result(self):
        try:
            logits = ray.get(self.ref)
        except ray.exceptions.RayError as exc:
            raise self.replica._lost(exc) from None
        hops = self.replica.hops
        hops[0] += 1
        hops[1] += time.perf_counter() - self.sent
        return logits


class ReplicaActor:
    """Runs the engine of one replica (an async actor: requests stream back as Ray generators)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        started = time.perf_counter()
        # A pipeline stage loads its own layers from the checkpoint (no shared pool of all experts).
        pool = {"path": spec.model_path} if spec.staged else _wait_for_pool(spec)
        self.pool_wait_seconds = time.perf_counter() - started
        self.started = time.perf_counter()
        self.model_path = pool["path"]
        self.hops = [0, 0.0]  # calls to the later stages, seconds in them (the hop included)
        self.stages_lost = 0  # steps that lost a later stage (its requests were ended)
        self._stage_ids: dict[str, str] | None = None  # each later stage's instance, as last seen
        torch.set_num_threads(spec.engine.threads or len(physical_cores()))
        self.load_seconds = 0.0
        self.attached_pool = False
        self.bandwidth_updates = 0  # q tables pushed by the monitor
        self.client = InProcessEngineClient(self.model_path, self._build_engine, spec.model_name, spec.max_waiting)

    def _build_engine(self):
        if self.spec.staged:
            engine = LLMEngine(self.model_path, self.spec.engine, layers=self.spec.layers,
                               next_stage=self._next_stages if self.spec.next_stages else None)
            engine.runner.micro_batches = len(self.spec.next_stages) + 1  # one per stage: all busy at once
            self.load_seconds = time.perf_counter() - self.started
            return engine
        engine = LLMEngine(self.model_path, self.spec.engine)
        self.attached_pool = engine.host_pool is not None and not engine.host_pool.owner
        control = engine.expert_control
        ring = control.attach_ring() if control is not None else None
        if ring is not None:
            _handle(self.spec.actor_name("cpu")).serve.remote(self.spec.pool_name, ring, os.getpid())
            control.wait_attached()
        self.load_seconds = time.perf_counter() - self.started
        return engine

    def _next_stages(self, batch, hidden) -> StageResult:
        """Send a (micro-)batch through the later stages, chained by reference so that each starts
        as soon as the one before is done; its logits come from ``result()``."""
        ids = self._stage_instances()
        # Over Ray as host tensors (a GPU stage's batch and hidden states would not load on a CPU
        # machine), without the masks the layers cached on the batch.
        batch, ref = batch.moved("cpu"), hidden.cpu()
        try:
            for name in self.spec.next_stages:
                ref = _handle(name).forward.remote(batch, ref, ids[name])
        except ValueError as exc:  # a stage that is gone for good (its machine left) has no handle
            raise self._lost(exc) from None
        return StageResult(ref, self)

    def _stage_instances(self) -> dict[str, str]:
        """Each later stage's instance id, asked for again after a loss: a stage that Ray restarted
        is a new instance with an empty KV cache, and refuses a step meant for the old one."""
        deadline = time.monotonic() + STAGE_WAIT_S
        while self._stage_ids is None:
            try:
                pings = ray.get([_handle(n).ping.remote() for n in self.spec.next_stages],
                                timeout=max(deadline - time.monotonic(), 1.0))
            except ray.exceptions.ActorUnavailableError as exc:  # restarting: wait for it
                if time.monotonic() > deadline:
                    raise self._lost(exc) from None
                time.sleep(0.5)
                continue
            except Exception as exc:  # noqa: BLE001 - dead for good, or not back in time
                raise self._lost(exc) from None
            self._stage_ids = {n: p["instance"] for n, p in zip(self.spec.next_stages, pings, strict=True)}
        return self._stage_ids

    def _lost(self, exc: BaseException) -> StageLost:
        """The error every request of a step that lost a later stage ends with."""
        self._stage_ids = None
        self.stages_lost += 1
        cause = getattr(exc, "cause", None)
        why = str(cause) if isinstance(cause, StageLost) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return StageLost(f"a pipeline stage of replica {self.spec.replica_id} was lost during this request ({why}); "
                         "the request was ended and can be retried: the stage restarts on its machine while that "
                         "machine is up, and the deployment plans the stages again when it is not")

    async def ready(self) -> dict[str, Any]:
        """Waits until the model is loaded (re-raises a load failure); what the router needs."""
        await asyncio.to_thread(self.client.wait_ready)
        model = self.client.model
        return {"replica_id": self.spec.replica_id, "max_model_len": model.max_model_len,
                "vocab_size": model.vocab_size, "load_seconds": self.load_seconds,
                "attached_pool": self.attached_pool, "pid": os.getpid(), "path": self.model_path,
                "pool_wait_seconds": self.pool_wait_seconds}

    async def generate(self, request: GenerateRequest):
        """Stream the request's chunks (a Ray streaming generator). A Ray message costs about a
        millisecond of CPU on each side, so after the first chunk (sent at once: TTFT) the chunks
        that arrive within ``STREAM_INTERVAL_S`` of the last send go out merged. A model slower
        than that still gets one message per token."""
        pending: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def pump() -> None:
            try:
                async for chunk in self.client.generate(request):
                    pending.put_nowait(chunk)
            except Exception as exc:  # noqa: BLE001 - re-raised to the caller below
                pending.put_nowait(exc)

        task = asyncio.ensure_future(pump())
        last_sent = None
        try:
            while True:
                items = [await pending.get()]
                hold = 0.0 if last_sent is None else last_sent + STREAM_INTERVAL_S - loop.time()
                if hold > 0 and isinstance(items[0], GenerationChunk) and not items[0].finished:
                    await asyncio.sleep(hold)
                while not pending.empty():
                    items.append(pending.get_nowait())
                chunks = [c for c in items if isinstance(c, GenerationChunk)]
                if chunks:
                    yield GenerationChunk.merge(chunks)
                    last_sent = loop.time()
                    if chunks[-1].finished:
                        return
                if len(chunks) < len(items):
                    raise next(c for c in items if isinstance(c, Exception))
        finally:
            task.cancel()  # the caller left: the engine client aborts the request

    def stats(self) -> dict[str, Any]:
        out = dict(self.client.stats(), ready=self.client.ready, pid=os.getpid(), load_seconds=self.load_seconds,
                   attached_pool=self.attached_pool, bandwidth_updates=self.bandwidth_updates)
        if self.spec.next_stages:
            out["stage_calls"], out["stage_seconds"] = self.hops
            out["stages_lost"] = self.stages_lost
        return out

    def ring(self) -> tuple[str, str, int] | None:
        """(pool, ring, owner pid) for a restarted CPU-worker actor, or None."""
        engine = self.client.engine
        ring = engine.expert_control.attach_ring() if engine is not None and engine.expert_control else None
        return (self.spec.pool_name, ring, os.getpid()) if ring is not None else None

    async def set_bandwidths(self, b_p: float, b_h: float) -> list[int]:
        """Rebuild the q table for new bandwidths at the next step boundary; returns it."""
        table = await asyncio.wrap_future(self.client.call(lambda e: e.expert_control.set_bandwidths(b_p, b_h)))
        self.bandwidth_updates += 1
        log.info("%s: new bandwidths B_P %.2f GB/s, B_H %.2f GB/s; q table %s", self.spec.replica_id, b_p / 1e9,
                 b_h / 1e9, table)
        return table

    async def resize_expert_cache(self, size: str) -> dict[str, int]:
        """Resize the device expert cache at the next step boundary (elastic VRAM); the report."""
        report = (await self.client.resize_expert_cache(size))["local"]  # the client keeps its watcher in step
        log.info("%s: expert cache resized to %d slots (%d kept, %d dropped)", self.spec.replica_id,
                 report["slots"], report["kept"], report["dropped"])
        return report

    async def probe(self) -> tuple[float | None, float] | None:
        """Measure both paths briefly if the engine is idle (None when busy)."""

        def run(engine):
            if engine.has_unfinished():
                return None
            return engine.expert_control.probe(k=engine.model_config.top_k)

        return await asyncio.wrap_future(self.client.call(run))

    async def prefix_summary(self) -> dict[str, Any] | None:
        """The engine's cached prefixes as block hashes (see ``LLMEngine.prefix_summary``), read at a
        step boundary; what the router routes by."""
        return await asyncio.wrap_future(self.client.call(lambda engine: engine.prefix_summary()))

    async def shutdown(self) -> None:
        """Stop the engine (aborting what runs) and release its ring and pool mapping."""
        await asyncio.to_thread(self.client.close)

    def ping(self) -> int:
        return os.getpid()


class MonitorActor:
    """Polls the replica's expert timings and pushes new bandwidths when they drift."""

    def __init__(self, spec: ReplicaSpec, policy: MonitorPolicy | None = None) -> None:
        self.spec = spec
        self.policy = policy or MonitorPolicy()
        self.tracker: BandwidthTracker | None = None
        self.history: list[dict[str, Any]] = []
        self.qtable: list[int] | None = None
        self._engine_pid: int | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="hearth-monitor").start()

    def _run(self) -> None:
        # When each path last did work: a path the table stopped using (all CPU after one slow
        # reading of the link, say) is never measured again unless it is probed.
        moved_at, last_calls = [time.monotonic()] * 2, None
        while not self._stop.wait(self.spec.monitor_interval_s):
            try:
                replica = _handle(self.spec.actor_name("replica"))
                stats = ray.get(replica.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - replica actor restarting or gone: try again later
                continue
            experts = stats.get("experts")
            if not stats.get("ready") or experts is None or "b_p" not in experts:
                continue  # no hierarchy (CPU executor) or a forced q table: nothing to tune
            if self.tracker is None or stats.get("pid") != self._engine_pid:  # (re)started replica actor
                self.tracker = BandwidthTracker(experts["b_p"], experts["b_h"], self.policy)
                self._engine_pid = stats.get("pid")
            self.qtable = experts.get("qtable", self.qtable)
            change = self.tracker.observe(experts)
            calls, now = (experts["fill_calls"], experts["cpu_calls"]), time.monotonic()
            moved_at = [now if last_calls is None or c != last else at
                        for c, last, at in zip(calls, last_calls or calls, moved_at, strict=True)]
            last_calls = calls
            if now - min(moved_at) > self.spec.probe_idle_s:  # a path (or both) unused for a while
                probed = self._call(replica.probe.remote())  # None while requests run: retried next time
                if probed:
                    moved_at = [now] * 2
                    change = self.tracker.add_probe(*probed) or change
            if change is not None:
                table = self._call(replica.set_bandwidths.remote(change.b_p, change.b_h))
                if table is not None:
                    self.qtable = table
                    self.history = (self.history + [{"time": time.time(), "b_p": change.b_p, "b_h": change.b_h,
                                                     "qtable": table}])[-20:]
                    log.info("%s: %s; new q table %s", self.spec.replica_id, change.describe(), table)

    @staticmethod
    def _call(ref) -> Any:
        try:
            return ray.get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - the replica actor went away meanwhile
            return None

    def status(self) -> dict[str, Any]:
        est = self.tracker.estimate() if self.tracker is not None else (None, None)
        return {"b_p": est[0], "b_h": est[1], "changes": self.tracker.changes if self.tracker else 0,
                "qtable": self.qtable, "history": self.history[-5:], "pid": os.getpid()}

    def stop(self) -> None:
        self._stop.set()
