// The decode kernels built for AVX-512 with VNNI: decode.cpp under this library's module name, with the
// int8-activation kernels of q8.h (the opt-in mode) compiled in.
#define HEARTH_DECODE_MODULE _native_avx512vnni
#include "decode.cpp"
