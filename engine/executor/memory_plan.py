"""Where an engine's host memory goes: weights, the KV cache (cached prefixes live inside it),
recurrent states and the budget of their checkpoints, against what the machine has free.

The engine logs the plan when it starts and warns when it does not fit: with prefix caching on by
default, a KV cache sized past the free memory would be filled by cached prompts and swap, or be
killed, long after start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hearth.engine.cache.kv_pages import PagedKVCache


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes each part of an engine holds (``checkpoints``: the most it may hold)."""

    weights: int
    kv_cache: int
    kv_tokens: int
    recurrent_states: int = 0
    checkpoints: int = 0
    available: int | None = None  # free host memory before loading, when the OS says
    resident: int = 0  # of the weights, bytes already in memory at start (an attached shared pool)

    @property
    def total(self) -> int:
        """Everything the engine may hold."""
        return self.weights + self.kv_cache + self.recurrent_states + self.checkpoints

    def describe(self) -> str:
        """One line for the log and the serve banner."""
        shared = f" ({_human(self.resident)} of it shared, already loaded)" if self.resident else ""
        parts = [f"weights {_human(self.weights)}{shared}",
                 f"KV cache {_human(self.kv_cache)} ({self.kv_tokens} tokens; cached prefixes live inside it)"]
        if self.recurrent_states:
            parts.append(f"recurrent states {_human(self.recurrent_states)}")
        if self.checkpoints:
            parts.append(f"state checkpoints up to {_human(self.checkpoints)}")
        free = f" of {_human(self.available)} free" if self.available is not None else ""
        return f"memory: {_human(self.total)}{free}: " + ", ".join(parts)

    def warning(self) -> str | None:
        """Why the plan may not fit the machine, or None."""
        if self.available is None or self.total - self.resident <= self.available:
            return None
        return (f"the engine may use {_human(self.total)} but {_human(self.available)} was free when it started; "
                "lower --kv-cache-bytes or --checkpoint-budget (or --max-model-len / --max-num-seqs)")

    def as_dict(self) -> dict[str, int | None]:
        """The plan as log fields."""
        return {"weights": self.weights, "resident": self.resident, "kv_cache": self.kv_cache,
                "kv_tokens": self.kv_tokens, "recurrent_states": self.recurrent_states,
                "checkpoints": self.checkpoints, "total": self.total, "available": self.available}


def tensor_bytes(tensors: Iterable[torch.Tensor], device: torch.device | str | None) -> int:
    """Bytes of the storages behind ``tensors`` on ``device``, each storage once (views share theirs):
    ``"cpu"`` for host memory, the executor's device for what ``--vram-limit`` counts, None for every
    device. A device without an index (``"cuda"``) stands for each of its type's (``"cuda:0"``, ...)."""
    by_device = bytes_by_device(tensors)
    if device is None:
        return sum(by_device.values())
    want = torch.device(device)
    return sum(n for name, n in by_device.items() if _same_device(torch.device(name), want))


def executor_bytes(model: torch.nn.Module, kv: PagedKVCache, device: torch.device) -> int:
    """Bytes the executor holds on ``device`` besides its expert cache, the dense weights and the KV
    cache: what ``--vram-limit`` counts (GPU memory on a GPU, host memory for the virtual device)."""
    return tensor_bytes([*model.parameters(), *model.buffers(), *kv.keys, *kv.values], device)


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index == want.index)


@dataclass(frozen=True)
class VramPlan:
    """What the GPU executor puts in GPU memory: the dense weights, the KV cache of ``kv_tokens``
    tokens, and expert cache slots in what is left (``share`` of it, as the engine sizes its default
    cache)."""

    free: int
    weights: int
    kv_cache: int
    kv_tokens: int
    cache_slots: int
    cache_bytes: int

    def fits(self) -> bool:
        return self.weights + self.kv_cache <= self.free


def plan_vram(free: int, weights: int, kv_bytes_per_token: int, kv_tokens: int, expert_bytes: int,
              total_experts: int, share: float = 0.8) -> VramPlan:
    """The GPU executor's memory plan on a GPU with ``free`` bytes (pure)."""
    kv = kv_bytes_per_token * kv_tokens
    left = max(free - weights - kv, 0)
    slots = min(int(left * share) // expert_bytes, total_experts)
    return VramPlan(free, weights, kv, kv_tokens, slots, slots * expert_bytes)


def bytes_by_device(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes of the storages behind ``tensors`` (each once) per device ("cpu", "cuda:0", ...)."""
    seen: dict[tuple[str, str, int], torch.UntypedStorage] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        # One storage by its address (two storages over the same memory count once); storages with
        # no address (data_ptr 0: every meta storage) by their identity, kept alive in ``seen`` so
        # that no id is reused while counting.
        ptr = storage.data_ptr()
        seen[(str(t.device), "ptr", ptr) if ptr else (str(t.device), "id", id(storage))] = storage
    out: dict[str, int] = {}
    for (device, _, _), storage in seen.items():
        out[device] = out.get(device, 0) + storage.nbytes()
    return out


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (Linux), else None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
