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

from hearth.engine.kernels.cpu import cpu_decode_ops
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
