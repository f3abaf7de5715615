// Activations quantized to int8 per 256 elements and multiplied with Q4_K / Q6_K weights by AVX-512
// VNNI (vpdpbusd: 64 unsigned weight bytes times 64 signed activation bytes, summed in fours into 16
// int32 lanes), in two uses:
// - the int8-activation mode (opt-in): one piece, as llama.cpp's CPU kernels do (its Q8_K), every
//   activation rounded to 1/254 of its block's largest magnitude (docs/quantization.md measures the
//   error);
// - fp32 activations (the default): three pieces, x ~ d * (q1 + q2 / 128 + q3 / 128^2), which keep
//   about 21 bits of the block's largest magnitude; the three products are joined in the integers.
// Either needs far fewer instructions per weight than the fp32-activation kernels of blocks.h (a
// vpdpbusd covers 64 weights; the fp32 kernels take a table lookup and a multiply-add per 16).
// Included by blocks.h inside hearth::blocks; compiled only where the build targets VNNI.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HEARTH_Q8_ACTIVATIONS 1

// One activation row quantized: q [K] int8, per 256 elements a scale d (x ~ d * q), and the sums of
// q per 32 and per 16 elements (as floats) for the formats' offset terms. A split row (q2, q3 not
// null) carries two more pieces: x ~ d * (q + q2 / 128 + q3 / 128^2), q2 and q3 in [-64, 64], so it
// keeps 21 bits of each block's largest magnitude (its error at most 2.4e-7 of it) where one piece keeps 7.
struct Q8Row {
  const int8_t* q;
  const float* d;
  const float* sum32;
  const float* sum16;
  const int8_t* q2 = nullptr;
  const int8_t* q3 = nullptr;
};

// Storage for a few quantized rows of K elements (K a multiple of 256), in one piece or three.
struct Q8Rows {
  int64_t K = 0;
  bool split = false;
  std::vector<int8_t> q, q2, q3;
  std::vector<float> d, sum32, sum16;
  void resize(int64_t rows, int64_t k, bool three = false) {
    K = k;
    split = three;
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
  // Row r from x [K]: q = round(x / d) with d = max |x| / 127 per 256 (round to nearest even); split,
  // the remainders' pieces q2 = round(r1 * 128 / d), q3 = round(r2 * 128^2 / d).
  void quantize(int64_t r, const float* x) {
    int8_t* q8 = q.data() + r * K;
    for (int64_t b = 0; b < K / 256; ++b) {
      const float* xb = x + 256 * b;
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < 256; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
      const float m = _mm512_reduce_max_ps(amax);
      const float scale = m / 127.0f, inv = m > 0.f ? 127.0f / m : 0.f;
      d[r * K / 256 + b] = scale;
      for (int i = 0; i < 256; i += 16) {
        const __m512 xv = _mm512_loadu_ps(xb + i);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(xv, _mm512_set1_ps(inv)));
        const __m512i c = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + 256 * b + i), _mm512_cvtepi32_epi8(c));
        float sum = static_cast<float>(_mm512_reduce_add_epi32(c));
        if (split) {
          // Remainders against the scale the products use (d exactly; d / 128 and d / 128^2 are exact too).
          const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(scale), xv);
          const __m512i c2 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, _mm512_set1_ps(128.0f * inv)));
          const __m512 r2 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(scale / 128.0f), r1);
          const __m512i c3 = _mm512_cvtps_epi32(_mm512_mul_ps(r2, _mm512_set1_ps(16384.0f * inv)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q2.data() + r * K + 256 * b + i), _mm512_cvtepi32_epi8(c2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q3.data() + r * K + 256 * b + i), _mm512_cvtepi32_epi8(c3));
          sum += static_cast<float>(_mm512_reduce_add_epi32(c2)) / 128.0f +
                 static_cast<float>(_mm512_reduce_add_epi32(c3)) / 16384.0f;
        }
        sum16[r * K / 16 + 16 * b + i / 16] = sum;
      }
      for (int g = 0; g < 8; ++g)
        sum32[r * K / 32 + 8 * b + g] = sum16[r * K / 16 + 16 * b + 2 * g] + sum16[r * K / 16 + 16 * b + 2 * g + 1];
    }
  }
};

