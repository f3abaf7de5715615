// The decode kernels built for AVX-512 (F, BW, VL, DQ): decode.cpp under this library's module name;
// blocks.h picks 16-lane vectors from the compiler's target macros.
#define HEARTH_DECODE_MODULE _native_avx512
#include "decode.cpp"
