"""Small helpers the benchmark scripts share."""

from __future__ import annotations

import contextlib
import json
import os
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


# The instruction sets that choose hearth's (and llama.cpp's) CPU kernels, by their /proc/cpuinfo names.
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def machine_facts() -> dict:
    """What a CPU figure depends on: date, CPU model, its family and model numbers (a VM may name the
    CPU only "AMD EPYC"; family 25 model 1 is a Zen 3, model 17 a Zen 4), cores, the instruction sets
    of ``ISA_FLAGS`` it has, and its last-level cache (a benchmark row is only a memory result if that
    cache cannot hold the model)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    family, model = fields.get("cpu family"), fields.get("model")
    return {"date": time.strftime("%Y-%m-%d"), "cpu": fields.get("model name", "unknown"),
            "cpu_id": f"family {family} model {model}" if family and model else "unknown",
            "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags],
            "last_level_cache_bytes": last_level_cache()}


def memory_share(bytes_per_token: int, tok_s: float, read_rate_b_s: float) -> dict:
    """Decode's bytes per second as a share of the measured read rate. Above 1 a cache held part of the
    weights, so the row is flagged ``cache_bound``: it is not a memory result."""
    share = bytes_per_token * tok_s / read_rate_b_s
    return {"roofline_share": share, "cache_bound": share > 1.0}


def share_label(row: dict) -> str:
    """``63 %``, or ``106 % (cache-bound)`` for a row that :func:`memory_share` flagged."""
    return f"{100 * row['roofline_share']:.0f} %" + (" (cache-bound)" if row.get("cache_bound") else "")


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
