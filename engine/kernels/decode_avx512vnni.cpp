// The decode kernels built for AVX-512 with VNNI: the same source as the AVX2 and AVX-512 libraries,
// under another module name, with the int8-activation kernels of q8.h (the opt-in mode) compiled in.
#define HEARTH_DECODE_MODULE _native_avx512vnni
#include "decode_avx2.cpp"
