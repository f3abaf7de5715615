"""The actor each later stage of a replica split by layers (pipeline stages) runs in; the first
stage is the replica actor, which calls it once per step (see
:class:`~hearth.cluster.actors.StageResult`). See docs/cluster.md, pipeline stages."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch

from hearth.cluster.specs import ReplicaSpec
from hearth.engine import LLMEngine
from hearth.engine.experts import physical_cores
from hearth.proto.contracts import StageLost


class StageActor:
    """A later pipeline stage of a replica: its layers, their experts and KV cache, on its machine;
    the first stage (the replica actor) calls :meth:`forward` once per step."""

    def __init__(self, spec: ReplicaSpec) -> None:
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
