"""FP8 e4m3, hearth's own layout (no GGML type). 128 elements a block: an fp32 scale ``s``
(little-endian), 128 float8 e4m3fn bytes ``q``; x = s·q. A checkpoint's 128×128 tile scales
(``weight_scale_inv``) are copied into the blocks of every row the tile covers, so the repacking
(``checkpoint/hf_quant.py``) loses nothing and a row of blocks stands alone (rows concatenate, as
q/k/v fusion and the expert banks need). Never encoded from floats."""

from __future__ import annotations

import torch

from hearth.engine.quant.block import BlockFormat, KernelEntry


def decode(b: torch.Tensor) -> torch.Tensor:
    scale = b[:, :4].contiguous().view(torch.float32)  # [n, 1]
    return scale * b[:, 4:].contiguous().view(torch.float8_e4m3fn).float()


FORMAT = BlockFormat("fp8_e4m3", 128, 132, -1, decode=decode, kernel=KernelEntry(6, "Fp8E4m3"))
