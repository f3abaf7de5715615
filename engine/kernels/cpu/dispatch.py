"""Which decode library a CPU runs fastest, decided by measurement at first use and cached.

Every x86-64 decode library has the integer kernels of the GGML formats (kernels/cpu/q8.h), 256 or
512 bits wide, and a CPU usually runs several of them: an AVX-512 VNNI machine runs all but
``avxvnni``. Which is fastest depends on the core more than on its instruction sets (AMD's Zen 4
runs 512-bit instructions as two halves; Intel's server cores lower their clock for them), so
instead of assuming the widest wins, a short micro-benchmark times each runnable library on the
products decode spends its time in: (format, token count, activation mode) for Q4_K, Q6_K and Q8_0
weights small enough to stay in the core's caches, so that arithmetic, not memory, decides. The
library with the least total time is chosen for the process (a decode step's fused layer runs in
one library), and the choice, with every timing, is cached under the user's cache directory, keyed
by the kernels' sources and the CPU. ``HEARTH_CPU_ISA`` pins a library instead; ``hearth inspect``
prints the choice and why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from hearth.engine.quant.registry import REGISTRY, quantize

log = logging.getLogger(__name__)
FORMATS = ("q4_k", "q6_k", "q8_0")  # the experts' and attention's usual formats in Q4_K_M and Q8_0 files
TOKENS = (1, 4)  # a lone decode stream, and a small batch
ROWS, COLS = 1024, 2048  # Q4_K 1.1 MiB: in the caches of every CPU measured, so arithmetic decides
REPEATS = 9


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The chosen decode library (``isa``: avx512vnni, avx512, avxvnni or avx2), why, and the
    measured time of each case per library (microseconds, best of the repeats; empty where nothing
    was measured)."""

    isa: str
    reason: str
    timings: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def cache_key(source_hash: str | None, features: int) -> str:
    """What a cached choice holds for: these kernels' sources on this CPU."""
    return f"{source_hash}-{features}-{_cpu_model()}"


def choose(libraries: dict[str, ModuleType], cache_file: Path | None, key: str) -> KernelChoice:
    """The fastest of ``libraries`` (isa -> loaded module, widest first): read from ``cache_file``
    where it holds ``key``, else measured and written there."""
    if len(libraries) == 1:
        return KernelChoice(next(iter(libraries)), "the only decode library this CPU runs")
    cached = _read(cache_file, key)
    if cached is not None and cached.isa in libraries:
        return dataclasses.replace(cached, reason=f"{cached.reason} (cached in {cache_file})")
    choice = measure(libraries)
    _write(cache_file, key, choice)
    return choice


def measure(libraries: dict[str, ModuleType]) -> KernelChoice:
    """Time every library on every case, rounds interleaved, and choose the least total time."""
    cases = _cases()
    timings: dict[str, dict[str, float]] = {isa: {} for isa in libraries}
    threads = torch.get_num_threads()
    for _ in range(REPEATS):
        for isa, module in libraries.items():
            for name, case in cases.items():
                start = time.perf_counter()
                module.linear_blocks(case.code, case.x.data_ptr(), case.x.shape[0], COLS, case.w.data_ptr(), ROWS,
                                     case.out.data_ptr(), threads, int(case.int8))
                spent = (time.perf_counter() - start) * 1e6
                timings[isa][name] = min(timings[isa].get(name, spent), spent)
    totals = {isa: sum(t.values()) for isa, t in timings.items()}
    best = min(totals, key=totals.get)
    widest = next(iter(libraries))
    versus = ", ".join(f"{isa} {totals[isa]:.0f} us" for isa in libraries)
    note = "" if best == widest else f"; the widest, {widest}, was slower"
    return KernelChoice(best, f"measured: least total time over {len(cases)} products ({versus}){note}",
                        {isa: {k: round(v, 1) for k, v in t.items()} for isa, t in timings.items()})


@dataclasses.dataclass(frozen=True)
class _Case:
    code: int
    x: torch.Tensor  # fp32 [tokens, COLS]
    w: torch.Tensor  # uint8 [ROWS, row bytes]
    int8: bool
    out: torch.Tensor  # fp32 [tokens, ROWS]


def _cases() -> dict[str, _Case]:
    """Each (format, tokens, mode) as "q4_k/1/exact", with its inputs (random, seeded)."""
    codes = REGISTRY.kernel_codes()
    g = torch.Generator().manual_seed(0)
    cases = {}
    for fmt in FORMATS:
        w = quantize(torch.randn(ROWS, COLS, generator=g) * 0.02, fmt)
        for m in TOKENS:
            x = torch.randn(m, COLS, generator=g)
            for mode in ("exact", "int8"):
                cases[f"{fmt}/{m}/{mode}"] = _Case(codes[fmt], x, w, mode == "int8", torch.empty(m, ROWS))
    return cases


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(cache_file: Path | None, key: str) -> KernelChoice | None:
    if cache_file is None:
        return None
    try:
        entry = json.loads(cache_file.read_text()).get(key)
        return None if entry is None else KernelChoice(**entry)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(cache_file: Path | None, key: str, choice: KernelChoice) -> None:
    """Add the choice to the cache file (other keys kept); a cache that cannot be written is skipped."""
    if cache_file is None:
        return
    try:
        entries = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        entries = {}  # none yet, or unreadable: written anew
    if not isinstance(entries, dict):
        entries = {}
    try:
        entries[key] = choice.as_dict()
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")  # processes measuring at once write apart
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(cache_file)
    except OSError as exc:
        log.debug("hearth: kernel choice not cached (%s)", exc)
