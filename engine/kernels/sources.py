"""The fingerprint of the native kernels' sources, shared by the build (``setup.py``, which embeds it
in the modules) and the loader (which compares it with the sources beside the package). No imports
beyond the standard library: ``setup.py`` loads this file before anything is installed."""

from __future__ import annotations

import hashlib
from pathlib import Path


def kernel_sources(folder: Path) -> list[Path]:
    """The files a kernel build depends on."""
    return sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h"))


def source_hash(folder: Path) -> str | None:
    """A short hash of :func:`kernel_sources` (None when the folder holds none, as in some wheels)."""
    sources = kernel_sources(folder)
    if not sources:
        return None
    digest = hashlib.blake2b(digest_size=8)
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
