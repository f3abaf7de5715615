"""The expert backend of the hierarchy: hits and fills on the device, the CPU set on CPU workers.

Per MoE layer call (docs/design.md, a decode layer call): the cache-control step classifies the
routed ids and plans fills by ``qtable``; the CPU workers start on the pairs left to them while the
device fills its slots and computes the rest; the two fp32 partial sums are added. Results equal the plain backend
up to fp32 summation order at every cache size and split.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace

import torch

from hearth.engine.experts.compute import routed_experts_node
from hearth.engine.experts.contract import CpuWorkers, ExpertDevice, StepContext
from hearth.engine.experts.measure import _fit, _median_time, link_fill, measure_host_path
from hearth.engine.experts.mechanism.device import pin_host_memory
from hearth.engine.experts.mechanism.ring import ExternalCpuWorkers, RingCpuWorkers, TaskRing
from hearth.engine.experts.mechanism.streamer import LayerStreamer
from hearth.engine.experts.policy.cache import ExpertCacheTables
from hearth.engine.experts.policy.qstar import PathCost, SplitCosts, build_qtable
from hearth.engine.experts.policy.tuning import CreditTuner
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.kernels.gpu import device_fill, device_ring

log = logging.getLogger(__name__)

# Layer calls of at most this many tokens are decode steps for the fill-credit tuner; longer ones
# are prefill chunks, whose time says nothing about the split.
TUNED_CALL_MAX_TOKENS = 64


@dataclass
class PathTimes:
    """Host-side accumulators (seconds, bytes) of the hierarchy's paths."""

    fill_seconds: float = 0.0
    fill_bytes: int = 0
    fill_calls: int = 0  # layer calls that filled at least one expert
    device_seconds: float = 0.0
    cpu_seconds: float = 0.0
    cpu_bytes: int = 0
    cpu_calls: int = 0  # layer calls that ran at least one expert on the CPU
    layer_calls: int = 0


def map_ring_slot(ring: TaskRing, device) -> dict[str, torch.Tensor] | None:
    """Slot 0 of ``ring`` as device views of its registered pages (None where that cannot be: the
    CPU share then goes through the host)."""
    if not device_fill.available():
        return None
    try:
        whole = torch.frombuffer(ring.segment.buf, dtype=torch.uint8)
        device.track_registration(pin_host_memory([whole]))  # unregistered when the device closes
        return {name: device_fill.mapped_view(t, device.device) for name, t in ring.slots[0].items()}
    except RuntimeError as exc:
        log.warning("the CPU expert ring cannot be mapped for the GPU (%s): CPU shares go through the host", exc)
        return None


