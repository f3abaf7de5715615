// The fp32 vector the block kernels (blocks.h, fp8.h) compute in, as wide as the instruction set this
// translation unit is compiled for: 16 lanes with AVX-512 (F + BW), 8 with AVX2 + FMA. Widening a
// format's stored values into it stays with each format.
#pragma once

#include "native.h"

namespace hearth::vec {

// Sum of the 8 lanes (the float kernels of decode.cpp reduce with it too).
inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x55));
  return _mm_cvtss_f32(lo);
}

// bf16 values widened to fp32, exactly (each one's 16 bits as the fp32's high half): 8 from p, and
// with AVX-512 16.
inline __m256 widen_bf16x8(const void* p) {
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#if defined(__AVX512F__)
inline __m512 widen_bf16x16(const void* p) {
  const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

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

#if defined(__AVX512F__)
// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: pairs of vectors are interleaved and
// added, halving the count each round (about 3 instructions a sum instead of 8 for one reduction).
// Each r[i] is summed in a fixed order from v[i] alone, whatever the other vectors hold.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i)
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s8[2 * i]), b = _mm512_castps_pd(s8[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

}  // namespace hearth::vec
