// q8.h's kernels 256 bits wide, for every x86-64 build without AVX-512 VNNI: 32 weight bytes (one
// 32-element block or sub-block, a "chunk") meet 32 activation bytes, summed in fours into 8 int32
// lanes, by AVX-VNNI's vpdpbusd where the build has it and otherwise by AVX2's vpmaddubsw (pairs into
// int16) and vpmaddwd (pairs of those into int32). vpmaddubsw saturates at 2^15: the formats' unsigned
// bytes are at most 63 (Q6_K); Q8_0's bytes offset by 128 (up to 255) meet only activation bytes
// within 64 (a split row's pieces, q8_top), and Q8_0's one piece (the int8 mode, up to 127) is
// multiplied as |w| with the activations carrying w's sign (vpsignb, kSigned). Included by q8.h inside
// hearth::blocks.
#pragma once

#if defined(__AVXVNNI__)
#define HEARTH_Q8_VNNI256 1
constexpr const char* kQ8Kernel = "avx-vnni";  // what `hearth inspect` names
#else
constexpr const char* kQ8Kernel = "avx2";
#endif

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
  return _mm_cvtss_f32(m);
}

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once; each r[i] from v[i] alone, in a fixed order.
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Sixteen int32 lanes (a then b, each within [-127, 127]) narrowed to 16 bytes in order.
inline __m128i narrow16(__m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Eight int32 lanes clamped to [-top, top].
inline __m256i clamp8(__m256i v, int top) {
  return _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(top)), _mm256_set1_epi32(-top));
}

// x [16] times inv, rounded to two int32 vectors clamped to [-top, top].
inline void round16(const float* x, float inv, int top, __m256i* c) {
  c[0] = clamp8(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(inv))), top);
  c[1] = clamp8(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), _mm256_set1_ps(inv))), top);
}

// One 256-element stretch x [256] quantized, as q8_512.h's (the same bytes, sums and scale).
inline float quantize_stretch(const float* xb, bool split, int top, int8_t* q8, int8_t* q2, int8_t* q3,
                              float* sum16) {
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 256; i += 8) {
    const __m256 v = _mm256_loadu_ps(xb + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
  }
  const Q8Scale sc = q8_scale(hmax8(amax), _mm256_movemask_ps(nan) != 0, static_cast<float>(top));
  for (int i = 0; i < 256; i += 16) {
    __m256i c[2];
    round16(xb + i, sc.inv, top, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + i), narrow16(c[0], c[1]));
    float sum = static_cast<float>(hsum_epi32(_mm256_add_epi32(c[0], c[1])));
    if (split) {
      // Remainders against the scale the products use (d exactly; d / 128 and d / 128^2 are exact too).
      // Each remainder is within half a step, so the clamps to 64 only guard the kernels' bound.
      __m256 r1[2], r2[2];
      __m256i c2[2], c3[2];
      for (int h = 0; h < 2; ++h) {
        r1[h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c[h]), _mm256_set1_ps(sc.d), _mm256_loadu_ps(xb + i + 8 * h));
        c2[h] = clamp8(_mm256_cvtps_epi32(_mm256_mul_ps(r1[h], _mm256_set1_ps(128.0f * sc.inv))), 64);
        r2[h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c2[h]), _mm256_set1_ps(sc.d / 128.0f), r1[h]);
        c3[h] = clamp8(_mm256_cvtps_epi32(_mm256_mul_ps(r2[h], _mm256_set1_ps(16384.0f * sc.inv))), 64);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i), narrow16(c2[0], c2[1]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q3 + i), narrow16(c3[0], c3[1]));
      sum += static_cast<float>(hsum_epi32(_mm256_add_epi32(c2[0], c2[1]))) / 128.0f +
             static_cast<float>(hsum_epi32(_mm256_add_epi32(c3[0], c3[1]))) / 16384.0f;
    }
    sum16[i / 16] = sum;
  }
  return sc.d;
}

// Products of 32 unsigned weight bytes u with 32 signed activation bytes s, summed in fours (int32 [8]),
// weighted by `scale` (an int16 multiplier) on the AVX2 path.
inline __m256i dot4(__m256i u, __m256i s, int16_t scale = 1) {
#ifdef HEARTH_Q8_VNNI256
  (void)scale;
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(scale));
#endif
}

// The activation bytes at p, given the sign of the weight bytes w where the kernel multiplies |w|.
template <bool Signed>
inline __m256i activations(const int8_t* p, __m256i w) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (Signed) return _mm256_sign_epi8(x, w);
  (void)w;
  return x;
}

