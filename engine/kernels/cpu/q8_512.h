// q8.h's kernels for AVX-512 VNNI: vpdpbusd multiplies 64 unsigned weight bytes with 64 signed
// activation bytes, summed in fours into 16 int32 lanes. Included by q8.h inside hearth::blocks.
#pragma once

constexpr const char* kQ8Kernel = "avx512-vnni";  // what `hearth inspect` names

// Sixteen int32 lanes clamped to [-top, top].
inline __m512i clamp16(__m512i v, int top) {
  return _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(top)), _mm512_set1_epi32(-top));
}

// One 256-element stretch x [256] quantized (see Q8Rows::quantize): its scale d, the bytes q (and,
// split, q2 and q3), and the sums of the pieces per 16 elements.
inline float quantize_stretch(const float* xb, bool split, int top, int8_t* q8, int8_t* q2, int8_t* q3,
                              float* sum16) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int i = 0; i < 256; i += 16) {
    const __m512 v = _mm512_loadu_ps(xb + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  const Q8Scale sc = q8_scale(_mm512_reduce_max_ps(amax), nan != 0, static_cast<float>(top));
  for (int i = 0; i < 256; i += 16) {
    const __m512 xv = _mm512_loadu_ps(xb + i);
    const __m512i c = clamp16(_mm512_cvtps_epi32(_mm512_mul_ps(xv, _mm512_set1_ps(sc.inv))), top);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + i), _mm512_cvtepi32_epi8(c));
    float sum = static_cast<float>(_mm512_reduce_add_epi32(c));
    if (split) {
      // Remainders against the scale the products use (d exactly; d / 128 and d / 128^2 are exact too).
      const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(sc.d), xv);
      const __m512i c2 = clamp16(_mm512_cvtps_epi32(_mm512_mul_ps(r1, _mm512_set1_ps(128.0f * sc.inv))), 64);
      const __m512 r2 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(sc.d / 128.0f), r1);
      const __m512i c3 = clamp16(_mm512_cvtps_epi32(_mm512_mul_ps(r2, _mm512_set1_ps(16384.0f * sc.inv))), 64);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i), _mm512_cvtepi32_epi8(c2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q3 + i), _mm512_cvtepi32_epi8(c3));
      sum += static_cast<float>(_mm512_reduce_add_epi32(c2)) / 128.0f +
             static_cast<float>(_mm512_reduce_add_epi32(c3)) / 16384.0f;
    }
    sum16[i / 16] = sum;
  }
  return sc.d;
}

// The int32 lanes of w (unsigned) times activation bytes at x, as fp32: for one piece (P = 1) the
// products, for a split row (P = 3) the three pieces joined in the integers as 128^2 p1 + 128 p2 + p3
// (at most 4 * 255 * 64 * 128^2 * 1.008 < 2^31 for Q8_0's offset weight bytes, whose split rows'
// first piece is within 64 (q8_top); the other formats' bytes are at most 63), so the
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

// A 256-element stretch of a Q4_K / Q5_K row (one super-block) or of a Q8_0 / Q4_0 / MXFP4 row (eight
// 32-element blocks): its bytes, the scale of each 32 elements (lanes 0-7) and their offset (lanes 8-15),
// weight = q * scale + offset with q the unsigned byte the kernel multiplies: d*sc and -dmin*m for the
// K-quants; for the 32-element formats the block's scale and -z times it, z what makes their signed
// values unsigned (Q8_0: 128, a sign-bit flip; Q4_0: 8, its nibbles as they are; MXFP4: 12, added by
// the table that reads its E2M1 codes as doubled integers). kStretchBytes (q8.h) is its length.
template <typename F>
constexpr float kZero = std::is_same_v<F, Q8_0> ? 128.0f : std::is_same_v<F, Q4_0> ? 8.0f : 12.0f;

