// FP8 e4m3 weights in hearth's fp8_e4m3 blocks (see hearth/engine/quant/formats.py: per 128 elements an
// fp32 scale, then 128 float8 e4m3fn bytes) times fp32 activations, for 1 to 8 tokens at once. blocks.h
// dispatches its Fp8E4m3 format here; the calling convention is its row_dot's.
//
// An e4m3 byte (s eeee mmm, exponent bias 7) becomes the fp16 with the same fields (s 0eeee mmm0000000,
// bias 15) by a shift and a mask, and the F16C / AVX-512 conversion widens that to fp32 exactly,
// subnormals included. The fp16 value is the e4m3 value times 2^-8, so the block's scale is taken times
// 2^8 (exact); each weight is then one fp32 product scale * q, as the torch decoder computes it, and
// the products are accumulated in fp32 (two accumulators per token, the same for every token count).
// The e4m3fn NaN encodings (0x7F, 0xFF) are not checked for: here they read as +-480 times the scale.
#pragma once

#include "native.h"
#include "vec.h"

namespace hearth::fp8 {

constexpr int kBlockElems = 128, kBlockBytes = 132;

using namespace hearth::vec;  // NOLINT: the lane-width vector all the block kernels compute in

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 e4m3 bytes -> their values times 2^-8: each byte into the high half of a 16-bit lane, shifted
// right by one (arithmetic: the sign lands in bits 15 and 14) and bit 14 cleared.
inline vf widen(const uint8_t* q) {
  const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 8);
  const __m256i bits = _mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_cvtph_ps(bits);
}
#else
// 8 e4m3 bytes -> their values times 2^-8 (as the 16-lane widen, on the low 8 bytes).
inline vf widen(const uint8_t* q) {
  const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m128i bits = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_cvtph_ps(bits);
}
#endif

// out[m] = row . xs[m] for M tokens, the row of K elements (K / 128 blocks).
// A block's fp32 scale (its first 4 bytes) times 2^8: the widened e4m3 codes are 2^-8 of the values
// (see widen).
inline vf block_scale(const uint8_t* blk) {
  float s;
  std::memcpy(&s, blk, 4);
  return set1(s * 256.0f);
}

template <int M>
inline void row_dot_fp8(const uint8_t* row, int64_t K, const float* const* xs, float* out) {
  constexpr int kChunks = kBlockElems / kLanes;
  vf acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
  for (int64_t b = 0; b < K / kBlockElems; ++b) {
    const uint8_t* blk = row + b * kBlockBytes;
    for (int off = 0; off < kBlockBytes; off += 64) {  // fetch ahead, as blocks.h's prefetch_ahead does
      _mm_prefetch(reinterpret_cast<const char*>(blk + 1024 + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 8192 + off), _MM_HINT_T1);
    }
    const vf scale = block_scale(blk);
    const uint8_t* q = blk + 4;
    const int64_t base = b * kBlockElems;
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      const vf w = mul(widen(q + c * kLanes), scale);
      for (int m = 0; m < M; ++m) acc[m][c % 2] = fma(w, loadf(xs[m] + base + c * kLanes), acc[m][c % 2]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(add(acc[m][0], acc[m][1]));
}

// out [K] = the row's weights in fp32 (scale * q, as the products use them).
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlockElems; ++b) {
    const uint8_t* blk = row + b * kBlockBytes;
    const vf scale = block_scale(blk);
    for (int c = 0; c < kBlockElems / kLanes; ++c) {
      storef(out + b * kBlockElems + c * kLanes, mul(widen(blk + 4 + c * kLanes), scale));
    }
  }
}

}  // namespace hearth::fp8
