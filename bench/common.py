"""Small helpers the benchmark scripts share."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path


def synthetic_prompt(vocab_size: int, length: int, salt: int = 0) -> list[int]:
    """A fixed, spread-out sequence of token ids (the same prompt in every benchmark); another
    ``salt`` gives another sequence, sharing no prefix with it."""
    span = min(vocab_size, 30000) - 1
    return [(i * 7919 + salt * 104729 + salt) % span + 1 for i in range(length)]  # ids in [1, vocab)


def emit(result: dict, path: Path | None) -> None:
    """Print the result as one JSON line, and write it (indented) to ``path`` when given."""
    print(json.dumps(result))
    if path:
        path.write_text(json.dumps(result, indent=2))


def read_rate(seconds: float = 2.0) -> float:
    """Bytes per second this machine streams from memory on all the threads torch uses (a sum over
    a 1 GiB buffer, best of several)."""
    import torch

    buf = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - start))
    return best


def last_level_cache() -> int:
    """Bytes of CPU 0's largest cache level (Linux sysfs; 0 where unknown)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)
