"""Named POSIX shared-memory segments: the one place that creates, maps and removes them.

Used by the host expert pool and the CPU-worker task ring. Names get the ``hearth-`` prefix so
``hearth pool list|clean`` can find them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref

try:  # CPython's POSIX shared-memory primitives (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

PREFIX = "hearth-"


def shm_name(name: str) -> str:
    """The POSIX name (``/hearth-…``) of a segment called ``name``."""
    if not name or "/" in name:
        raise ValueError(f"invalid shared-memory name '{name}'")
    return "/" + (name if name.startswith(PREFIX) else PREFIX + name)


def _require_posix() -> None:
    if _posixshmem is None:
        raise RuntimeError("shared-memory segments need a POSIX system")


def unlink(name: str) -> bool:
    """Remove the segment's name (its pages go when the last mapping does); True if it existed."""
    _require_posix()
    try:
        _posixshmem.shm_unlink(shm_name(name))
        return True
    except FileNotFoundError:
        return False


def create(name: str, size: int) -> mmap.mmap:
    """Create ``name`` exclusively with ``size`` bytes and map it read-write.
    Raises FileExistsError when a segment of that name exists."""
    _require_posix()
    shm = shm_name(name)
    fd = _posixshmem.shm_open(shm, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        _posixshmem.shm_unlink(shm)
        raise
    finally:
        os.close(fd)


def attach(name: str, writable: bool) -> mmap.mmap:
    """Map the whole existing segment ``name``. Raises FileNotFoundError when there is none."""
    _require_posix()
    fd = _posixshmem.shm_open(shm_name(name), os.O_RDWR if writable else os.O_RDONLY, mode=0o600)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


class Segment:
    """A mapped segment and who owns it. The owner removes the name on :meth:`close`, or when it is
    collected or the interpreter exits; only a killed owner leaves the name behind."""

    def __init__(self, name: str, buf: mmap.mmap, owner: bool) -> None:
        self.name = shm_name(name)[1:]
        self.buf = buf
        self.owner = owner
        self._finalizer = weakref.finalize(self, unlink, self.name) if owner else None

    def close(self) -> None:
        """Unmap (once no tensor views the pages) and, for the owner, remove the name."""
        with contextlib.suppress(BufferError):  # views still alive: unmapped when they go
            self.buf.close()
        if self.owner:
            self.owner = False
            self._finalizer()
