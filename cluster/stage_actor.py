"""The later stages of a replica split by layers (pipeline stages): the actor each later stage runs
in, and the handle the first stage (the replica's executor) waits on for a (micro-)batch's logits.
See docs/cluster.md, pipeline stages."""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray

from hearth.proto.contracts import StageLost

if TYPE_CHECKING:
    from hearth.cluster.actors import ExecutorActor, ReplicaSpec


class StageResult:
    """The later stages' logits for one (micro-)batch, once asked for; times the wait. A stage that
    failed (died, restarted, raised) turns into :class:`StageLost`."""

    def __init__(self, ref: Any, executor: ExecutorActor) -> None:
        self.ref, self.executor, self.sent = ref, executor, time.perf_counter()

    def result(self):
        try:
            logits = ray.get(self.ref)
        except ray.exceptions.RayError as exc:
            raise self.executor._lost(exc) from None
        hops = self.executor.hops
        hops[0] += 1
        hops[1] += time.perf_counter() - self.sent
        return logits


class StageActor:
    """A later pipeline stage of a replica: its layers, their experts and KV cache, on its machine;
    the first stage (the replica's executor) calls :meth:`forward` once per step."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from hearth.engine.experts.mechanism.cpu_workers import physical_cores
        from hearth.engine.llm_engine import LLMEngine

        self.threads = spec.engine.threads or len(physical_cores())
        torch.set_num_threads(self.threads)
        started = time.perf_counter()
        self.spec = spec
        self.engine = LLMEngine(spec.model_path, spec.engine, layers=spec.layers)
        self.load_seconds = time.perf_counter() - started
        self.instance = uuid.uuid4().hex  # a restart is a new instance: its KV cache starts empty

    def forward(self, batch, hidden, instance: str):
        """This stage's layers over the first stage's batch and the previous stage's hidden states;
        refused when meant for an earlier instance of this stage (whose KV cache died with it)."""
        import torch

        if instance != self.instance:
            first, end = self.spec.layers
            raise StageLost(f"stage {self.spec.replica_id} (layers {first}-{end - 1}) restarted and lost its KV cache")
        if torch.get_num_threads() != self.threads:  # OpenMP's thread count is per thread: Ray's may differ
            torch.set_num_threads(self.threads)
        return self.engine.stage_forward(batch, hidden).cpu()  # host tensors for the next machine

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "layers": self.spec.layers, "load_seconds": self.load_seconds,
                "instance": self.instance}

    def stats(self) -> dict[str, Any]:
        """The stage engine's statistics (its KV occupancy, memory, expert hierarchy counters)."""
        return self.engine.stats()
