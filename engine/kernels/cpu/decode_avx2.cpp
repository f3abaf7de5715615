// The decode kernels built for AVX2 + FMA + F16C: decode.cpp under this library's module name.
#define HEARTH_DECODE_MODULE _native_avx2
#include "decode.cpp"