class HierarchicalExpertBackend:
    """The expert hierarchy: an :class:`~hearth.engine.experts.contract.ExpertBackend` over a device
    expert cache and CPU workers, and the :class:`~hearth.engine.experts.contract.ExpertControl` the
    cluster drives."""

    def __init__(self, pool: ExpertPool, act, device: ExpertDevice, tables: ExpertCacheTables, cpu_workers: CpuWorkers,
                 costs: SplitCosts | None = None, tuner: CreditTuner | None = None) -> None:
        self.pool = pool
        self.costs = costs  # the path costs behind the q table; None for a forced table
        self.tuner = tuner if costs is not None else None  # picks the table's fill credit online
        self.streamer: LayerStreamer | None = None  # prefill streaming, when the slots hold its buffers
        self.stream_min_tokens = 0
        self.stream_threshold = None  # costs -> stream_min_tokens, when it follows the measured costs
        self.stream_setup = None  # (backend, slots) -> sets up streaming for a slot count (build.py)
        self.prefill_stats = None  # the streamers' counters, kept while a small cache turns streaming off
        # Off when fixed-shape steps feed the tuner whole steps (observe_step): one kind of timing per epoch.
        self.tune_layer_calls = True
        # How B_P is measured (experts/measure.py LINK_PATHS): the path the decode steps fill by.
        self.link_path = "copy"
        # On a GPU with CPU workers behind the task ring: slot 0's fields as device views, so the GPU
        # posts and collects the CPU share itself (kernels/gpu/device_ring.py); None elsewhere.
        self.device_ring = None
        if device.kind == "cuda" and isinstance(cpu_workers, RingCpuWorkers):
            self.device_ring = map_ring_slot(cpu_workers.ring, device)
        self.act = act
        self.device = device
        self.tables = tables
        self.cpu_workers = cpu_workers
        self.times = PathTimes()
        self.routing_log: list[tuple[int, list[list[int]]]] | None = None  # (layer, ids per token) when recording

    def begin_step(self, num_tokens: int, next_tokens: int = 0) -> StepContext:
        """Called by the engine before each step; returns the context its MoE layers pass to
        :meth:`forward`. A step of at least ``stream_min_tokens`` tokens streams whole layers (the
        first layers' copies start now; when ``next_tokens``, the expected size of the next step,
        streams too, its first layers are prefetched during this one); any other step takes the
        decode path and the buffers go back to the cache. The context is truthy when it streams."""
        streams = self.streamer is not None and num_tokens >= self.stream_min_tokens
        if streams:
            self.streamer.begin(next_tokens >= self.stream_min_tokens)
        elif self.streamer is not None:
            self.streamer.release()
        return StepContext("stream" if streams else "decode", num_tokens, next_tokens)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor,
                step: StepContext | None = None) -> torch.Tensor:
        t, k = expert_ids.shape
        call_start = time.perf_counter()
        if self.routing_log is not None:
            self.routing_log.append((int(expert_ids[0, 0]) // self.pool.num_experts, expert_ids.tolist()))
        blocks = self.pool.blocks_of_ids(expert_ids)  # the layer's block formats (None: float experts)
        if step is not None and step.mode == "stream":
            out = self.streamer.forward(x, expert_ids, topk_weights, self.act, blocks)
            return out.to(device=x.device, dtype=x.dtype)
        plan = self.tables.step(expert_ids.reshape(-1).to(self.tables.device))
        pair_slot = plan.pair_slot.view(t, k)
        on_cpu = (pair_slot < 0).cpu()
        n_cpu = int(on_cpu.sum())
        # The CPU share is submitted first (a worker thread or process starts at once; inline work
        # waits until the device work below has been launched), then fills and device compute.
        task = None
        if n_cpu:  # the CPU share reads host copies (a no-op when the model itself runs on the CPU)
            rows = torch.where(on_cpu, self.pool.row_table[expert_ids.cpu()], -1)
            task = self.cpu_workers.submit(x.cpu(), rows, topk_weights.cpu(), blocks)
        start = time.perf_counter()
        filled_bytes = self.device.fill(plan)
        filled = time.perf_counter()
        if filled_bytes:
            self.times.fill_bytes += filled_bytes
            self.times.fill_calls += 1
        out = None
        if n_cpu < t * k:
            out = self.device.compute(x, pair_slot, topk_weights, self.act, blocks)
        self.times.fill_seconds += filled - start
        self.times.device_seconds += time.perf_counter() - filled
        if task is not None:
            cpu_part, timing = task.result()
            out = cpu_part if out is None else out + cpu_part.to(out.device)  # a + b == b + a exactly
            self.times.cpu_seconds += timing.seconds
            self.times.cpu_bytes += timing.nbytes
            self.times.cpu_calls += 1
        self.times.layer_calls += 1
        out = out.to(device=x.device, dtype=x.dtype)
        # Wall time of the whole call: on CUDA the plan read above waits for the device, so the sum
        # over calls covers the device work too without an extra synchronisation.
        if self.tuner is not None and self.tune_layer_calls and t <= TUNED_CALL_MAX_TOKENS \
                and self.tuner.observe(time.perf_counter() - call_start):
            self._rebuild_qtable()
        return out

    def forward_static(self, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor,
                       layer: int) -> torch.Tensor:
        """One MoE layer of a fixed-shape decode step: the control step, the CPU share posted, the
        fills (their count read inside the copy op), the device share and the collect, all custom
        ops, with no host reads between them on the CPU, so the step compiles whole
        (``engine/executor/fixed_shape.py``). The CPU share goes out right after the control step (it needs
        only the pairs' slots), so the workers compute it while the device fills and computes: a
        layer costs max(fill + device, CPU), the overlap the q table's split assumes. The same
        arithmetic as :meth:`forward`; the path timers are not fed, and the credit tuner gets whole
        steps (:meth:`observe_step`)."""
        t, k = expert_ids.shape
        tables, device = self.tables, self.device
        flat = expert_ids.reshape(-1).to(tables.device)
        fills = None
        if tables.num_slots == 0 or tables.num_candidates == 0:
            pair_slot = tables.step(flat).pair_slot  # counted with tensor operations: no host read
        else:
            pair_slot, src, dst, count = torch.ops.hearth.cache_step(
                flat, tables.slot_of, tables.expert_of, tables.last_used, tables.clock, tables.qtable, tables.stats,
                tables.num_candidates)
            fills = (src, dst, count)
        pair_slot = pair_slot.view(t, k)
        slot, x_host, cpu_rows, weights_host = self._cpu_share(x, expert_ids, pair_slot, topk_weights)
        if slot is not None:  # CPU workers elsewhere: they compute from now on
            ticket = torch.ops.hearth.ring_post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x_host,
                                                cpu_rows, weights_host)
        if fills is not None:
            gate_up_src, down_src, rows_of = device.fill_sources()  # on a GPU: the mapped pool, read in place
            torch.ops.hearth.fill_slots(device.gate_up, device.down, gate_up_src, down_src, rows_of, *fills)
        blocks = self.pool.layer_blocks(layer)
        on_device = routed_experts_node(x.to(device.device), device.gate_up, device.down, pair_slot,
                                        topk_weights.to(device.device), self.act, blocks)
        if slot is not None:
            on_cpu = torch.ops.hearth.ring_collect(ticket, slot["ctrl"], slot["out"], t, x.shape[1],
                                                   self.cpu_workers.timeout_s)
        else:
            on_cpu = routed_experts_node(x_host, self.pool.gate_up, self.pool.down, cpu_rows, weights_host, self.act,
                                         blocks)
        return (on_device.to(x.device) + on_cpu.to(x.device)).to(x.dtype)

    def _cpu_share(self, x: torch.Tensor, expert_ids: torch.Tensor, pair_slot: torch.Tensor,
                   topk_weights: torch.Tensor) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
        """(ring slot, x, pool rows [T, k] (-1: served from a slot), weights) of a static step's CPU
        share. With the ring mapped for the GPU, the GPU writes the task and waits for it itself,
        from its own tensors; otherwise the share reads host copies (no-ops when the model runs on
        the CPU) and goes through the ring's slot 0 (one share in flight at a time: collected before
        the next layer posts), or stays here without a ring (slot None)."""
        if self.device_ring is not None:
            rows_of = self.device.fill_sources()[2]
            cpu_rows = torch.where(pair_slot < 0, rows_of[expert_ids.to(rows_of.device)], -1)
            return self.device_ring, x, cpu_rows, topk_weights
        host = self.pool.row_table.device
        cpu_rows = torch.where(pair_slot.to(host) < 0, self.pool.row_table[expert_ids.to(host)], -1)
        slot = self.cpu_workers.ring.slots[0] if isinstance(self.cpu_workers, RingCpuWorkers) else None
        return slot, x.to(host), cpu_rows, topk_weights.to(host)

    def check_static_step(self) -> None:
        """After a fixed-shape step on a GPU: raise what its ring collects left behind (a worker
        that failed or did not answer; the host reads the ring's error word, not the GPU)."""
        if self.device_ring is not None:
            self.device.synchronize()  # the step's collects have run (the sampler waits for it anyway)
            device_ring.raise_if_failed(self.cpu_workers.ring.slots[0]["ctrl"])

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        """A fixed-shape step's wall time, for the fill-credit tuner: its layer calls are not timed
        one by one, so the step counts as that many calls of equal cost. A credit change rewrites
        the q table in place, which the next (compiled) step reads."""
        calls = len(self.pool.moe_layer_ids)
        self.times.layer_calls += calls
        if self.tuner is not None and num_tokens <= TUNED_CALL_MAX_TOKENS and self.tuner.observe(seconds, calls):
            self._rebuild_qtable()

    @property
    def credit(self) -> float:
        """The fill credit behind the current q table (units of S / B_H; 0 = per-step optimum)."""
        return self.tuner.credit if self.tuner is not None else 0.0

    def _rebuild_qtable(self) -> None:
        m_max = self.tables.qtable.shape[0] - 1
        self.tables.set_qtable(build_qtable(self.costs, m_max, self.tables.device, self.credit))

    def stats(self) -> dict[str, float]:
        """Counters of the cache (hits, misses, fills, CPU experts, evictions), path timings, the
        bandwidths and the q table."""
        out: dict[str, float] = dict(self.tables.read_stats())
        out.update(asdict(self.times))
        out["slots"] = self.tables.num_slots
        out["hit_rate"] = out["hits"] / max(out["hits"] + out["misses"], 1)
        out["cpu_bytes_per_s"] = self.times.cpu_bytes / self.times.cpu_seconds if self.times.cpu_seconds else 0.0
        if self.costs is not None:
            out["b_p"], out["b_h"] = self.bandwidths
            out["link_fixed_s"], out["cpu_fixed_s"] = self.costs.link.fixed_s, self.costs.cpu_fixed_s
            out["fill_credit"] = self.credit
            out["credit_moves"] = self.tuner.moves if self.tuner is not None else 0
        out["expert_bytes"] = self.pool.expert_bytes
        out["qtable"] = self.qtable()
        if self.streamer is not None:
            out.update(self.streamer.stats.summary())
            out["prefill_buffers"] = self.streamer.buffers
            out["prefill_stream_min_tokens"] = self.stream_min_tokens
        return out

    def prefill_layers(self) -> list[dict[str, float]]:
        """Per MoE layer: streamed calls, copy, wait (exposed copy) and compute seconds."""
        return self.streamer.stats.per_layer() if self.streamer is not None else []

    @property
    def bandwidths(self) -> tuple[float, float] | None:
        """(B_P, B_H) in bytes/s behind the current q table; None for a forced table."""
        if self.costs is None:
            return None
        return self.costs.link.bytes_per_s, self.costs.host_bytes_per_s

    def set_bandwidths(self, b_p: float, b_h: float) -> list[int]:
        """Rebuild the q table for new bandwidths (fixed costs kept) and write it into the device
        table in place. Call between steps. A forced table (q mode zero/all) is left as it is."""
        if self.costs is None:
            return self.qtable()
        self.costs = replace(self.costs, link=PathCost(b_p, self.costs.link.fixed_s), host_bytes_per_s=b_h)
        self._rebuild_qtable()
        if self.stream_threshold is not None:
            self.stream_min_tokens = self.stream_threshold(self.costs)
        return self.qtable()

    def probe(self, k: int, repeats: int = 3) -> tuple[float | None, float]:
        """A short measurement of both paths while idle: (B_P, B_H) bytes/s, B_P None when the cache
        holds nothing yet. The link probe re-fills resident slots with the experts they already
        hold, so the cache contents never change."""
        b_h = measure_host_path(self.pool, self.act, k, repeats).bytes_per_s
        resident = self.tables.resident()
        if not resident:
            return None, b_h
        ids = list(resident)[: max(k, 2)]

        def median_fill(n: int) -> float:  # through the path the start-up measurement took
            src = torch.tensor(ids[:n], dtype=torch.long)
            dst = torch.tensor([resident[g] for g in ids[:n]], dtype=torch.long)
            return _median_time(link_fill(self.device, src, dst, self.link_path), repeats)

        if len(ids) == 1:
            return self.pool.expert_bytes / median_fill(1), b_h
        # Affine in the number of experts, like the start-up profile: the slope is the bandwidth.
        return _fit(1, median_fill(1), len(ids), median_fill(len(ids)), self.pool.expert_bytes).bytes_per_s, b_h

    def qtable(self) -> list[int]:
        """The current q table: fills planned for ``m`` misses, m = 0..M."""
        return self.tables.qtable.tolist()

    def attach_ring(self) -> str | None:
        """The task ring an external CPU worker should serve; None when the CPU share runs here
        (inline, a thread, or a worker process this backend started)."""
        return self.cpu_workers.ring_name if isinstance(self.cpu_workers, ExternalCpuWorkers) else None

    def wait_attached(self, timeout_s: float = 60.0) -> int:
        """Block until an external worker serves the ring; its pid."""
        if not isinstance(self.cpu_workers, ExternalCpuWorkers):
            raise RuntimeError("the CPU experts of this engine run in-house: there is no ring to attach to")
        return self.cpu_workers.wait_attached(timeout_s)

    def resize(self, num_slots: int) -> dict[str, int]:
        """Elastic VRAM: give the device cache ``num_slots`` slots (at most one per expert). Call
        between steps. The most recently used experts that fit stay cached and move within the
        device; the rest are dropped (the host pool holds every expert, so nothing is lost). Requests
        in flight go on with the same results; prefill streaming follows the new size."""
        if num_slots < 0:
            raise ValueError(f"an expert cache cannot have {num_slots} slots")
        num_slots = min(num_slots, self.pool.gate_up.shape[0])
        if self.streamer is not None:
            self.streamer.release()  # what its buffers hold becomes cache entries first
        before = int((self.tables.expert_of[: self.tables.num_slots] >= 0).sum())
        plan = self.tables.plan_resize(num_slots)
        try:  # the device first: when it fails, the tables still describe what it holds
            self.device.resize(num_slots, *plan, self.tables.expert_of[plan[0]])
        except Exception:
            if self.device.num_slots == 0:  # it gave up its arena: the cache is empty now, and says so
                self.tables.resize(0)
                if self.stream_setup is not None:
                    self.stream_setup(self, 0)
            raise
        old_slots, new_slots = self.tables.resize(num_slots, plan)
        if self.stream_setup is not None:
            self.stream_setup(self, num_slots)
        kept = int(new_slots.numel())
        return {"slots": num_slots, "bytes": num_slots * self.pool.expert_bytes, "kept": kept,
                "dropped": before - kept}

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.release()
        self.cpu_workers.close()
        self.device.close()
