"""The expert subsystem: every expert in the host pool, a device cache of expert slots, each layer
call's misses split between cache fills and CPU execution by the q* table, and prefill streamed
through whole-layer buffers. Results never depend on the cache size or the split, only speed does
(``docs/design.md``: the expert memory hierarchy).

- ``contract.py``   what the model, the engine and the cluster rely on (protocols, step context)
- ``pool.py``       the expert pool by global id; ``compute.py`` expert math and the plain backend
- ``policy/``       decisions: the q* table, its online tuning, cache control, when to stream
- ``mechanism/``    how they happen: devices, CPU workers, the task ring, shared memory, the host
  pool, the layer streamer
- ``backend.py``, ``measure.py``, ``build.py``  the hierarchical backend, the path measurements, and
  the assembly from an :class:`~hearth.config.ExpertConfig`

The names below are the package's public face for serving and cluster, which run the hierarchy's
pieces in processes of their own: the host pool in shared memory, the task ring and the worker
loop that serves it, the CPU cores to bind them to, and the VRAM watcher of an elastic cache.
"""

from __future__ import annotations

from hearth.engine.experts.mechanism.cpu_workers import bind_current_thread, physical_cores
from hearth.engine.experts.mechanism.host_pool import HostExpertPool, list_pools
from hearth.engine.experts.mechanism.host_pool import cleanup as cleanup_pool
from hearth.engine.experts.mechanism.ring import TaskRing
from hearth.engine.experts.mechanism.vram_watch import watch_engine

__all__ = ["HostExpertPool", "TaskRing", "bind_current_thread", "cleanup_pool", "list_pools", "physical_cores",
           "serve_ring", "watch_engine"]


def serve_ring(pool: HostExpertPool, ring: TaskRing, parent_pid: int | None = None) -> int:
    """Serve the CPU expert tasks of ``ring`` from ``pool`` until its owner closes it or dies (the
    worker loop of :mod:`.mechanism.worker`); the tasks done."""
    # deferred: the worker module also runs as `python -m`; imported by its package it would load twice
    from hearth.engine.experts.mechanism.worker import serve

    return serve(pool, ring, parent_pid=parent_pid)
