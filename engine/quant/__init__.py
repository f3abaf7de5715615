"""Block-quantized weights: the formats (GGML's Q8_0, Q4_0, K-quants, MXFP4) and their kernels."""
