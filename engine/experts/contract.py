"""The expert subsystem's contract: what the model, the engine and the cluster may rely on.

- The model's MoE layers call an :class:`ExpertBackend` with global expert ids and the step's
  :class:`StepContext` (passed in, never kept as a mode).
- The engine starts each step with ``begin_step`` of the hierarchical backend, which returns that context.
- The cluster sees only :class:`ExpertControl`: statistics, the q table, new bandwidths, an idle
  probe, and attaching an external CPU worker.
- Inside, the policy (q* table, tuning, cache control: ``policy/``) plans each layer call as a
  :class:`FillPlan`, and the mechanism (devices, CPU workers, ring, shared memory, host pool:
  ``mechanism/``) carries it out through :class:`ExpertDevice` and :class:`CpuWorkers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch


@dataclass(frozen=True)
class StepContext:
    """What the experts are told about one engine step. ``mode``: ``stream`` (whole MoE layers go
    through the prefill buffers) or ``decode`` (per-call misses split by the q table);
    ``num_tokens`` this step's tokens; ``next_tokens`` how many the next step is expected to prefill
    (a streamed step prefetches the next one's first layers when it streams too)."""

    mode: Literal["stream", "decode"] = "decode"
    num_tokens: int = 0
    next_tokens: int = 0

    def __bool__(self) -> bool:
        return self.mode == "stream"



@dataclass
class FillPlan:
    """One layer call's cache decision. ``pair_slot[i]`` is the cache slot that serves routed pair i
    after the fills (-1: computed on the CPU). The first ``count`` entries of ``src``/``dst`` are the
    fills: global id ``src[j]`` is copied into slot ``dst[j]``."""

    pair_slot: torch.Tensor  # [N] int64
    src: torch.Tensor  # [K] int64 global ids (-1 past count)
    dst: torch.Tensor  # [K] int64 slots (-1 past count)
    count: torch.Tensor  # [] int64


@dataclass
class CpuTaskTiming:
    """What one CPU expert task cost: seconds in the kernel and expert bytes read."""

    seconds: float
    nbytes: int


class ExpertBackend(Protocol):
    """Computes the weighted sum of routed experts for a batch of tokens."""

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        expert_ids: torch.Tensor,  # [T, k] global ids g = layer * E + expert
        topk_weights: torch.Tensor,  # [T, k]
        step: StepContext | None = None,
    ) -> torch.Tensor:  # [T, H]
        ...

    def forward_static(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor,
                       layer: int) -> torch.Tensor:  # [T, H]
        """The same sum in a fixed-shape decode step (``engine/executor/fixed_shape.py``): no host reads and no
        data-dependent Python; every data-dependent part is a custom op (``engine/executor/graph_ops.py``),
        so the whole step compiles as one graph. ``layer`` is the MoE layer the ids belong to."""
        ...


class CopyHandle(Protocol):
    """A started copy of whole experts into slots."""

    nbytes: int
    copy_seconds: float

    def wait(self) -> float:
        """Block until the slots may be read; the seconds spent waiting."""
        ...


class ExpertDevice(Protocol):
    """Where cached experts live: the slot arena (``gate_up`` [S, 2I, H], ``down`` [S, H, I]) and the
    copy path from the host pool (a CUDA GPU, or the virtual device standing in for one)."""

    kind: str
    device: torch.device
    num_slots: int
    link_bytes_per_s: float | None  # a known link rate (the virtual device's limit), else None

    def fill(self, plan: FillPlan) -> int:
        """Copy the plan's fills into their slots; the bytes moved."""
        ...

    def compute(self, x: torch.Tensor, pair_slot: torch.Tensor, weights: torch.Tensor, act: Any,
                blocks: Any = None) -> torch.Tensor:
        """fp32 partial sum of the pairs served from slots (``pair_slot`` [T, k], -1 = elsewhere);
        ``blocks`` the layer's :class:`~hearth.engine.experts.pool.ExpertBlocks` for quantized slots."""
        ...

    def copy_async(self, rows: list[int], slots: list[int]) -> CopyHandle:
        """Start copying pool rows into slots after the work already queued; copies run in order."""
        ...

    def resize(self, num_slots: int, old_slots: torch.Tensor, new_slots: torch.Tensor, kept_ids: torch.Tensor) -> None:
        """Rebuild the arena with ``num_slots`` slots; the experts ``kept_ids`` move from
        ``old_slots`` to ``new_slots``. Called at a safe point (no step running)."""
        ...

    def fill_sources(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up bank, down bank, row table) that a fixed-shape step's fill copies from."""
        ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class CpuTask(Protocol):
    def result(self) -> tuple[torch.Tensor, CpuTaskTiming]:
        """The fp32 [T, H] partial sum and what it cost."""
        ...


class CpuWorkers(Protocol):
    """Computes the CPU share of a layer call straight from the host pool, in this thread, a bound
    thread, a worker process or someone else's worker (through the shared-memory ring)."""

    def submit(self, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, blocks: Any = None) -> CpuTask:
        """``x`` [T, H], pool ``rows`` [T, k] (-1: served elsewhere), routing ``weights`` [T, k];
        ``blocks`` the layer's block formats for a quantized pool."""
        ...

    def close(self) -> None: ...


class ExpertControl(Protocol):
    """All that the cluster (the executor and monitor actors) uses of the expert hierarchy; call it
    between engine steps."""

    def stats(self) -> dict[str, float]:
        """Cache counters, path timings and, when measured, the bandwidths behind the q table."""
        ...

    def qtable(self) -> list[int]:
        """Fills planned for m misses, m = 0..M."""
        ...

    def set_bandwidths(self, b_p: float, b_h: float) -> list[int]:
        """Rebuild the q table for new bandwidths (bytes/s) in place; returns it."""
        ...

    def probe(self, k: int, repeats: int = 3) -> tuple[float | None, float]:
        """A short measurement of both paths while idle: (B_P or None, B_H) in bytes/s."""
        ...

    def attach_ring(self) -> str | None:
        """The task ring an external CPU worker should serve (None: the CPU share runs in-house)."""
        ...

    def wait_attached(self, timeout_s: float = 60.0) -> int:
        """Block until an external worker serves the ring; its pid."""
        ...

    def resize(self, num_slots: int) -> dict[str, int]:
        """Give the device cache ``num_slots`` slots (elastic VRAM), keeping the most recently used
        experts that fit; running requests go on unchanged. Returns slots, bytes, kept, dropped."""
        ...
