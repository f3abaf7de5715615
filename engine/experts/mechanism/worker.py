"""A CPU expert worker process: ``python -m hearth.engine.experts.mechanism.worker --pool NAME --ring NAME``.

Attaches to the host expert pool (read-only) and the task ring by name, binds itself to the
given cores, and serves tasks until the ring's shutdown flag is set.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from hearth.engine.experts.compute import routed_partial_sum
from hearth.engine.experts.mechanism import shm
from hearth.engine.experts.mechanism.cpu_workers import bind_current_thread, physical_cores, task_expert_bytes
from hearth.engine.experts.mechanism.host_pool import HostExpertPool, process_alive
from hearth.engine.experts.mechanism.ring import TaskRing
from hearth.engine.kernels.ring_words import DONE, FAILED, SUBMITTED
from hearth.engine.ops import activation

log = logging.getLogger("hearth.cpu_worker")


def idle_sleep(idle_s: float) -> float:
    """How long to sleep between polls after ``idle_s`` seconds without a task: spin-wait briefly
    (a decode step's next layer comes within microseconds), then back off: after two idle seconds
    fifty wake-ups per second, so an idle worker costs almost no CPU and the first task after a
    pause waits at most 20 ms."""
    if idle_s < 1e-3:
        return 0.0
    if idle_s < 0.1:
        return 50e-6
    if idle_s < 2.0:
        return 500e-6
    return 20e-3


def serve(pool: HostExpertPool, ring: TaskRing, parent_pid: int | None = None) -> int:
    """Serve tasks until shutdown (or until ``parent_pid``, the executor that owns the ring, is
    gone); returns the number of tasks done."""
    act = activation(ring.layout.hidden_act)
    gate_up, down = pool.tensors
    dtype = gate_up.dtype
    h, done = ring.layout.hidden, 0
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    idle_since = owner_checked = time.monotonic()
    while not ring.shutdown:
        busy = False
        for v in ring.slots:
            ctrl = v["ctrl"]
            if int(ctrl[0]) != SUBMITTED:
                continue
            busy = True
            start = time.perf_counter_ns()
            try:
                t, k, fp32_weights = int(ctrl[2]), int(ctrl[3]), bool(ctrl[4])
                x = v["x"][: t * h].view(t, h).to(dtype)
                rows = v["rows"][: t * k].view(t, k)
                weights = v["weights"][: t * k].view(t, k)
                if not fp32_weights:
                    weights = weights.to(dtype)
                v["out"][: t * h].view(t, h).copy_(routed_partial_sum(x, gate_up, down, rows, weights, act))
                ctrl[5] = task_expert_bytes(rows, expert_bytes)
                ctrl[6] = time.perf_counter_ns() - start
                ctrl[0] = DONE
            except Exception:  # report, never leave the executor waiting
                log.exception("CPU expert task failed")
                ctrl[0] = FAILED
            done += 1
        if busy:
            idle_since = time.monotonic()
            continue
        now = time.monotonic()
        pause = idle_sleep(now - idle_since)
        if pause:
            time.sleep(pause)
        if parent_pid is not None and now - owner_checked > 1.0:
            owner_checked = now
            if not process_alive(parent_pid):
                log.warning("the executor that owns this ring is gone; removing the ring and exiting")
                shm.unlink(ring.name)  # its owner cannot any more
                break
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hearth.engine.experts.mechanism.worker", description=__doc__)
    p.add_argument("--pool", required=True, help="name of the host expert pool segment")
    p.add_argument("--ring", required=True, help="name of the task ring segment")
    p.add_argument("--cores", default=None, help="comma-separated CPUs to bind to (default: one per physical core)")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: number of cores)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the executor) is gone")
    args = p.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",")] if args.cores else physical_cores()
    bind_current_thread(cores)
    torch.set_num_threads(args.threads or len(cores))
    pool = HostExpertPool.attach(args.pool)
    ring = TaskRing.attach(args.ring)
    ring.words[1] = os.getpid()  # ready
    print(f"hearth cpu worker: pool {pool.name}, ring {ring.name}, cores {cores}", file=sys.stderr, flush=True)
    try:
        serve(pool, ring, parent_pid=args.parent_pid)
    finally:
        ring.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
