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


@contextlib.contextmanager
def worker_process(target, *args, failure: str):
    """``target(conn, *args)`` in a spawned process of its own (a peer engine whose OpenMP runtime must
    not share this process's): it sends "ready", then answers each job it receives until None. Yields
    ``ask(job) -> answer``; stops the process on exit. ``failure`` is the message when it never gets ready."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if parent.recv() != "ready":
        raise SystemExit(failure)

    def ask(job):
        parent.send(job)
        return parent.recv()

    try:
        yield ask
    finally:
        parent.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