// The int32 lanes of the weight bytes w times the activation bytes at x + at, as fp32: for one piece
// (P = 1) the products, for a split row (P = 3) the three pieces joined in the integers as
// 128^2 p1 + 128 p2 + p3 (at most 4 * 255 * 64 * 128^2 * 1.008 < 2^31 for Q8_0's offset bytes, whose
// split rows' pieces are all within 64; the other formats' bytes are at most 63), so the caller
// scales these lanes by 1 / 128^2 more. Signed: w are signed bytes (Q8_0 in the int8 mode on AVX2,
// whose one piece reaches 127), multiplied as |w| times x with w's sign.
template <int P, bool Signed>
inline __m256 piece_products(__m256i w, const Q8Row& x, int64_t at) {
  const __m256i u = Signed ? _mm256_abs_epi8(w) : w;
#ifdef HEARTH_Q8_VNNI256
  __m256i p = dot4(u, activations<Signed>(x.q + at, w));
  if constexpr (P == 3) {
    p = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(p, 7), u, activations<Signed>(x.q2 + at, w));
    p = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(p, 7), u, activations<Signed>(x.q3 + at, w));
  }
#else
  __m256i p = dot4(u, activations<Signed>(x.q + at, w), P == 3 ? 16384 : 1);
  if constexpr (P == 3) {
    p = _mm256_add_epi32(p, dot4(u, activations<Signed>(x.q2 + at, w), 128));
    p = _mm256_add_epi32(p, dot4(u, activations<Signed>(x.q3 + at, w)));
  }
#endif
  return _mm256_cvtepi32_ps(p);
}

template <int P>
constexpr float kPieceScale = P == 3 ? 1.0f / 16384.0f : 1.0f;

// Whether F's bytes are multiplied signed (|w| times the activations with w's sign) for P pieces: Q8_0's
// one piece on AVX2, which reaches 127, where 255 * 127 twice would saturate vpmaddubsw. Elsewhere Q8_0's
// bytes are offset by 128 (a sign-bit flip) and the offset comes back out through the activations'
// sums per 32: one XOR per chunk instead of a sign transfer per piece.
template <typename F, int P>
#ifdef HEARTH_Q8_VNNI256
constexpr bool kSigned = false;
#else
constexpr bool kSigned = std::is_same_v<F, Q8_0> && P == 1;
#endif

// A stretch (q8.h) as weight = q * scale + offset per 32 elements, q the byte the kernel multiplies:
// d*sc and -dmin*m for Q4_K / Q5_K; for the 32-element formats the block's scale and -z times it, z
// what makes their values unsigned (Q4_0: 8, its nibbles as they are; MXFP4: 12, added by the table
// that reads its E2M1 codes as doubled integers; Q8_0: 128, or none where its bytes are multiplied
// signed).
template <typename F>
constexpr float kZero = std::is_same_v<F, Q8_0> ? 128.0f : std::is_same_v<F, Q4_0> ? 8.0f : 12.0f;

// A Q4_K / Q5_K super-block's 8 scales d*sc and offsets -dmin*m: k_fields (blocks.h) widened and scaled.
inline void k_scales8(const uint8_t* b, __m256* scale, __m256* offset) {
  const __m128i fields = k_fields(b);
  *scale = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields)), _mm256_set1_ps(half_to_float(b)));
  *offset = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8))),
                          _mm256_set1_ps(-half_to_float(b + 2)));
}

template <typename F>
inline void stretch_scales(const uint8_t* blk, __m256* scale, __m256* offset) {
  if constexpr (F::kElems == 32) {
    *scale = block_scales8<F>(blk);
    *offset = _mm256_mul_ps(*scale, _mm256_set1_ps(-kZero<F>));
  } else {
    k_scales8(blk, scale, offset);
  }
}

// Bit s of every byte of v moved to bit 4 (0 <= s < 8), nothing else: a 16-bit shift keeps each
// byte's bit 4 within its own byte for shifts from -3 to 4.
inline __m256i bit_to_4(__m256i v, int s) {
  const __m256i moved = s <= 4 ? _mm256_slli_epi16(v, 4 - s) : _mm256_srli_epi16(v, s - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// The 32 weight bytes of chunk c (elements 32c .. 32c + 31) of a stretch: Q4_K's low (even c) or high
// (odd c) nibbles of its 32 bytes for sub-blocks c - c % 2 and c + 1 - c % 2; Q5_K's the same with bit c
// of each of its 32 high-bit bytes qh moved to bit 4; Q8_0's block c as it is (signed; the caller
// flips the sign bits where the bytes are offset); Q4_0's and
// MXFP4's block c, its 16 bytes' low nibbles (elements 0-15) then high (16-31), MXFP4's codes through
// a byte table to doubled value + 12.
template <typename F>
inline __m256i chunk_bytes(const uint8_t* blk, int c, __m256i qh) {
  if constexpr (std::is_same_v<F, Q8_0>) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * Q8_0::kBytes + 2));
  } else if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Mxfp4>) {
    constexpr int kQs = std::is_same_v<F, Q4_0> ? 2 : 1;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + c * F::kBytes + kQs));
    const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    if constexpr (std::is_same_v<F, Q4_0>) {
      return n;
    } else {  // kMxfp4Values + 12
      const __m128i t = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
      return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), n);
    }
  } else {
    constexpr bool q5 = std::is_same_v<F, Q5_K>;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (q5 ? 48 : 16) + 32 * (c / 2)));
    __m256i w = _mm256_and_si256(c % 2 == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    if constexpr (q5) w = _mm256_or_si256(w, bit_to_4(qh, c));
    return w;
  }
}

