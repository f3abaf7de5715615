"""Random block-quantized rows for the format and kernel tests."""

from __future__ import annotations

import numpy as np

from hearth.engine.quant.formats import FORMATS


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with sane scale fields (fp16 scales in a small range, E8M0 near 127)."""
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, size=(rows * cols // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    scale = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if name in ("q8_0", "q4_0"):
        blocks[:, 0:2] = scale[:, 0:2]
    elif name in ("q4_k", "q5_k"):
        blocks[:, 0:4] = np.abs(scale.view(np.float16)).view(np.uint8)  # d and dmin
    elif name == "q6_k":
        blocks[:, 208:210] = scale[:, 0:2]
    else:  # mxfp4: exponents near 1, and the extremes
        blocks[:, 0] = rng.integers(117, 137, size=blocks.shape[0])
        blocks[:2, 0] = (0, 255)
    return blocks.reshape(rows, -1)
