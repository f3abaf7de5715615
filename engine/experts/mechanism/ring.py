"""A shared-memory ring of fixed task descriptors between an executor and CPU expert workers.

The ring lets the CPU expert workers live in another process (the cluster wraps them in an actor)
while per-layer work never crosses an RPC: the executor writes a task into a free slot and flips
its state word; the worker, which has the host pool mapped read-only, computes the partial sum
into the same slot and flips the state back. Slots have fixed sizes (``max_tokens`` rows), so a
descriptor is a handful of integers and nothing is serialised. State words are aligned 8-byte
stores written after the payload (x86-64 and ARMv8 keep such stores ordered for a reader that
checks the state first).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from hearth.engine.experts.contract import CpuTaskTiming
from hearth.engine.experts.mechanism import shm
from hearth.engine.kernels.ring_words import FAILED, FREE, SUBMITTED

_MAGIC = b"HEARTH-RING-v2\0\0"  # v2: 64-byte aligned fields
_HEADER = 4096
# Header words after the magic: shutdown flag, worker pid, worker heartbeat.
_WORDS = 4


@dataclass(frozen=True)
class RingLayout:
    """Sizes of one ring: ``slots`` descriptors of up to ``max_tokens`` tokens, hidden size and top-k."""

    slots: int
    max_tokens: int
    hidden: int
    top_k: int
    hidden_act: str = "silu"

    def fields(self) -> dict[str, tuple[torch.dtype, int, int]]:
        """Each slot field's (dtype, elements, byte offset in the slot). Every field starts on a
        64-byte boundary, so each is aligned for any reader (a GPU kernel's vector loads too)."""
        t, h, k = self.max_tokens, self.hidden, self.top_k
        sizes = {"ctrl": (torch.int64, 8), "rows": (torch.int64, t * k), "x": (torch.float32, t * h),
                 "weights": (torch.float32, t * k), "out": (torch.float32, t * h)}
        out, offset = {}, 0
        for name, (dtype, count) in sizes.items():
            out[name] = (dtype, count, offset)
            offset += -(-count * torch.empty((), dtype=dtype).element_size() // 64) * 64
        return out

    @property
    def slot_bytes(self) -> int:
        dtype, count, offset = self.fields()["out"]
        return offset + -(-count * 4 // 64) * 64


class TaskRing:
    """The mapped ring, with typed views of every slot's fields."""

    def __init__(self, segment: shm.Segment, layout: RingLayout) -> None:
        self.segment = segment
        self.name = segment.name
        self.layout = layout
        buf = segment.buf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.words = torch.frombuffer(buf, dtype=torch.int64, count=_WORDS, offset=len(_MAGIC))
            self.slots = [self._slot_views(i) for i in range(layout.slots)]

    def _slot_views(self, i: int) -> dict[str, torch.Tensor]:
        base = _HEADER + i * self.layout.slot_bytes
        return {name: torch.frombuffer(self.segment.buf, dtype=dtype, count=count, offset=base + offset)
                for name, (dtype, count, offset) in self.layout.fields().items()}
        # ctrl: the control words of kernels/ring_words.py

    @classmethod
    def create(cls, name: str, layout: RingLayout) -> TaskRing:
        buf = shm.create(name, _HEADER + layout.slots * layout.slot_bytes)
        meta = json.dumps(layout.__dict__).encode()
        start = len(_MAGIC) + 8 * _WORDS
        buf[: start + 4 + len(meta)] = _MAGIC + bytes(8 * _WORDS) + struct.pack("<I", len(meta)) + meta
        return cls(shm.Segment(name, buf, owner=True), layout)

    @classmethod
    def attach(cls, name: str) -> TaskRing:
        buf = shm.attach(name, writable=True)
        if bytes(buf[: len(_MAGIC)]) != _MAGIC:
            buf.close()
            raise ValueError(f"'{name}' is not a hearth task ring")
        start = len(_MAGIC) + 8 * _WORDS
        (length,) = struct.unpack("<I", bytes(buf[start : start + 4]))
        layout = RingLayout(**json.loads(bytes(buf[start + 4 : start + 4 + length])))
        return cls(shm.Segment(name, buf, owner=False), layout)

    @property
    def shutdown(self) -> bool:
        return bool(self.words[0])

    def request_shutdown(self) -> None:
        self.words[0] = 1

    def close(self) -> None:
        self.words = None  # type: ignore[assignment]
        self.slots = []
        self.segment.close()


def write_task(v: dict[str, torch.Tensor], x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
               seq: int) -> None:
    """Post a task (x [T, H], pool rows and weights [T, k]) into the slot ``v``: the payload, the
    fields, and the state word SUBMITTED last (the worker reads the payload only after seeing it)."""
    t, k = rows.shape
    v["x"][: x.numel()].copy_(x.reshape(-1))  # exact: bf16/fp16/fp32 all fit in fp32
    v["rows"][: t * k].copy_(rows.reshape(-1))
    v["weights"][: t * k].copy_(weights.reshape(-1))
    v["ctrl"][1:5] = torch.tensor([seq, t, k, int(weights.dtype == torch.float32)])
    v["ctrl"][0] = SUBMITTED


def await_task(v: dict[str, torch.Tensor], tokens: int, hidden: int, timeout_s: float
               ) -> tuple[torch.Tensor, CpuTaskTiming]:
    """Wait for the slot's answer: the fp32 [tokens, hidden] partial sum and what it cost; the slot
    is free again. A failed task, or no answer within ``timeout_s``, raises."""
    deadline, spins = time.monotonic() + timeout_s, 0
    while (state := int(v["ctrl"][0])) == SUBMITTED:
        spins += 1
        if spins > 200:
            time.sleep(20e-6)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the CPU expert worker did not answer within {timeout_s:.0f} s")
    if state == FAILED:
        v["ctrl"][0] = FREE
        raise RuntimeError("the CPU expert worker failed on a task (see its log)")
    out = v["out"][: tokens * hidden].view(tokens, hidden).clone()
    timing = CpuTaskTiming(int(v["ctrl"][6]) / 1e9, int(v["ctrl"][5]))
    v["ctrl"][0] = FREE
    return out, timing


class _RingFuture:
    """The pending result of one submitted slot."""

    def __init__(self, client: RingCpuWorkers, slot: int, tokens: int, hidden: int) -> None:
        self.client, self.slot, self.tokens, self.hidden = client, slot, tokens, hidden

    def result(self) -> tuple[torch.Tensor, CpuTaskTiming]:
        return self.client._wait(self)


class RingCpuWorkers:
    """Client side: submits tasks to a worker process through a :class:`TaskRing`.

    Same interface as :class:`~hearth.engine.experts.mechanism.cpu_workers.CpuExpertWorkers`; ``timeout_s`` bounds
    how long a task may wait for a worker before it is an error (a dead worker never hangs a step).
    """

    def __init__(self, ring: TaskRing, expert_bytes: int, timeout_s: float = 30.0) -> None:
        self.ring = ring
        self.expert_bytes = expert_bytes
        self.timeout_s = timeout_s
        self._seq = 0

    def submit(self, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, blocks=None) -> _RingFuture:
        if blocks is not None:
            raise ValueError("CPU expert worker processes compute float experts only")
        lo = self.ring.layout
        t, k = rows.shape
        if t > lo.max_tokens or k != lo.top_k or x.shape[1] != lo.hidden:
            raise ValueError(f"task of {t}x{k} does not fit ring slots of {lo.max_tokens}x{lo.top_k}")
        slot = self._free_slot()
        self._seq += 1
        write_task(self.ring.slots[slot], x, rows, weights, self._seq)
        return _RingFuture(self, slot, t, lo.hidden)

    def _free_slot(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, v in enumerate(self.ring.slots):
                if int(v["ctrl"][0]) == FREE:
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError("no free slot in the CPU expert ring (is the worker alive?)")
            time.sleep(20e-6)

    def _wait(self, fut: _RingFuture) -> tuple[torch.Tensor, CpuTaskTiming]:
        return await_task(self.ring.slots[fut.slot], fut.tokens, fut.hidden, self.timeout_s)

    def close(self) -> None:
        self.ring.request_shutdown()


class ExternalCpuWorkers(RingCpuWorkers):
    """CPU expert workers that someone else runs (the cluster's CPU-worker actor): creates the ring
    and waits for a worker to attach to it by name (:meth:`wait_attached`); ``close()`` asks it to
    stop and removes the ring."""

    def __init__(self, pool_name: str, layout: RingLayout, expert_bytes: int) -> None:
        super().__init__(TaskRing.create(f"{pool_name}-ring-{os.getpid()}-{id(self):x}", layout), expert_bytes)

    @property
    def ring_name(self) -> str:
        return self.ring.name

    def wait_attached(self, timeout_s: float = 60.0) -> int:
        """Block until a worker serves the ring; returns its pid."""
        deadline = time.monotonic() + timeout_s
        while int(self.ring.words[1]) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no CPU expert worker attached to ring '{self.ring.name}' within {timeout_s:.0f} s")
            time.sleep(0.01)
        return int(self.ring.words[1])

    def close(self) -> None:
        if self.ring.words is not None:
            self.ring.request_shutdown()
            self.ring.close()


class ProcessCpuWorkers(RingCpuWorkers):
    """CPU expert workers in a child process attached to the shared pool ``pool_name``: creates the
    ring, starts ``python -m hearth.engine.experts.mechanism.worker`` and waits until it serves;
    ``close()`` stops it."""

    def __init__(self, pool_name: str, layout: RingLayout, expert_bytes: int, cores: list[int] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        ring = TaskRing.create(f"{pool_name}-ring-{os.getpid()}-{id(self):x}", layout)
        super().__init__(ring, expert_bytes)
        cmd = [sys.executable, "-m", "hearth.engine.experts.mechanism.worker", "--pool", pool_name, "--ring", ring.name,
               "--parent-pid", str(os.getpid())]
        if cores:
            cmd += ["--cores", ",".join(map(str, cores))]
        # PYTHONSAFEPATH: `-m` would put the working directory first on the path, where a source
        # checkout's own hearth/ folder (the package's top alone) can hide the real one.
        self.process = subprocess.Popen(cmd, env=dict(os.environ, PYTHONSAFEPATH="1"))
        deadline = time.monotonic() + start_timeout_s
        while int(ring.words[1]) == 0:  # the worker writes its pid once it is ready
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the CPU expert worker process did not start (exit code {self.process.poll()})")
            time.sleep(0.01)

    def close(self) -> None:
        if self.ring.words is not None:
            self.ring.request_shutdown()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.ring.close()
