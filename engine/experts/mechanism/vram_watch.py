"""Elastic VRAM, the watcher: a thread that reads the GPU's free memory (NVML, through ``pynvml``)
every few seconds and resizes the expert cache when :func:`~hearth.engine.experts.policy.vram.elastic_budget`
says so. When a game or another model takes GPU memory the cache gives it back; when they free
it, the cache grows back to its starting size."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hearth.engine.experts.policy.vram import VramPolicy, elastic_budget

log = logging.getLogger(__name__)


class VramWatcher:
    """Polls ``read_free()`` (bytes free on the GPU) every ``interval_s``; when the policy asks for
    another size, calls ``resize(bytes)`` (which must apply it at a safe point and return once
    done) and reads the cache's size again from ``cache_bytes()``."""

    def __init__(self, read_free: Callable[[], int], cache_bytes: Callable[[], int], resize: Callable[[int], Any],
                 policy: VramPolicy, interval_s: float = 2.0) -> None:
        self.read_free, self.cache_bytes, self.resize = read_free, cache_bytes, resize
        self.policy = policy
        self.interval_s = interval_s
        self.resizes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hearth-vram-watch", daemon=True)

    def set_ceiling(self, nbytes: int) -> None:
        """A size set by hand is the new most the cache may grow to (and the watcher shrinks it
        below that only when memory runs short)."""
        self.policy = replace(self.policy, ceiling=nbytes, grow_step=max(nbytes // 16, 1))

    def start(self) -> VramWatcher:
        self._thread.start()
        return self

    def check(self) -> int | None:
        """One reading and, if needed, one resize; the new size in bytes, or None."""
        budget = elastic_budget(self.read_free(), self.cache_bytes(), self.policy)
        if budget is not None:
            log.info("GPU memory changed: resizing the expert cache to %.2f GiB", budget / 2**30)
            self.resize(budget)
            self.resizes += 1
        return budget

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed reading or resize is logged; the next one may succeed
                log.exception("elastic VRAM: reading or resizing failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)


def nvml_free_reader(device_index: int) -> Callable[[], int] | None:
    """A function returning the free bytes of CUDA device ``device_index`` as NVML counts them (all
    processes), or None where NVML is not available (no ``pynvml``, no driver)."""
    try:
        # deferred: NVML is optional (no pynvml or no driver: no reader), and torch is only needed then
        import pynvml
        import torch

        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)  # CUDA_VISIBLE_DEVICES renumbers, the bus id does not
    except Exception as exc:  # noqa: BLE001 - optional: elastic VRAM then follows explicit requests only
        log.info("elastic VRAM: no NVML reading (%s); the expert cache changes size on request only", exc)
        return None
    return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)


def watch_engine(engine: Any, resize: Callable[[int], Any], read_free: Callable[[], int] | None = None,
                 interval_s: float = 2.0) -> VramWatcher | None:
    """A started watcher over ``engine``'s expert cache, or None: it needs the expert hierarchy on a
    CUDA device with ``vram_watch`` on and NVML readable (``read_free`` stands in for NVML, e.g. on
    the virtual device in tests). ``resize(bytes)`` must apply the size at a safe point (the engine
    client's ``call``). The cache never grows past its size at this call."""
    experts = engine.experts
    if experts is None or not engine.config.experts.vram_watch:
        return None
    if read_free is None:
        if experts.device.kind != "cuda":
            return None
        read_free = nvml_free_reader(experts.device.device.index or 0)
        if read_free is None:
            return None
    expert_bytes = experts.pool.expert_bytes
    ceiling = experts.tables.num_slots * expert_bytes
    policy = VramPolicy(engine.config.experts.vram_reserve, ceiling, expert_bytes, grow_step=max(ceiling // 16, 1))
    return VramWatcher(read_free, lambda: experts.tables.num_slots * expert_bytes, resize, policy, interval_s).start()
