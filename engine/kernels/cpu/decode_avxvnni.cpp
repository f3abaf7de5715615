// The decode kernels built for AVX2 + FMA + F16C with AVX-VNNI (Intel's client cores from Alder Lake,
// AMD's from Zen 5): decode.cpp under this library's module name, q8.h's 256-bit kernels on vpdpbusd.
#define HEARTH_DECODE_MODULE _native_avxvnni
#include "decode.cpp"