#ifndef HEARTH_Q8_VNNI256
// One piece on AVX2: the K-quants' integer sub-block scales are vpmaddwd's multiplier, so products and
// scales are summed in int32 and converted once per super-block, as llama.cpp's AVX2 kernels do (a
// lane's sum at most 8 * 2 * (2 * 31 * 127) * 63 < 2^24 for Q4_K / Q5_K, exact in fp32). An integer
// add per chunk and token instead of a conversion and a multiply-add.
template <typename F, int M>
inline void row_acc_k_q8_int(const uint8_t* row, int64_t K, const Q8Row* xs, __m256* out) {
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    prefetch_ahead(blk, F::kBytes);
    const __m128i fields = k_fields(blk);
    alignas(16) int16_t sc[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(sc), _mm_cvtepu8_epi16(fields));
    const __m256 offset = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8))),
                                        _mm256_set1_ps(-half_to_float(blk + 2)));
    const float d = half_to_float(blk);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (std::is_same_v<F, Q5_K>) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    __m256i acci[M][2];
    for (int m = 0; m < M; ++m) acci[m][0] = acci[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i w = chunk_bytes<F>(blk, c, qh);
      for (int m = 0; m < M; ++m)
        acci[m][c & 1] = _mm256_add_epi32(acci[m][c & 1], dot4(w, activations<false>(xs[m].q + 256 * b + 32 * c, w),
                                                                 sc[c]));
    }
    for (int m = 0; m < M; ++m) {
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(acci[m][0], acci[m][1]));
      acc[m] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d * xs[m].d[b]), acc[m]);
      macc[m] = _mm256_fmadd_ps(offset, _mm256_mul_ps(_mm256_loadu_ps(xs[m].sum32 + 8 * b),
                                                      _mm256_set1_ps(xs[m].d[b])), macc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm256_add_ps(acc[m], macc[m]);
}
#endif

