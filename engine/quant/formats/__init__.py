"""The block formats, one module each: GGML's as llama.cpp lays them out (Q8_0, Q4_0, the K-quants,
MXFP4; fp16 fields little-endian) and hearth's own layouts for checkpoints' formats that GGML has no
type for (FP8 e4m3, bf16: repacked from Hugging Face checkpoints at load, or a bf16 GGUF tensor's
bytes as stored, never written to GGUF files).

Each module builds one :class:`~hearth.engine.quant.block.BlockFormat` named ``FORMAT``: its block
size, GGML type, torch decoder (the reference the native kernels are tested against, itself tested
against the ``gguf`` package's dequantizer, byte for byte the format's definition) and encoder, its
entry in the native kernels (``kernels/cpu/blocks.h``), whether the int8-activation mode has a kernel
for it, and the mixes it takes part in. ``quant/registry.py`` lists them.
"""
