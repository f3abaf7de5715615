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

import contextlib
import json
import mmap
import os
import struct
import warnings
import weakref
from pathlib import Path

import torch

try:  # CPython's POSIX shared-memory primitives (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

_MAGIC = b"HEARTH-POOL-v1\0\0"
_HEADER = 4096
_FILLED_AT = _HEADER - 1  # set once the owner has written every expert
_ALIGN = 4096
PREFIX = "hearth-"


def _shm_name(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"invalid pool name '{name}'")
    return "/" + (name if name.startswith(PREFIX) else PREFIX + name)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class HostExpertPool:
    """A shared-memory segment holding the two expert banks (``gate_up`` and ``down``)."""

    def __init__(self, shm: str, buf: mmap.mmap, meta: dict, owner: bool) -> None:
        self.name = shm.lstrip("/")
        self._mmap = buf
        self.meta = meta
        self.owner = owner
        self.gate_up, self.down = self._views(writable=owner)
        # An owner that is never closed still removes the name when collected or at exit; only a
        # killed process leaves its segment behind (see cleanup()).
        self._finalizer = weakref.finalize(self, _unlink_quietly, shm) if owner else None

    # -- creation and attachment ---------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, gate_up_shape: tuple, down_shape: tuple, dtype: torch.dtype) -> HostExpertPool:
        """Create (exclusively) a segment for banks of the given shapes; the caller fills it."""
        _require_posix()
        shm = _shm_name(name)
        item = torch.empty((), dtype=dtype).element_size()
        gu_bytes = _numel(gate_up_shape) * item
        down_offset = _HEADER + -(-gu_bytes // _ALIGN) * _ALIGN
        total = down_offset + _numel(down_shape) * item
        meta = {"dtype": str(dtype).removeprefix("torch."), "gate_up": list(gate_up_shape),
                "down": list(down_shape), "gate_up_offset": _HEADER, "down_offset": down_offset, "bytes": total}
        try:
            fd = _posixshmem.shm_open(shm, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError as exc:
            raise FileExistsError(f"shared-memory pool '{shm[1:]}' already exists (another hearth process, or a "
                                  f"crashed one: remove it with `hearth pool clean {name}`)") from exc
        try:
            os.ftruncate(fd, total)
            buf = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            _posixshmem.shm_unlink(shm)
            raise
        finally:
            os.close(fd)
        header = json.dumps(meta).encode()
        buf[: len(_MAGIC) + 12 + len(header)] = _MAGIC + struct.pack("<QI", os.getpid(), len(header)) + header
        return cls(shm, buf, meta, owner=True)

    @classmethod
    def attach(cls, name: str, writable: bool = False) -> HostExpertPool:
        """Map an existing segment by name (read-only unless ``writable``)."""
        _require_posix()
        shm = _shm_name(name)
        try:
            fd = _posixshmem.shm_open(shm, os.O_RDWR if writable else os.O_RDONLY, mode=0o600)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no shared-memory pool named '{shm[1:]}'") from exc
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        meta = read_header(buf)
        if meta["bytes"] > size:
            buf.close()
            raise ValueError(f"shared-memory pool '{shm[1:]}' is truncated")
        return cls(shm, buf, meta, owner=False)

    def _views(self, writable: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _dtype(self.meta["dtype"])
        out = []
        with warnings.catch_warnings():  # read-only mappings: torch warns that writes would fail
            warnings.simplefilter("ignore", UserWarning)
            for bank in ("gate_up", "down"):
                shape = self.meta[bank]
                t = torch.frombuffer(self._mmap, dtype=dtype, count=_numel(shape), offset=self.meta[f"{bank}_offset"])
                out.append(t.view(shape))
        return out[0], out[1]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up, self.down

    @property
    def filled(self) -> bool:
        """Whether the owner finished filling the pool (a crash mid-load leaves it unset)."""
        return self._mmap[_FILLED_AT] == 1

    def mark_filled(self) -> None:
        """Owner only: every expert is written; attachers may now trust the contents."""
        if not self.owner:
            raise PermissionError("only the pool's owner marks it filled")
        self._mmap[_FILLED_AT] = 1

    # -- release -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap (once no tensor uses the pages) and, for the owner, remove the name."""
        self.gate_up = self.down = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # other views still alive: unmapped when they go
            self._mmap.close()
        if self.owner:
            self.owner = False
            self._finalizer()

    def __enter__(self) -> HostExpertPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink_quietly(shm: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(shm)


def read_header(buf) -> dict:
    if bytes(buf[: len(_MAGIC)]) != _MAGIC:
        raise ValueError("not a hearth expert pool (bad magic)")
    pid, length = struct.unpack("<QI", bytes(buf[len(_MAGIC) : len(_MAGIC) + 12]))
    meta = json.loads(bytes(buf[len(_MAGIC) + 12 : len(_MAGIC) + 12 + length]))
    meta["owner_pid"] = pid
    return meta


def cleanup(name: str) -> bool:
    """Remove the named segment (e.g. left by a crashed owner); True if one was removed."""
    _require_posix()
    try:
        _posixshmem.shm_unlink(_shm_name(name))
        return True
    except FileNotFoundError:
        return False


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
                      "owner_alive": _alive(meta["owner_pid"])})
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _require_posix() -> None:
    if _posixshmem is None:
        raise RuntimeError("shared-memory expert pools need a POSIX system")