// Q4_K, Q5_K, Q8_0, Q4_0 or MXFP4 row (F) . quantized activations for M tokens, left as one vector per
// token whose 8 lanes sum to the product (rows_dot_q8_range sums eight rows' vectors at once). Each
// chunk's 32 weight bytes meet the activations' 32 bytes (piece_products); the int32 lanes are scaled
// by the chunk's scale. The offsets come in once per stretch through the activations' sums per 32.
// Per token: sum_b dx_b * (sum_c scale_c * sum(q x) + offset_c * sum x).
template <typename F, int M, int P = 1>
inline void row_acc_k_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m256* out) {
#ifndef HEARTH_Q8_VNNI256
  if constexpr (P == 1 && (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>)) {
    row_acc_k_q8_int<F, M>(row, K, xs, out);
    return;
  }
#endif
  constexpr bool kSignedQ = kSigned<F, P>;
  constexpr bool kOffsets = !kSignedQ;
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * kStretchBytes<F>;
    prefetch_ahead(blk, kStretchBytes<F>);
    __m256 scale, offset;
    stretch_scales<F>(blk, &scale, &offset);
    const __m256 sp = _mm256_mul_ps(scale, _mm256_set1_ps(kPieceScale<P>));  // the products' scales
    __m256i qh = _mm256_setzero_si256();
    if constexpr (std::is_same_v<F, Q5_K>) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    __m256 accb[M][2];  // even and odd chunks: two chains of multiply-adds, not one of eight
    for (int m = 0; m < M; ++m) accb[m][0] = accb[m][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i w = chunk_bytes<F>(blk, c, qh);
      if constexpr (std::is_same_v<F, Q8_0> && !kSignedQ)
        w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256 s = _mm256_permutevar8x32_ps(sp, _mm256_set1_epi32(c));
      for (int m = 0; m < M; ++m)
        accb[m][c & 1] =
            _mm256_fmadd_ps(piece_products<P, kSignedQ>(w, xs[m], 256 * b + 32 * c), s, accb[m][c & 1]);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 dx = _mm256_set1_ps(xs[m].d[b]);
      acc[m] = _mm256_fmadd_ps(_mm256_add_ps(accb[m][0], accb[m][1]), dx, acc[m]);
      if constexpr (kOffsets)
        macc[m] = _mm256_fmadd_ps(offset, _mm256_mul_ps(_mm256_loadu_ps(xs[m].sum32 + 8 * b), dx), macc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm256_add_ps(acc[m], macc[m]);
}

// Q6_K row . quantized activations for M tokens, one vector per token as row_acc_k_q8. Per 128
// elements (half n of a super-block) the four quarters' 6-bit values, unsigned (0..63), are
// assembled one register each in the row's order (quarter j: nibble j / 2 of ql's bytes 32 (j % 2)
// onward, bits 2j, 2j + 1 of qh's 32 bytes as bits 4, 5); lanes 0-3 of a quarter's products take its
// first 16-element group's d*sc, lanes 4-7 the second's. The -32 offset comes in once per
// super-block through the activations' sums per 16.
template <int M, int P = 1>
inline void row_acc_q6_k_q8(const uint8_t* row, int64_t K, const Q8Row* xs, __m256* out) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < K / Q6_K::kElems; ++b) {
    const uint8_t* blk = row + b * Q6_K::kBytes;
    prefetch_ahead(blk, Q6_K::kBytes);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m256 d = _mm256_set1_ps(half_to_float(blk + 208));
    const __m256 scale[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
    __m256 accb[M][2];  // quarters 0, 2 and 1, 3: two chains of multiply-adds
    for (int m = 0; m < M; ++m) accb[m][0] = accb[m][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n));
      const __m256 sp = _mm256_mul_ps(scale[n], _mm256_set1_ps(kPieceScale<P>));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * n + 32 * (j % 2)));
        const __m256i lo = _mm256_and_si256(j < 2 ? ql : _mm256_srli_epi16(ql, 4), nib);
        const int sh = 4 - 2 * j;  // bits 2j, 2j + 1 to bits 4, 5 (16-bit shifts, as bit_to_4's)
        const __m256i hi = _mm256_and_si256(sh >= 0 ? _mm256_slli_epi16(qh, sh) : _mm256_srli_epi16(qh, -sh), two);
        const __m256i u = _mm256_or_si256(lo, hi);
        const __m256 s = _mm256_permutevar8x32_ps(sp, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1,
                                                                        2 * j + 1, 2 * j + 1, 2 * j + 1));
        for (int m = 0; m < M; ++m)
          accb[m][j & 1] = _mm256_fmadd_ps(piece_products<P, false>(u, xs[m], 256 * b + 128 * n + 32 * j), s,
                                           accb[m][j & 1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      // sum_g d*sc_g * sum x_g, the sixteen groups folded onto eight lanes
      const __m256 off = _mm256_fmadd_ps(scale[1], _mm256_loadu_ps(xs[m].sum16 + 16 * b + 8),
                                         _mm256_mul_ps(scale[0], _mm256_loadu_ps(xs[m].sum16 + 16 * b)));
      const __m256 sum = _mm256_add_ps(accb[m][0], accb[m][1]);
      acc[m] = _mm256_fmadd_ps(_mm256_fnmadd_ps(off, _mm256_set1_ps(32.0f), sum), _mm256_set1_ps(xs[m].d[b]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m];
}

// Rows [r0, r1) eight at a time for kM tokens: fill(r, n, part) leaves the per-token vectors of rows
// r .. r + n - 1 (n <= 8) in part[t][0 .. n); the rest are zeroed, and transpose_sum8 sums each row's
// vector into out[t][row - r0] (a row's sum from its own vector alone).
template <int kM, typename Fill>
inline void sum8_rows(int64_t r0, int64_t r1, float* const* out, const Fill& fill) {
  __m256 part[kM][8];  // [token][row of the eight]
  for (int64_t r = r0; r < r1; r += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, r1 - r));
    fill(r, n, part);
    for (int i = n; i < 8; ++i)
      for (int t = 0; t < kM; ++t) part[t][i] = _mm256_setzero_ps();
    for (int t = 0; t < kM; ++t) {
      const __m256 s = transpose_sum8(part[t]);
      if (n == 8) {
        _mm256_storeu_ps(out[t] + (r - r0), s);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, s);
        std::memcpy(out[t] + (r - r0), tmp, n * sizeof(float));
      }
    }
  }
}
