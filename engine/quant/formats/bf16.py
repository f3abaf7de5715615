"""bf16 blocks, hearth's own layout (no GGML type). 32 elements a block: 32 bfloat16 values (64
bytes), no scale. A bf16 GGUF tensor's bytes as stored, so that a bf16 file computed with fp32
activations keeps its weights at their size. Never encoded from floats."""

from __future__ import annotations

import torch

from hearth.engine.quant.block import BlockFormat, KernelEntry


def decode(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


FORMAT = BlockFormat("bf16", 32, 64, -1, decode=decode, kernel=KernelEntry(7, "Bf16"))
