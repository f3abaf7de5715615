// Activations quantized to int8 per 256 elements and multiplied with block weights by integer
// dot-product instructions, in two uses:
// - the int8-activation mode (opt-in): one piece, as llama.cpp's CPU kernels do (its Q8_K), every
//   activation rounded to 1/254 of its block's largest magnitude (docs/quantization.md measures the
//   error);
// - fp32 activations (the default): three pieces, x ~ d * (q1 + q2 / 128 + q3 / 128^2), which keep
//   about 21 bits of the block's largest magnitude; the three products are joined in the integers.
// The weights: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and MXFP4, rows of a length that is a multiple of 256.
// Either needs far fewer instructions per weight than the fp32-activation kernels of blocks.h (one
// integer instruction covers 32 or 64 weights; the fp32 kernels take a conversion and a multiply-add
// per 8 or 16).
// The kernels come in two widths: q8_512.h (AVX-512 VNNI, 64 bytes a vpdpbusd) and q8_256.h (every
// other x86-64 build: AVX-VNNI's vpdpbusd on 32 bytes, or AVX2's vpmaddubsw + vpmaddwd). They
// quantize a row to the same bytes and multiply the same integers, so a token's products differ
// between them only in fp32 rounding: the summation order, and for Q8_0's one piece on AVX2 (signed
// bytes, no offset) the offset the others take out in fp32.
// Included by blocks.h inside hearth::blocks.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HEARTH_Q8_ACTIVATIONS 1
#define HEARTH_Q8_512 1
#elif defined(__AVX2__)
#define HEARTH_Q8_ACTIVATIONS 1
#endif

#ifdef HEARTH_Q8_ACTIVATIONS
// One activation row quantized: q [K] int8, per 256 elements a scale d (x ~ d * q), and the sums of
// q per 32 and per 16 elements (as floats) for the formats' offset terms. A split row (q2, q3 not
// null) carries two more pieces: x ~ d * (q + q2 / 128 + q3 / 128^2), q2 and q3 in [-64, 64], so it
// keeps 21 bits of each block's largest magnitude (its error at most 2.4e-7 of it) where one piece
// keeps 7. A split row for Q8_0 weights has q within 64 too (q8_top), 20 bits (4.8e-7).
struct Q8Row {
  const int8_t* q;
  const float* d;
  const float* sum32;
  const float* sum16;
  const int8_t* q2 = nullptr;
  const int8_t* q3 = nullptr;
};

// A block's scale d (x ~ d * q, |q| <= top: 127 for one piece, 64 for a split row) and its inverse,
// from its largest magnitude m. A block holding a NaN gets d = NaN, so that every product using it is
// NaN, as fp32's would be (the max skips NaNs); one whose largest magnitude is below 1e-30 (where
// top / m and the pieces' 128^2 * top / m would overflow) counts as zeros.
struct Q8Scale {
  float d, inv;
};
inline Q8Scale q8_scale(float m, bool nan, float top) {
  const bool zeros = !(m >= 1e-30f);
  return {nan ? std::nanf("") : zeros ? 0.f : m / top, nan || zeros ? 0.f : top / m};
}

// The bound of the first piece's bytes of a row that meets F's weights: 127, or 64 for Q8_0's split
// rows. Pieces within 64 let AVX2's vpmaddubsw take unsigned weight bytes up to 255 without
// saturating (2 * 255 * 64 < 2^15), so Q8_0's bytes offset by 128 meet all three pieces with no sign
// transfer per piece (q8_256.h). The bound depends on the format alone, so every build quantizes a
// row to the same bytes.
template <typename F>
constexpr int q8_top(bool split) {
  return split && std::is_same_v<F, Q8_0> ? 64 : 127;
}

// The bytes of a 256-element stretch of a row: one super-block, or eight 32-element blocks.
template <typename F>
constexpr int64_t kStretchBytes = F::kElems == 32 ? 8 * F::kBytes : F::kBytes;

// The scales of the eight 32-element blocks of a stretch: their fp16 d widened together, or MXFP4's
// E8M0 exponents as 2^(e - 128) (half the scale, the table's values being doubled), built from
// e8m0_half's bits: (e - 1) << 23, and 1 << (21 + e) (subnormal) below 2.
template <typename F>
inline __m256 block_scales8(const uint8_t* blk) {
  constexpr int S = F::kBytes;
  if constexpr (std::is_same_v<F, Mxfp4>) {
    const __m256i e = _mm256_setr_epi32(blk[0], blk[S], blk[2 * S], blk[3 * S], blk[4 * S], blk[5 * S], blk[6 * S],
                                        blk[7 * S]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(1 << 21), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  } else {
    uint16_t h[8];
    for (int i = 0; i < 8; ++i) std::memcpy(h + i, blk + i * S, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  }
}

#ifdef HEARTH_Q8_512
#include "q8_512.h"
#else
#include "q8_256.h"
#endif

// Storage for a few quantized rows of K elements (K a multiple of 256), in one piece or three.
struct Q8Rows {
  int64_t K = 0;
  bool split = false;
  int top = 127;  // q8_top
  std::vector<int8_t> q, q2, q3;
  std::vector<float> d, sum32, sum16;
  void resize(int64_t rows, int64_t k, bool three = false, int bound = 127) {
    K = k;
    split = three;
    top = bound;
    q.resize(rows * k);
    if (split) q2.resize(rows * k), q3.resize(rows * k);
    d.resize(rows * k / 256);
    sum32.resize(rows * k / 32);
    sum16.resize(rows * k / 16);
  }
  Q8Row row(int64_t r) const {
    return {q.data() + r * K, d.data() + r * K / 256, sum32.data() + r * K / 32, sum16.data() + r * K / 16,
            split ? q2.data() + r * K : nullptr, split ? q3.data() + r * K : nullptr};
  }
  // Row r from x [K]: q = round(x / d) with d = max |x| / top per 256 (round to nearest even); split,
  // the remainders' pieces q2 = round(r1 * 128 / d), q3 = round(r2 * 128^2 / d).
  void quantize(int64_t r, const float* x) {
    for (int64_t b = 0; b < K / 256; ++b) {
      const int64_t at = r * K + 256 * b;
      float* s16 = sum16.data() + at / 16;
      d[at / 256] = quantize_stretch(x + 256 * b, split, top, q.data() + at, split ? q2.data() + at : nullptr,
                                     split ? q3.data() + at : nullptr, s16);
      for (int g = 0; g < 8; ++g) sum32[at / 32 + g] = s16[2 * g] + s16[2 * g + 1];
    }
  }
};
#else
// Builds without the kernels (not x86-64 AVX2): the mode's types exist so that callers compile.
constexpr const char* kQ8Kernel = "";
struct Q8Row {};
struct Q8Rows {
  void resize(int64_t, int64_t, bool = false, int = 127) {}
  Q8Row row(int64_t) const { return {}; }
  void quantize(int64_t, const float*) {}
};
#endif
