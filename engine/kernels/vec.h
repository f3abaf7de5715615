// The fp32 vector the block kernels (blocks.h, fp8.h) compute in, as wide as the instruction set this
// translation unit is compiled for: 16 lanes with AVX-512 (F + BW), 8 with AVX2 + FMA. Widening a
// format's stored values into it stays with each format.
#pragma once

#include "native.h"

namespace hearth::vec {

// Sum of the 8 lanes (the float kernels of decode_avx2.cpp reduce with it too).
inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x55));
  return _mm_cvtss_f32(lo);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf loadf(const float* p) { return _mm512_loadu_ps(p); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void storef(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kLanes = 8;
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf loadf(const float* p) { return _mm256_loadu_ps(p); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void storef(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline float hsum(vf v) { return hsum8(v); }
#endif

}  // namespace hearth::vec
