"""Where cached experts live and how they get there: a CUDA device, or the *virtual device*.

A device owns the slot arena (``gate_up`` [S, 2I, H], ``down`` [S, H, I]) that the cache tables
index, carries out a step's fill plan (host pool -> slots, one batched copy) and computes the
routed pairs served from slots. The virtual device is a separate CPU arena with a byte budget and an
optionally rate-limited copy path, so the whole hierarchy runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hearth.engine.experts.compute import routed_partial_sum
from hearth.engine.experts.contract import FillPlan
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.kernels.gpu import device_fill

log = logging.getLogger(__name__)
# Experts moved per copy when an arena is resized.
_MOVE_CHUNK = 64


class VirtualDevice:
    """A CPU arena of ``num_slots`` expert slots; fills are memcpys, optionally slowed to
    ``link_bytes_per_s`` to stand in for a PCIe link."""

    kind = "virtual"

    def __init__(self, pool: ExpertPool, num_slots: int, link_bytes_per_s: float | None = None) -> None:
        self.device = torch.device("cpu")
        self.pool = pool
        self.num_slots = num_slots
        self.link_bytes_per_s = link_bytes_per_s
        self.gate_up = torch.empty((num_slots, *pool.gate_up.shape[1:]), dtype=pool.gate_up.dtype)
        self.down = torch.empty((num_slots, *pool.down.shape[1:]), dtype=pool.down.dtype)
        self._copier: ThreadPoolExecutor | None = None  # started with the first asynchronous copy

    def fill(self, plan: FillPlan) -> int:
        """Copy the plan's fills into their slots; returns the bytes moved."""
        count = int(plan.count)  # a host tensor here: no device synchronisation involved
        if count == 0:
            return 0
        start = time.perf_counter()
        copy_experts((self.gate_up, self.down), plan.dst[:count], (self.pool.gate_up, self.pool.down),
                     self.pool.row_table[plan.src[:count]])
        nbytes = count * self.pool.expert_bytes
        self._wait_out_link(nbytes, start)
        return nbytes

    def _wait_out_link(self, nbytes: int, start: float) -> None:
        """A link of the given speed would still be busy with ``nbytes`` started at ``start``:
        wait out the difference."""
        if self.link_bytes_per_s:
            left = nbytes / self.link_bytes_per_s - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)

    def compute(self, x: torch.Tensor, pair_slot: torch.Tensor, weights: torch.Tensor, act,
                blocks: ExpertBlocks | None = None) -> torch.Tensor:
        """fp32 partial sum of the pairs served from slots (``pair_slot`` [T, k], -1 = elsewhere);
        ``blocks``: the layer's block formats when the slots hold quantized experts."""
        return routed_partial_sum(x, self.gate_up, self.down, pair_slot, weights, act, blocks)

    def copy_async(self, rows: list[int], slots: list[int]) -> CopyHandle:
        """Start copying pool rows into slots on the copy thread (the stand-in for a copy engine);
        the link's rate limit applies. Copies run in the order they were started."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="hearth-copy")
        return CopyHandle(self._copier.submit(self._copy_rows, rows, slots), len(rows) * self.pool.expert_bytes)

    def _copy_rows(self, rows: list[int], slots: list[int]) -> float:
        start = time.perf_counter()
        for slot, row in zip(slots, rows, strict=True):  # torch copies release the GIL: compute goes on
            self.gate_up[slot].copy_(self.pool.gate_up[row])
            self.down[slot].copy_(self.pool.down[row])
        self._wait_out_link(len(rows) * self.pool.expert_bytes, start)
        return time.perf_counter() - start

    def resize(self, num_slots: int, old_slots: torch.Tensor, new_slots: torch.Tensor, kept_ids: torch.Tensor) -> None:
        """A new arena of ``num_slots`` slots; the experts in ``old_slots`` move to ``new_slots``
        (the cache tables' :meth:`~hearth.engine.experts.policy.cache.ExpertCacheTables.resize`)."""
        if self._copier is not None:
            self._copier.submit(lambda: None).result()  # copies already started land in the old arena first
        self.gate_up = resized_arena(self.gate_up, num_slots, old_slots, new_slots)
        self.down = resized_arena(self.down, num_slots, old_slots, new_slots)
        self.num_slots = num_slots

    def fill_sources(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up bank, down bank, row table) a fixed-shape step's fill reads: the pool itself."""
        return self.pool.gate_up, self.pool.down, self.pool.row_table

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the virtual device but the copy thread (waited per copy)."""

    def close(self) -> None:
        """Stop the copy thread; the arena is plain memory."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None


class CopyHandle:
    """A started copy of whole experts into slots. :meth:`wait` blocks until the slots may be read
    and returns the seconds spent waiting; :attr:`copy_seconds` is how long the copy itself took
    (known once waited for)."""

    def __init__(self, future: Future | None, nbytes: int, event_pair=None) -> None:
        self._future = future
        self._events = event_pair  # (start, end) CUDA events on the copy stream
        self.nbytes = nbytes
        self.copy_seconds = 0.0
        self._done = False
        self._lock = threading.Lock()

    def wait(self) -> float:
        with self._lock:
            if self._done:
                return 0.0
            start = time.perf_counter()
            if self._future is not None:
                self.copy_seconds = self._future.result()
            elif self._events is not None:
                begin, end = self._events
                end.synchronize()  # the host waits, so the wait is measured like the virtual device's
                self.copy_seconds = begin.elapsed_time(end) / 1e3
            self._done = True
            return time.perf_counter() - start


class CudaDevice:
    """Expert slots in GPU memory, filled from the (pinned) host pool on a copy stream.

    The cache-control step already runs on the GPU without host synchronisation; the copy here reads
    the fill count once per step to size the batched gather (a count-aware copy kernel that removes
    that read is what CUDA-graph capture of the whole step needs).
    """

    kind = "cuda"

    def __init__(self, pool: ExpertPool, num_slots: int, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self.pool = pool
        self.num_slots = num_slots
        self.link_bytes_per_s = None
        self.gate_up = torch.empty((num_slots, *pool.gate_up.shape[1:]), dtype=pool.gate_up.dtype, device=self.device)
        self.down = torch.empty((num_slots, *pool.down.shape[1:]), dtype=pool.down.dtype, device=self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        try:
            self._registered = pin_host_memory((pool.gate_up, pool.down))
        except RuntimeError as exc:  # e.g. a sandbox that refuses pinning: slower, but the cache still works
            log.warning("the expert pool cannot be pinned for the GPU (%s): fills copy from pageable memory and "
                        "read their count on the host (no --static-decode graph)", exc)
            self._registered = []
        # Built here, never inside a compiled step (the mapping goes through the CUDA runtime).
        self._sources = self._mapped_sources()

    def _mapped_sources(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device_fill.available():
            try:
                return (device_fill.mapped_view(self.pool.gate_up, self.device),
                        device_fill.mapped_view(self.pool.down, self.device), self.pool.row_table.to(self.device))
            except RuntimeError as exc:
                log.warning("the expert pool cannot be read in place by the GPU (%s): fills read their count "
                            "on the host", exc)
        return self.pool.gate_up, self.pool.down, self.pool.row_table

    def fill_sources(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up bank, down bank, row table) a fixed-shape step's fill reads: the registered pool
        as device views (read across PCIe in place by the count-aware kernel) and the row table on
        the GPU; the host pool itself where Triton is missing (the fill then reads its count on the
        host)."""
        return self._sources

    def track_registration(self, pointers: list[int]) -> None:
        """Host pages registered for this device elsewhere (the task ring): unregistered at close."""
        self._registered += pointers

    def close(self) -> None:
        """Unregister the pool's pages (the pool itself stays: it is the source of truth)."""
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered = []

    def fill(self, plan: FillPlan) -> int:
        count = int(plan.count)
        if count == 0:
            return 0
        rows = self.pool.row_table[plan.src[:count].cpu()].tolist()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # slots no longer read
        self._copy_rows(rows, plan.dst[:count].tolist())
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        return count * self.pool.expert_bytes

    def copy_async(self, rows: list[int], slots: list[int]) -> CopyHandle:
        """Start copying pool rows into slots on the copy stream, after the work already queued on
        the compute stream (which may still read those slots)."""
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            begin.record()
        self._copy_rows(rows, slots)
        with torch.cuda.stream(self.copy_stream):
            end.record()
        return CopyHandle(None, len(rows) * self.pool.expert_bytes, (begin, end))

    def compute(self, x: torch.Tensor, pair_slot: torch.Tensor, weights: torch.Tensor, act,
                blocks: ExpertBlocks | None = None) -> torch.Tensor:
        # Returned on the GPU: the caller computes the CPU share meanwhile and synchronises last.
        return routed_partial_sum(x.to(self.device), self.gate_up, self.down, pair_slot.to(self.device),
                                  weights.to(self.device), act, blocks)

    def resize(self, num_slots: int, old_slots: torch.Tensor, new_slots: torch.Tensor, kept_ids: torch.Tensor) -> None:
        """A new slot arena of ``num_slots`` slots. The old arena is freed first (its memory back to
        the driver: a resize usually answers another program's need) and the kept experts are copied
        again from the pinned host pool, so a resize never needs both arenas at once. When even the
        new arena cannot be had, the device is left with none (0 slots) and the error raised."""
        self.synchronize()  # no fill or compute still reads the old arena
        self.gate_up = self.down = None
        self._sources = None
        torch.cuda.empty_cache()
        try:
            gate_up = torch.empty((num_slots, *self.pool.gate_up.shape[1:]), dtype=self.pool.gate_up.dtype,
                                  device=self.device)
            down = torch.empty((num_slots, *self.pool.down.shape[1:]), dtype=self.pool.down.dtype, device=self.device)
        except torch.cuda.OutOfMemoryError:
            failed = True
        else:
            failed = False
        if failed:  # outside the except block, whose traceback would keep the half-made arena alive
            gate_up = down = None
            torch.cuda.empty_cache()
            self._arena(0)
            raise MemoryError(f"no GPU memory for an expert cache of {num_slots} slots; it now has none")
        self.gate_up, self.down, self.num_slots = gate_up, down, num_slots
        self._copy_rows(self.pool.row_table[kept_ids.cpu()].tolist(), new_slots.tolist())
        self.synchronize()
        self._sources = self._mapped_sources()

    def _copy_rows(self, rows: list[int], slots: list[int]) -> None:
        """Pool rows into slots: pinned source pages -> asynchronous DMA on the copy stream."""
        with torch.cuda.stream(self.copy_stream):
            for row, slot, n in contiguous_runs(rows, slots):  # a streamed layer is one run: one DMA per bank
                self.gate_up[slot : slot + n].copy_(self.pool.gate_up[row : row + n], non_blocking=True)
                self.down[slot : slot + n].copy_(self.pool.down[row : row + n], non_blocking=True)

    def _arena(self, num_slots: int) -> None:
        self.gate_up = torch.empty((num_slots, *self.pool.gate_up.shape[1:]), dtype=self.pool.gate_up.dtype,
                                   device=self.device)
        self.down = torch.empty((num_slots, *self.pool.down.shape[1:]), dtype=self.pool.down.dtype,
                                device=self.device)
        self.num_slots = num_slots

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def contiguous_runs(rows: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) for each run of consecutive rows going to consecutive slots,
    in order: the copies a fill of ``rows`` into ``slots`` needs at the fewest."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in zip(rows, slots, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def copy_experts(dst: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, src: tuple[torch.Tensor, torch.Tensor],
                 rows: torch.Tensor) -> None:
    """``dst[b][slots[j]] = src[b][rows[j]]`` for both banks b (gate_up, down), host memory: one
    batched, parallel native copy per bank, or straight row copies without the kernels."""
    ops = cpu_decode_ops()
    if ops is not None and all(t.is_cpu and t.is_contiguous() for t in (*dst, *src)):
        for d, s in zip(dst, src, strict=True):
            ops.copy_rows(d, slots, s, rows)
        return
    for slot, row in zip(slots.tolist(), rows.tolist(), strict=True):  # no temporaries
        for d, s in zip(dst, src, strict=True):
            d[slot].copy_(s[row])


def resized_arena(arena: torch.Tensor, num_slots: int, old_slots: torch.Tensor,
                  new_slots: torch.Tensor) -> torch.Tensor:
    """A copy of ``arena`` [S, ...] with ``num_slots`` slots, where slot ``new_slots[i]`` holds what
    ``old_slots[i]`` held (the other slots uninitialised)."""
    out = torch.empty((num_slots, *arena.shape[1:]), dtype=arena.dtype, device=arena.device)
    old, new = old_slots.to(arena.device), new_slots.to(arena.device)
    for start in range(0, old.numel(), _MOVE_CHUNK):  # bounded temporaries, whatever the arena's size
        out[new[start:start + _MOVE_CHUNK]] = arena[old[start:start + _MOVE_CHUNK]]
    return out


def page_ranges(spans: Iterable[tuple[int, int]], page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """(start, bytes) of the fewest page-aligned address ranges that cover every (address, bytes) span:
    each span rounded out to whole pages, then overlapping or adjacent ones merged, in address order.
    Empty spans cover nothing (pure)."""
    merged: list[list[int]] = []
    for first, end in sorted((ptr // page * page, -(-(ptr + n) // page) * page) for ptr, n in spans if n > 0):
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([first, end])
    return [(first, end - first) for first, end in merged]


def pin_host_memory(tensors) -> list[int]:
    """Register already-filled, contiguous host tensors with CUDA (mapped, pinned) for asynchronous
    DMA and in-place reads by the GPU (a registered range maps every address inside it).

    Filling first and pinning afterwards avoids the OS zeroing pages about to be overwritten.
    Registration works on whole pages, and a page may be registered once: two banks of the heap
    (which aligns them to 64 bytes, not to pages) can share one, so the tensors' pages are
    registered as merged page-aligned ranges, each once. Returns the registered range starts (what
    ``cudaHostUnregister`` takes); tensors already pinned are skipped.
    """
    spans = []
    for t in tensors:
        if t.nbytes == 0 or t.is_pinned():
            continue
        if not t.is_contiguous():
            raise ValueError("pin_host_memory: contiguous host tensors (their bytes are registered as one span)")
        spans.append((t.data_ptr(), t.nbytes))
    cudart = torch.cuda.cudart()
    registered: list[int] = []
    for first, nbytes in page_ranges(spans):
        err = register_range(cudart, first, nbytes)
        if err != 0:
            for ptr in registered:  # all or nothing: the caller keeps no half-registered pool
                cudart.cudaHostUnregister(ptr)
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of the expert pool failed ({err})")
        registered.append(first)
    return registered


HOST_REGISTER_MAPPED, HOST_REGISTER_READ_ONLY = 0x02, 0x08  # cudaHostRegisterMapped, cudaHostRegisterReadOnly


def register_range(cudart, first: int, nbytes: int) -> int:
    """Register one page-aligned range, mapped; the CUDA error code (0 on success). A pool this
    process attached to by name is mapped read-only, which CUDA registers only with its read-only
    flag on hosts whose GPU cannot use the host's page tables (x86): tried second, since a writable
    range registered read-only would refuse the fills' and the ring's device writes."""
    err = int(cudart.cudaHostRegister(first, nbytes, HOST_REGISTER_MAPPED))
    if err != 0:
        _clear_cuda_error()  # else the next CUDA call that checks the last error reports this one
        err = int(cudart.cudaHostRegister(first, nbytes, HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY))
        if err != 0:
            _clear_cuda_error()
    return err


def _clear_cuda_error() -> None:
    # No runtime library: nothing recorded an error either.
    with contextlib.suppress(OSError, RuntimeError, AttributeError):
        device_fill.cuda_runtime().cudaGetLastError()
