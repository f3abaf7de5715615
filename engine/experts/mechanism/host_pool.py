"""The host expert pool in named POSIX shared memory.

The owner creates a segment named ``hearth-<name>`` and fills it (from FTW or a Hugging Face
checkpoint); on CUDA machines the executor then registers the filled pages for pinned DMA — fill
first, then pin (see ``device.CudaDevice``). Other processes (CPU expert workers, a restarted
executor) attach to it by name and map it read-only, so every process uses the same physical pages.
The first page is a header: magic, owner pid and JSON metadata (bank shapes, dtype), so
attaching needs nothing but the name. The owner unlinks the segment on close; a crashed owner's
segment is removed by :func:`cleanup`.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import torch

from hearth.engine.experts.mechanism import shm
from hearth.engine.experts.mechanism.shm import PREFIX

_MAGIC = b"HEARTH-POOL-v1\0\0"
_HEADER = 4096
_FILLED_AT = _HEADER - 1  # set once the owner has written every expert
_ALIGN = 4096


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class HostExpertPool:
    """A shared-memory segment holding the two expert banks (``gate_up`` and ``down``)."""

    def __init__(self, segment: shm.Segment, meta: dict) -> None:
        self.segment = segment
        self.name = segment.name
        self.meta = meta
        self.gate_up, self.down = self._views()

    @property
    def owner(self) -> bool:
        return self.segment.owner

    # -- creation and attachment ---------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, gate_up_shape: tuple, down_shape: tuple, dtype: torch.dtype) -> HostExpertPool:
        """Create (exclusively) a segment for banks of the given shapes; the caller fills it."""
        item = torch.empty((), dtype=dtype).element_size()
        gu_bytes = _numel(gate_up_shape) * item
        down_offset = _HEADER + -(-gu_bytes // _ALIGN) * _ALIGN
        total = down_offset + _numel(down_shape) * item
        meta = {"dtype": str(dtype).removeprefix("torch."), "gate_up": list(gate_up_shape),
                "down": list(down_shape), "gate_up_offset": _HEADER, "down_offset": down_offset, "bytes": total}
        try:
            buf = shm.create(name, total)
        except FileExistsError as exc:
            raise FileExistsError(f"shared-memory pool '{shm.shm_name(name)[1:]}' already exists (another hearth "
                                  f"process, or a crashed one: remove it with `hearth pool clean {name}`)") from exc
        header = json.dumps(meta).encode()
        buf[: len(_MAGIC) + 12 + len(header)] = _MAGIC + struct.pack("<QI", os.getpid(), len(header)) + header
        return cls(shm.Segment(name, buf, owner=True), meta)

    @classmethod
    def attach(cls, name: str, writable: bool = False) -> HostExpertPool:
        """Map an existing segment by name (read-only unless ``writable``)."""
        try:
            buf = shm.attach(name, writable)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no shared-memory pool named '{shm.shm_name(name)[1:]}'") from exc
        meta = read_header(buf)
        if meta["bytes"] > len(buf):
            buf.close()
            raise ValueError(f"shared-memory pool '{shm.shm_name(name)[1:]}' is truncated")
        return cls(shm.Segment(name, buf, owner=False), meta)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _dtype(self.meta["dtype"])
        out = []
        with warnings.catch_warnings():  # read-only mappings: torch warns that writes would fail
            warnings.simplefilter("ignore", UserWarning)
            for bank in ("gate_up", "down"):
                shape, offset = self.meta[bank], self.meta[f"{bank}_offset"]
                t = torch.frombuffer(self.segment.buf, dtype=dtype, count=_numel(shape), offset=offset)
                out.append(t.view(shape))
        return out[0], out[1]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up, self.down

    @property
    def filled(self) -> bool:
        """Whether the owner finished filling the pool (a crash mid-load leaves it unset)."""
        return self.segment.buf[_FILLED_AT] == 1

    def mark_filled(self) -> None:
        """Owner only: every expert is written; attachers may now trust the contents."""
        if not self.owner:
            raise PermissionError("only the pool's owner marks it filled")
        self.segment.buf[_FILLED_AT] = 1

    # -- release -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap (once no tensor uses the pages) and, for the owner, remove the name."""
        self.gate_up = self.down = None  # type: ignore[assignment]
        self.segment.close()

    def __enter__(self) -> HostExpertPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_header(buf) -> dict:
    if bytes(buf[: len(_MAGIC)]) != _MAGIC:
        raise ValueError("not a hearth expert pool (bad magic)")
    pid, length = struct.unpack("<QI", bytes(buf[len(_MAGIC) : len(_MAGIC) + 12]))
    meta = json.loads(bytes(buf[len(_MAGIC) + 12 : len(_MAGIC) + 12 + length]))
    meta["owner_pid"] = pid
    return meta


def cleanup(name: str) -> bool:
    """Remove the named segment (e.g. left by a crashed owner); True if one was removed."""
    return shm.unlink(name)


def list_pools() -> list[dict]:
    """Hearth segments visible in /dev/shm (Linux), with owner pid and whether the owner is alive."""
    root = Path("/dev/shm")
    found = []
    for p in sorted(root.glob(PREFIX + "*")) if root.is_dir() else []:
        try:
            with open(p, "rb") as f:
                meta = read_header(f.read(_HEADER))
        except (OSError, ValueError):
            continue
        found.append({"name": p.name, "bytes": meta["bytes"], "owner_pid": meta["owner_pid"],
                      "owner_alive": process_alive(meta["owner_pid"])})
    return found


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) still runs; an exited process that its parent
    has not reaped yet (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
