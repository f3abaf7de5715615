"""The int8-activation mode: opt-in, off by default, not exact.

llama.cpp's CPU kernels quantize each activation row to int8 (one scale per 256 elements) before
multiplying it with K-quant weights. hearth's default keeps activations in fp32, so that a quantized
model matches its reference within 1e-6 relative (fp32 activations meet the GGML formats' weights
split into three int8 pieces, 21 bits of each block; see kernels/cpu/q8.h). This mode does what
llama.cpp does for the formats that have that kernel: for decode steps of up to 8 tokens,
projections and experts in those formats multiply one int8 piece with their weights (vpdpbusd, or
AVX2's vpmaddubsw), about 1.3-1.7x as fast per product as three pieces. Every other weight, and
prefill, keeps fp32 activations.

What it costs in accuracy is measured in ``tests/test_int8_mode.py`` and stated in
docs/quantization.md. ``hearth serve --int8-activations`` (``EngineConfig(int8_activations=True)``)
turns it on.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from hearth.engine.kernels.cpu import cpu_decode_ops, dispatch
from hearth.engine.quant.registry import REGISTRY

log = logging.getLogger(__name__)
FORMATS = REGISTRY.int8_formats()  # the formats with an int8-activation kernel (each format's module says)


def available() -> bool:
    """Whether this machine's kernels have the mode (any x86-64 decode library: AVX2 and wider)."""
    ops = cpu_decode_ops()
    return ops is not None and ops.int8_activations


def enable(model, pool) -> int:
    """Mark every weight in a format with an int8-activation kernel (block weights of ``model`` and
    the expert layers of ``pool``) to be multiplied in the mode; returns how many were marked (0, with
    a warning, where the kernels are not available)."""
    if not available():
        log.warning("hearth: --int8-activations needs the native kernels (an x86-64 CPU with AVX2); "
                    "keeping fp32 activations")
        return 0
    marked = 0
    for tensor in [*model.parameters(), *model.buffers()]:  # fused q/k/v weights are buffers
        fmt = getattr(tensor, "block_format", None)
        if fmt is not None and fmt.name in FORMATS:
            tensor.int8_activations = True
            marked += 1
    if pool.blocks is not None:
        for layer, blocks in pool.blocks.items():
            if {blocks.gate_up.name, blocks.down.name} & FORMATS:
                pool.blocks[layer] = dataclasses.replace(blocks, int8_activations=True)
                marked += 1
    return marked


def model_formats(model, pool) -> set[str]:
    """The formats with an int8-activation kernel that ``model``'s weights and ``pool``'s experts use."""
    found = {fmt.name for t in [*model.parameters(), *model.buffers()]
             if (fmt := getattr(t, "block_format", None)) is not None}
    if pool.blocks is not None:
        found |= {name for b in pool.blocks.values() for name in (b.gate_up.name, b.down.name)}
    return found & FORMATS


def read_rate_gbps(megabytes: int = 256) -> float:
    """This machine's streaming read rate with torch's threads (GB/s, best of three sums over a
    buffer no cache holds)."""
    buf = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def hint(formats: set[str], read_gbps: float | None = None) -> str | None:
    """One line for a user running the exact mode where arithmetic, not memory, bounds its products:
    the flag, the speed-up to expect, and the mode's tolerance; None where the mode would not pay
    (the products already keep up with memory, or the model has no weight the mode applies to)."""
    ops = cpu_decode_ops()
    measured = sorted(formats & set(dispatch.FORMATS))
    if ops is None or not ops.int8_activations or not measured:
        return None
    timings = ops.choice.timings.get(ops.isa) or dispatch.measure({ops.isa: ops._decode}).timings[ops.isa]
    exact = sum(timings[f"{fmt}/1/exact"] for fmt in measured)
    int8 = sum(timings[f"{fmt}/1/int8"] for fmt in measured)
    weight_bytes = sum(dispatch.ROWS * REGISTRY.get(fmt).row_bytes(dispatch.COLS) for fmt in measured)
    exact_gbps, int8_gbps = weight_bytes / exact / 1e3, weight_bytes / int8 / 1e3  # bytes per microsecond
    read = read_gbps if read_gbps is not None else read_rate_gbps()
    speedup = min(int8_gbps, read) / min(exact_gbps, read)
    if exact_gbps >= 0.9 * read or speedup < 1.1:
        return None
    return (f"hearth: decode here is bound by arithmetic (exact {'/'.join(measured)} products at "
            f"{exact_gbps:.0f} GB/s, memory reads at {read:.0f} GB/s): --int8-activations makes them about "
            f"{speedup:.1f}x as fast, as llama.cpp computes them, with each step's logits within 5e-2 of the "
            "largest instead of exact (docs/quantization.md)")
