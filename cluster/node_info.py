"""What a node has, read on the node itself: RAM, physical cores, NVIDIA GPUs (pynvml).

Runs inside a Ray task pinned to each node (see ``cluster.launch.discover_nodes``), so nothing is
configured by hand.
"""

from __future__ import annotations

import contextlib
import os

from hearth.cluster.placement import GpuInfo, NodeInfo
from hearth.config import ConfigError, parse_bytes
from hearth.engine.experts import physical_cores

try:
    import pynvml
except ImportError:  # no NVIDIA bindings: a CPU node
    pynvml = None


def meminfo() -> tuple[int, int]:
    """(total, available) bytes of RAM from /proc/meminfo (sysconf where it is missing)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    if "MemTotal" in values:
        return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, total


def nvidia_gpus() -> tuple[GpuInfo, ...]:
    """The node's NVIDIA GPUs with total and free memory; empty without a driver."""
    if pynvml is None:
        return ()
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no GPU: a CPU node
        return ()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else str(name), int(mem.total),
                                int(mem.free)))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def ram_limit() -> int | None:
    """The RAM its owner lets hearth use on this machine: ``HEARTH_RAM_LIMIT`` in the environment
    the node was started with (``HEARTH_RAM_LIMIT=24GiB ray start ...``), or None."""
    text = os.environ.get("HEARTH_RAM_LIMIT", "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"HEARTH_RAM_LIMIT={text!r} is not a size (like 24GiB or 512MiB): {exc}") from None


def describe_this_node(node_id: str, address: str, labels: frozenset[str]) -> NodeInfo:
    """A :class:`NodeInfo` for the machine this runs on."""
    total, available = meminfo()
    return NodeInfo(node_id, address, total, available, len(physical_cores()), nvidia_gpus(), labels,
                    ram_limit_bytes=ram_limit())