template <typename F>
inline __m512 stretch_scales(const uint8_t* blk) {
  if constexpr (F::kElems == 32) {
    const __m256 d = block_scales8<F>(blk);
    return _mm512_insertf32x8(_mm512_castps256_ps512(d), _mm256_mul_ps(d, _mm256_set1_ps(-kZero<F>)), 1);
  } else {
    return k_scales16(blk);
  }
}

// The 64 unsigned weight bytes of chunk j (elements 64j .. 64j + 63) of a stretch: Q4_K's nibbles
// broadcast to both register halves, shifted by 0 (low half: the first sub-block) or 4 (high half: the
// second) and masked; Q5_K's the same with each byte's fifth bit (bit 2j or 2j + 1 of its 32 high-bit
// bytes qh) rotated to bit 4 and joined in; Q8_0's two blocks with the sign bit flipped (q + 128); Q4_0's
// and MXFP4's two blocks of 16 nibble bytes, each broadcast to two 128-bit lanes (low nibbles then high:
// the block's element order), MXFP4's codes through a byte table to doubled value + 12.
template <typename F>
inline __m512i chunk_bytes(const uint8_t* blk, int j, __m512i qh) {
  if constexpr (std::is_same_v<F, Q8_0>) {
    const uint8_t* q = blk + 2 * j * Q8_0::kBytes + 2;
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + Q8_0::kBytes)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Mxfp4>) {
    constexpr int kQs = std::is_same_v<F, Q4_0> ? 2 : 1;
    const uint8_t* q = blk + 2 * j * F::kBytes + kQs;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + F::kBytes));
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(a)), _mm256_broadcastsi128_si256(b), 1);
    const __m512i n = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
    if constexpr (std::is_same_v<F, Q4_0>) {
      return n;
    } else {  // kMxfp4Values + 12
      const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
      return _mm512_shuffle_epi8(table, n);
    }
  } else {
    constexpr bool q5 = std::is_same_v<F, Q5_K>;
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (q5 ? 48 : 16) + 32 * j)));
    __m512i w = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)), _mm512_set1_epi8(0x0F));
    if constexpr (q5) {  // a rotation in 64 bits: bit 4 - s of each byte to bit 4 of the same byte
      const __m512i rot = _mm512_setr_epi64((4 - 2 * j) & 63, (4 - 2 * j) & 63, (4 - 2 * j) & 63, (4 - 2 * j) & 63,
                                            (3 - 2 * j) & 63, (3 - 2 * j) & 63, (3 - 2 * j) & 63, (3 - 2 * j) & 63);
      w = _mm512_or_si512(w, _mm512_and_si512(_mm512_rolv_epi64(qh, rot), _mm512_set1_epi8(0x10)));
    }
    return w;
  }
}

// Q4_K, Q5_K, Q8_0, Q4_0 or MXFP4 row (F) . quantized activations for M tokens, left as one vector per token whose
// 16 lanes sum to the product (rows_dot_q8_range sums sixteen rows' vectors at once). Each chunk's 64
// weight bytes (chunk_bytes) meet the activations' 64 bytes in one vpdpbusd per piece; the int32 lanes
// are scaled by their 32 elements' scale. The offsets come in once per stretch through the
// activations' sums per 32. Per token: sum_b dx_b * (sum_g scale_g * sum(q x) + offset_g * sum x).
template <typename F, int M, int P = 1>
inline void row_acc_k_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m512* out) {
  __m512 acc[M];
  __m256 macc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * kStretchBytes<F>;
    prefetch_ahead(blk, kStretchBytes<F>);
    const __m512 sb = stretch_scales<F>(blk);  // scales (lanes 0-7), offsets (lanes 8-15)
    const __m512 sp = _mm512_mul_ps(sb, _mm512_set1_ps(kPieceScale<P>));  // the products' scales
    __m512i qh = _mm512_setzero_si512();
    if constexpr (std::is_same_v<F, Q5_K>)
      qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    __m512 accb[M];
    for (int m = 0; m < M; ++m) accb[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i w = chunk_bytes<F>(blk, j, qh);
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