// The int32 lanes of w (unsigned) times activation bytes at x, as fp32: for one piece (P = 1) the
// products, for a split row (P = 3) the three pieces joined in the integers as 128^2 p1 + 128 p2 + p3
// (at most 4 * 255 * 127 * 128^2 * 1.004 < 2^31 with Q8_0's offset weight bytes, the largest), so the
// caller scales these lanes by 1 / 128^2 more.
template <int P>
inline __m512 piece_products(__m512i w, const Q8Row& x, int64_t at) {
  __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x.q + at));
  if constexpr (P == 3) {
    p = _mm512_dpbusd_epi32(_mm512_slli_epi32(p, 7), w, _mm512_loadu_si512(x.q2 + at));
    p = _mm512_dpbusd_epi32(_mm512_slli_epi32(p, 7), w, _mm512_loadu_si512(x.q3 + at));
  }
  return _mm512_cvtepi32_ps(p);
}

// What piece_products' lanes are scaled by beyond the weights' scales: 1, or 1 / 128^2 for a split row.
template <int P>
constexpr float kPieceScale = P == 3 ? 1.0f / 16384.0f : 1.0f;

// Q4_K or Q5_K row (F) . quantized activations for M tokens, left as one vector per token whose 16
// lanes sum to the product (rows_dot_q8_range sums sixteen rows' vectors at once). Per 64-element
// chunk the 32 nibble bytes are broadcast to both register halves and shifted by 0 (low half: the
// first sub-block) or 4 (high half: the second) and masked; Q5_K's fifth bits (bit 2j or 2j + 1 of its
// 32 high-bit bytes) are rotated to bit 4 of each byte and joined in. The 64 weight bytes meet the
// activations' 64 bytes in one vpdpbusd per piece; the int32 lanes are scaled by their sub-block's
// d*sc. The mins come in once per super-block through the activations' sums per 32. Per token:
// sum_b dx_b * (sum_g d*sc_g * sum(q x) - dmin*m_g * sum x).
template <typename F, int M, int P = 1>
inline void row_acc_k_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m512* out) {
  constexpr bool q5 = std::is_same_v<F, Q5_K>;
  constexpr int kQs = q5 ? 48 : 16;  // where the nibbles start (Q5_K's high bits come first)
  __m512 acc[M];
  __m256 macc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), macc[m] = _mm256_setzero_ps();
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < K / F::kElems; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    prefetch_ahead(blk, F::kBytes);
    const __m512 sb = k_scales16(blk);  // d*sc_g (lanes 0-7), -dmin*m_g (lanes 8-15)
    const __m512 sp = _mm512_mul_ps(sb, _mm512_set1_ps(kPieceScale<P>));  // the products' scales
    __m512i qh = _mm512_setzero_si512();
    if constexpr (q5) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    __m512 accb[M];
    for (int m = 0; m < M; ++m) accb[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 32 * j)));
      __m512i w = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), low4);
      if constexpr (q5) {  // bit 2j (low half) or 2j + 1 (high half) of each byte to bit 4: a rotation in 64 bits
        const __m512i rot = _mm512_setr_epi64((4 - 2 * j) & 63, (4 - 2 * j) & 63, (4 - 2 * j) & 63, (4 - 2 * j) & 63,
                                              (3 - 2 * j) & 63, (3 - 2 * j) & 63, (3 - 2 * j) & 63, (3 - 2 * j) & 63);
        w = _mm512_or_si512(w, _mm512_and_si512(_mm512_rolv_epi64(qh, rot), _mm512_set1_epi8(0x10)));
      }
      const __m512 s = _mm512_permutexvar_ps(
          _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                            2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1),
          sp);
      for (int m = 0; m < M; ++m) accb[m] = _mm512_fmadd_ps(piece_products<P>(w, xs[m], 256 * b + 64 * j), s, accb[m]);
    }
    const __m256 mins = _mm512_extractf32x8_ps(sb, 1);
    for (int m = 0; m < M; ++m) {
      const __m512 dx = _mm512_set1_ps(xs[m].d[b]);
      acc[m] = _mm512_fmadd_ps(accb[m], dx, acc[m]);
      macc[m] = _mm256_fmadd_ps(mins, _mm256_mul_ps(_mm256_loadu_ps(xs[m].sum32 + 8 * b), _mm512_castps512_ps256(dx)),
                                macc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(acc[m], _mm512_zextps256_ps512(macc[m]));
}

// Q8_0 row . quantized activations for M tokens, one vector per token as row_acc_k_q8. Per 64
// elements (two blocks) the 64 signed weight bytes are offset by 128 (a sign-bit flip) to make
// vpdpbusd's unsigned operand, and each int32 lane is scaled by its block's d; the offset comes back
// out once per 256 elements through the activations' sums per 32: per token
// sum_b dx_b * sum_i d_i * (sum((q + 128) x) - 128 sum x) over the eight blocks i of 256 elements.
template <int M, int P = 1>
inline void row_acc_q8_0_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m512* out) {
  __m512 acc[M];
  __m256 macc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), macc[m] = _mm256_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * 8 * Q8_0::kBytes;  // eight blocks of 34 bytes
    prefetch_ahead(blk, 8 * Q8_0::kBytes);
    alignas(32) float dv[8];
    for (int i = 0; i < 8; ++i) dv[i] = half_to_float(blk + i * Q8_0::kBytes);
    const __m256 d8 = _mm256_load_ps(dv);
    const __m512 sp = _mm512_mul_ps(_mm512_castps256_ps512(d8), _mm512_set1_ps(kPieceScale<P>));
    __m512 accb[M];
    for (int m = 0; m < M; ++m) accb[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const uint8_t* b0 = blk + 2 * j * Q8_0::kBytes + 2;
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + Q8_0::kBytes)), 1);
      const __m512i w = _mm512_xor_si512(v, flip);
      const __m512 s = _mm512_permutexvar_ps(
          _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                            2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1),
          sp);
      for (int m = 0; m < M; ++m) accb[m] = _mm512_fmadd_ps(piece_products<P>(w, xs[m], 256 * b + 64 * j), s, accb[m]);
    }
    const __m256 off = _mm256_mul_ps(d8, _mm256_set1_ps(-128.0f));
    for (int m = 0; m < M; ++m) {
      const __m512 dx = _mm512_set1_ps(xs[m].d[b]);
      acc[m] = _mm512_fmadd_ps(accb[m], dx, acc[m]);
      macc[m] = _mm256_fmadd_ps(off, _mm256_mul_ps(_mm256_loadu_ps(xs[m].sum32 + 8 * b), _mm512_castps512_ps256(dx)),
                                macc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(acc[m], _mm512_zextps256_ps512(macc[m]));
}

// Q6_K row . quantized activations for M tokens, one vector per token as row_acc_k_q8. Per 128
// elements (half n of a super-block) the 6-bit values, unsigned (0..63), are assembled in two registers of 64 bytes (quarters 0, 1 and quarters
// 2, 3, each in the row's element order); each vpdpbusd lane (four elements) is scaled by its
// 16-element group's d*sc. The -32 offset comes in once per super-block through the activations'
// sums per 16: per token sum_b dx_b * (sum_g d*sc_g * (sum(q x) - 32 sum x)).
template <int M, int P = 1>
inline void row_acc_q6_k_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m512* out) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / Q6_K::kElems; ++b) {
    const uint8_t* blk = row + b * Q6_K::kBytes;
    prefetch_ahead(blk, Q6_K::kBytes);
    const __m512 scale = q6_scales(blk);
    const __m512 sp = _mm512_mul_ps(scale, _mm512_set1_ps(kPieceScale<P>));  // the products' scales
    __m512 accb[M];
    for (int m = 0; m < M; ++m) accb[m] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      // The 6-bit values of quarters 0|1 and 2|3 in the row's order, and their groups' scales per
      // four lanes (one vpdpbusd lane: four elements), as blocks.h's fp32 Q6_K kernel assembles them.
      const Q6Pair a = q6_pair(blk, n, 0, sp), c = q6_pair(blk, n, 1, sp);
      for (int m = 0; m < M; ++m) {
        const int64_t at = 256 * b + 128 * n;
        accb[m] = _mm512_fmadd_ps(piece_products<P>(a.u, xs[m], at), a.s, accb[m]);
        accb[m] = _mm512_fmadd_ps(piece_products<P>(c.u, xs[m], at + 64), c.s, accb[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 off = _mm512_mul_ps(scale, _mm512_loadu_ps(xs[m].sum16 + 16 * b));  // sum_g d*sc_g * sum x_g
      acc[m] = _mm512_fmadd_ps(_mm512_fnmadd_ps(off, _mm512_set1_ps(32.0f), accb[m]), _mm512_set1_ps(xs[m].d[b]),
                               acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m];
}
#else
// Builds without VNNI: the mode's types exist so that callers compile, and no format has a kernel.
struct Q8Row {};
struct Q8Rows {
  void resize(int64_t, int64_t, bool = false) {}
  Q8Row row(int64_t) const { return {}; }
  void quantize(int64_t, const float*) {}
};
#endif
