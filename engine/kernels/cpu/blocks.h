// Block-quantized weights (GGML layouts, see hearth/engine/quant/formats.py) times fp32 activations:
// the row dot products of a projection and of a layer's routed experts, for 1 to 8 tokens at once.
//
// A block is first unpacked into small integers plus one (scale, bias) pair per 16 elements, so that
// every weight is q * scale + bias; the unpacking is plain byte arithmetic on a few hundred bytes that
// stay in L1 (the compiler vectorises it). The products then run in fp32 registers: each 16-element
// group is widened, scaled once and multiplied into every token's accumulator, so a weight row is read
// from memory once for all the tokens of a step. Nothing is dequantized to memory (except by
// dequantize_impl, for prefill's GEMMs) and activations are not quantized: the result differs from
// fp32 on the reference's dequantized weights only in the order of fp32 accumulation (and one fused
// rounding of q * scale + bias). The exception is the build with VNNI, where the GGML formats' rows
// of a length that is a multiple of 256 go through q8.h's kernels: fp32 activations split into three
// int8 pieces (about 1e-6 relative; see split_activations), or in the opt-in int8 mode quantized to one.
//
// The vector width follows the instruction set this translation unit is compiled for (vec.h).
#pragma once

#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16w.h"
#include "fp8.h"
#include "native.h"
#include "vec.h"

namespace hearth::blocks {

using namespace hearth::vec;  // NOLINT: the lane-width vector all these kernels compute in

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline vf widen(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
#else
inline vf widen(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
#endif

constexpr int kMaxTokens = 8;
constexpr int kPrefetchBytes = 2048;  // how far ahead of the block being computed its row is fetched

// Fetch the bytes [p, p + n) of a row about to be read into L1: the products do enough work per
// byte that the hardware prefetcher alone leaves a core waiting on memory.
inline void prefetch_ahead(const uint8_t* p, int n) {
  for (int off = 0; off < n; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes / 2 + off), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kPrefetchBytes + off), _MM_HINT_T1);
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block as weight = q * scale[g] + bias[g], g = element / Group (16 or 32: the format's scale
// granularity); `q` points at the int8 values (the block itself for Q8_0, `buf` otherwise).
template <int Elems, int Group>
struct Unpacked {
  const int8_t* q;
  int8_t buf[Elems];
  float scale[Elems / Group];
  float bias[Elems / Group];
};

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34, kCode = 0, kGroupElems = 32;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    u.q = reinterpret_cast<const int8_t*>(b + 2);
    u.scale[0] = half_to_float(b);
    u.bias[0] = 0.f;
  }
};

// Low nibbles are elements 0-15, high nibbles 16-31, each through `lut` (a 16-entry table, one shuffle).
inline void unpack_nibbles32(const uint8_t* qs, const int8_t* lut, int8_t* out) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lut));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi8(table, low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_shuffle_epi8(table, high));
}

constexpr int8_t kQ4_0Values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// E2M1 values doubled (exact small integers); the scale is halved to match (2^(e-128)).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18, kCode = 1, kGroupElems = 32;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    unpack_nibbles32(b + 2, kQ4_0Values, u.buf);
    u.q = u.buf;
    u.scale[0] = half_to_float(b);
    u.bias[0] = 0.f;
  }
};

// 2^(e - 128) (half the E8M0 scale), built from its bits: subnormal for e < 2.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 1u << (21 + e);
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

struct Mxfp4 {
  static constexpr int kElems = 32, kBytes = 17, kCode = 5, kGroupElems = 32;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    unpack_nibbles32(b + 1, kMxfp4Values, u.buf);
    u.q = u.buf;
    u.scale[0] = e8m0_half(b[0]);
    u.bias[0] = 0.f;
  }
};

// hearth's FP8 e4m3 blocks (an fp32 scale, 128 e4m3 bytes): computed by fp8.h's row_dot_fp8.
struct Fp8E4m3 {
  static constexpr int kElems = fp8::kBlockElems, kBytes = fp8::kBlockBytes, kCode = 6;
};

// hearth's bf16 blocks (32 bf16 values, a bf16 file's weights as stored): computed by bf16w.h's row_dot_bf16.
struct Bf16 {
  static constexpr int kElems = bf16w::kBlockElems, kBytes = bf16w::kBlockBytes, kCode = 7;
};

// The 8 (scale, min) pairs of a Q4_K / Q5_K super-block as weight = q * d*sc - dmin*m: the 6-bit
// fields unpacked four at a time in 32-bit words, then widened and scaled eight at a time.
inline void k_scales(const uint8_t* b, float* scale, float* bias) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  uint32_t w[3];
  std::memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x30303030;
  const uint32_t sc[2] = {w[0] & low6, (w[2] & low4) | ((w[0] >> 2) & top2)};
  const uint32_t m[2] = {w[1] & low6, ((w[2] >> 4) & low4) | ((w[1] >> 2) & top2)};
  const __m128i sc8 = _mm_set_epi32(0, 0, static_cast<int>(sc[1]), static_cast<int>(sc[0]));
  const __m128i m8 = _mm_set_epi32(0, 0, static_cast<int>(m[1]), static_cast<int>(m[0]));
  _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8))));
  _mm256_storeu_ps(bias, _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8))));
}

struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144, kCode = 2, kGroupElems = 32;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    k_scales(b, u.scale, u.bias);
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; ++j)  // 64 elements per 32 bytes: low nibbles, then high nibbles
      for (int l = 0; l < 32; ++l) {
        u.buf[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 0x0F);
        u.buf[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
      }
    u.q = u.buf;
  }
};

struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176, kCode = 3, kGroupElems = 32;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    k_scales(b, u.scale, u.bias);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        u.buf[64 * j + l] = static_cast<int8_t>((qs[32 * j + l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4));
        u.buf[64 * j + 32 + l] = static_cast<int8_t>((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
      }
    u.q = u.buf;
  }
};

struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210, kCode = 4, kGroupElems = 16;
  static void unpack(const uint8_t* b, Unpacked<kElems, kGroupElems>& u) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int n = 0; n < 2; ++n)  // two halves of 128 elements
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo0 = ql[64 * n + l], lo1 = ql[64 * n + 32 + l], hi = qh[32 * n + l];
        int8_t* o = u.buf + 128 * n;
        o[l] = static_cast<int8_t>(((lo0 & 0x0F) | ((hi & 3) << 4)) - 32);
        o[l + 32] = static_cast<int8_t>(((lo1 & 0x0F) | (((hi >> 2) & 3) << 4)) - 32);
        o[l + 64] = static_cast<int8_t>(((lo0 >> 4) | (((hi >> 4) & 3) << 4)) - 32);
        o[l + 96] = static_cast<int8_t>(((lo1 >> 4) | (((hi >> 6) & 3) << 4)) - 32);
      }
    for (int g = 0; g < 16; ++g) {  // group g of half n, quarter q, l / 16: scale 8n + 2q + l/16 = g
      u.scale[g] = d * static_cast<float>(sc[g]);
      u.bias[g] = 0.f;
    }
    u.q = u.buf;
  }
};

// out[m] = row . xs[m] for M tokens, the row of K elements in format F.
template <typename F, int M>
inline void row_dot(const uint8_t* row, int64_t K, const float* const* xs, float* out) {
  // Two accumulators per token hide the FMA latency; the same two for every M, so that a token's
  // result does not depend on how many tokens share the pass.
  constexpr int kChunks = F::kGroupElems / kLanes;
  constexpr int kAcc = 2;
  vf acc[M][kAcc];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < kAcc; ++a) acc[m][a] = zero();
  Unpacked<F::kElems, F::kGroupElems> u;
  for (int64_t b = 0; b < K / F::kElems; ++b) {
    prefetch_ahead(row + b * F::kBytes, F::kBytes);
    F::unpack(row + b * F::kBytes, u);
    const int64_t base = b * F::kElems;
#pragma GCC unroll 16
    for (int g = 0; g < F::kElems / F::kGroupElems; ++g) {
      const vf s = set1(u.scale[g]), o = set1(u.bias[g]);
#pragma GCC unroll 4
      for (int c = 0; c < kChunks; ++c) {
        const int e = g * F::kGroupElems + c * kLanes;
        const vf w = fma(widen(u.q + e), s, o);
        for (int m = 0; m < M; ++m) {
          vf& slot = acc[m][(g * kChunks + c) % kAcc];
          slot = fma(w, loadf(xs[m] + base + e), slot);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    vf t = acc[m][0];
    for (int a = 1; a < kAcc; ++a) t = add(t, acc[m][a]);
    out[m] = hsum(t);
  }
}

// A Q4_K / Q5_K super-block's 8 scale fields sc (bytes 0-7) and 8 min fields m (bytes 8-15), decoded in
// registers: the 12 bytes of 6-bit fields gathered by two byte shuffles (fields 4-7 take their low bits
// from bytes 8-11 and their top two bits from bytes 0-7).
inline __m128i k_fields(const uint8_t* b) {
  const __m128i S = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));  // d, dmin, then the 12 field bytes
  const __m128i A = _mm_shuffle_epi8(S, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i B = _mm_shuffle_epi8(S, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i low = _mm_and_si128(A, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(A, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15,
                                                                          15, 15));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(B, 2), _mm_set1_epi8(0x30));
  return _mm_or_si128(_mm_or_si128(low, high), top);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A Q4_K super-block's 8 scales d*sc (lanes 0-7) and biases -dmin*m (lanes 8-15): k_fields widened and
// scaled at once.
inline __m512 k_scales16(const uint8_t* b) {
  const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k_fields(b)));
  const __m128i S = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));  // d, dmin first
  const __m512 d_dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                              _mm512_castps128_ps512(_mm_cvtph_ps(S)));
  const __m512 sign = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm512_mul_ps(fields, _mm512_mul_ps(d_dmin, sign));
}

// Q4_K with AVX-512 by table lookup: each sub-block's 16 possible weights (scale * q + bias, one fused
// rounding, as the generic kernel's) fill one register, and vpermps picks a weight for every lane
// straight from its nibble, the 32 bytes of a 64-element chunk broadcast to both register halves and
// shifted per lane so that each 32-bit lane's low four bits are the nibble it needs. The lanes' elements
// come in a fixed order other than the row's (see permute_q4_k), so the activations are permuted
// to match once per call. Three instructions a 16 weights instead of the widening kernel's five.
// The table lookup's constants: the tables' indices 0..15 and the per-lane shifts of the four weight
// vectors of a chunk.
struct Q4kLanes {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sh0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
  const __m512i sh1 = _mm512_add_epi32(sh0, _mm512_set1_epi32(16)), sh2 = _mm512_add_epi32(sh0, _mm512_set1_epi32(4));
  const __m512i sh3 = _mm512_add_epi32(sh0, _mm512_set1_epi32(20));
};

// The four weight vectors of a 64-element chunk (its 32 bytes broadcast to both halves of v) from the
// tables of its two sub-blocks (la: the first, lb: the second).
inline void q4_k_weights(const Q4kLanes& c, __m512i v, __m512 la, __m512 lb, vf w[4]) {
  w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, c.sh0), la);
  w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, c.sh1), la);
  w[2] = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, c.sh2), lb);
  w[3] = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, c.sh3), lb);
}

template <int M>
inline void row_acc_q4_k(const uint8_t* row, int64_t K, const float* const* xs, vf* out) {
  vf acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
  const Q4kLanes c;
  for (int64_t b = 0; b < K / Q4_K::kElems; ++b) {
    const uint8_t* blk = row + b * Q4_K::kBytes;
    prefetch_ahead(blk, Q4_K::kBytes);
    const __m512 sb = k_scales16(blk);
    const int64_t base = b * Q4_K::kElems;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j)));
      const __m512 la = fma(c.iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j), sb),
                            _mm512_permutexvar_ps(_mm512_set1_epi32(8 + 2 * j), sb));
      const __m512 lb = fma(c.iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j + 1), sb),
                            _mm512_permutexvar_ps(_mm512_set1_epi32(9 + 2 * j), sb));
      vf w[4];
      q4_k_weights(c, v, la, lb, w);
      const int64_t e = base + 64 * j;
      for (int m = 0; m < M; ++m) {
        acc[m][0] = fma(w[0], loadf(xs[m] + e), acc[m][0]);
        acc[m][1] = fma(w[1], loadf(xs[m] + e + 16), acc[m][1]);
        acc[m][0] = fma(w[2], loadf(xs[m] + e + 32), acc[m][0]);
        acc[m][1] = fma(w[3], loadf(xs[m] + e + 48), acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = add(acc[m][0], acc[m][1]);
}

// R Q4_K rows for one token at once, each exactly as row_acc_q4_k<1> computes it (the same lookup
// tables, products and accumulators, so a row's result does not depend on its neighbours): the rows'
// streams interleave, which keeps more of them in flight (from DRAM on 2 cores, against one row at a
// time: two rows 1.07x and four 1.15x for rows of 1024 weights, 1.15x and 1.20x for the 256-weight
// rows of expert down projections; eight rather than four: a Q4_K_M decode step with fp32
// activations 6.08 -> 5.90 ms). The scales go through memory here (broadcast loads, no lane permutes),
// with the same values.
template <int R>
inline void rows_acc_q4_k_1(const uint8_t* const* rows, int64_t K, const float* x, vf* out) {
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  const Q4kLanes c;
  alignas(64) float sc[R][16];
  for (int64_t b = 0; b < K / Q4_K::kElems; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * Q4_K::kBytes;
      prefetch_ahead(blk, Q4_K::kBytes);
      _mm512_store_ps(sc[r], k_scales16(blk));
    }
    const float* xb = x + b * Q4_K::kElems;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const float* xj = xb + 64 * j;
      const vf x0 = loadf(xj), x1 = loadf(xj + 16), x2 = loadf(xj + 32), x3 = loadf(xj + 48);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + b * Q4_K::kBytes;
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j)));
        const __m512 la = fma(c.iota, set1(sc[r][2 * j]), set1(sc[r][8 + 2 * j]));
        const __m512 lb = fma(c.iota, set1(sc[r][2 * j + 1]), set1(sc[r][9 + 2 * j]));
        vf w[4];
        q4_k_weights(c, v, la, lb, w);
        acc[r][0] = fma(w[0], x0, acc[r][0]);
        acc[r][1] = fma(w[1], x1, acc[r][1]);
        acc[r][0] = fma(w[2], x2, acc[r][0]);
        acc[r][1] = fma(w[3], x3, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = add(acc[r][0], acc[r][1]);
}

// The activations in the lane order of row_acc_q4_k: per 64-element chunk (32 bytes: low nibbles are
// elements 0-31, high nibbles 32-63), four vectors of 16 whose lane i < 8 is byte 4i + s and lane
// i >= 8 byte 4(i - 8) + s + 1, with s = 0, 2 for the low nibbles and again for the high ones.
inline void permute_q4_k(const float* x, int64_t K, float* out) {
  for (int64_t c = 0; c < K / 64; ++c) {
    const float* in = x + 64 * c;
    float* o = out + 64 * c;
    for (int half = 0; half < 2; ++half)  // low nibbles (elements 0-31), then high (32-63)
      for (int s = 0; s < 2; ++s)
        for (int i = 0; i < 16; ++i) o[32 * half + 16 * s + i] = in[32 * half + 4 * (i % 8) + 2 * s + i / 8];
  }
}

// Q6_K with AVX-512. Per half of a super-block (128 elements) one 64-byte load of low nibbles and
// one 32-byte load of high bit pairs give the 6-bit values u of two 64-element pairs of quarters
// (quarters 0|1 and 2|3), one per byte, in two registers (the int8 mode's assembly, kernels/cpu/q8.h).
// Each register's 32-bit lanes then give four vectors of 16 weights, byte k of every lane (one shift,
// one mask) converted and scaled: w = u * s - 32 s in one fused rounding, the same value as the
// reference's (u - 32) * s. About two thirds of the instructions of widening each quarter's bytes
// (a lane permute and a sign extension per 16 weights); the lanes' elements come in a fixed order
// other than the row's, so each call permutes the activations once to match (permute_q6_k).
// The 16 scales d * sc of a super-block, in a register (each broadcast by a lane permute: a store and
// sixteen narrow reloads stall on store forwarding).
inline __m512 q6_scales(const uint8_t* blk) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  return _mm512_mul_ps(set1(half_to_float(blk + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

struct Q6Pair {
  __m512i u;      // 64 six-bit values: bytes 0-31 the first quarter of the pair, 32-63 the second
  __m512 s, neg;  // per lane (four of each 16-element group): the scale d * sc and -32 times it
};

// Quarters 2p, 2p + 1 of half n of block blk; scale: q6_scales(blk).
inline Q6Pair q6_pair(const uint8_t* blk, int n, int p, __m512 scale) {
  const __m512i ql = _mm512_loadu_si512(blk + 64 * n);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n)));
  const __m512i shift = p == 0 ? _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2) : _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qh, shift), _mm512_set1_epi8(0x03)), 4);
  const __m512i lo = p == 0 ? ql : _mm512_srli_epi16(ql, 4);
  const int g = 8 * n + 4 * p;  // lanes 0-3, 4-7, 8-11, 12-15: groups g .. g + 3
  const __m512 s = _mm512_permutexvar_ps(
      _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2, g + 2, g + 3, g + 3, g + 3, g + 3),
      scale);
  return {_mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0F)), hi), s,
          _mm512_mul_ps(s, _mm512_set1_ps(-32.0f))};
}

// The weights of byte k of every 32-bit lane of a pair: lane i < 8 is element 4i + k of the first
// quarter, lane i >= 8 element 4(i - 8) + k of the second.
template <int k>
inline __m512 q6_plane(const Q6Pair& q) {
  __m512i v = q.u;
  if constexpr (k > 0) v = _mm512_srli_epi32(v, 8 * k);
  if constexpr (k < 3) v = _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), q.s, q.neg);
}

// acc[k & 1] += plane k of pair q times the activations at x (16 each, in permute_q6_k's order).
inline void q6_pair_products(const Q6Pair& q, const float* x, vf* acc) {
  acc[0] = fma(q6_plane<0>(q), loadf(x), acc[0]);
  acc[1] = fma(q6_plane<1>(q), loadf(x + 16), acc[1]);
  acc[0] = fma(q6_plane<2>(q), loadf(x + 32), acc[0]);
  acc[1] = fma(q6_plane<3>(q), loadf(x + 48), acc[1]);
}

template <int M>
inline void row_acc_q6_k(const uint8_t* row, int64_t K, const float* const* xs, vf* out) {
  vf acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
  for (int64_t b = 0; b < K / Q6_K::kElems; ++b) {
    const uint8_t* blk = row + b * Q6_K::kBytes;
    prefetch_ahead(blk, Q6_K::kBytes);
    const __m512 scale = q6_scales(blk);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {  // half h / 2, pair h % 2
      const Q6Pair q = q6_pair(blk, h / 2, h % 2, scale);
      const int64_t e = b * Q6_K::kElems + 64 * h;
      for (int m = 0; m < M; ++m) q6_pair_products(q, xs[m] + e, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = add(acc[m][0], acc[m][1]);
}

// R Q6_K rows for one token, each exactly as row_acc_q6_k<1> computes it, their streams interleaved
// (see rows_acc_q4_k_1; four rows rather than two: the 32k-row head 1.03 -> 0.96 ms).
template <int R>
inline void rows_acc_q6_k_1(const uint8_t* const* rows, int64_t K, const float* x, vf* out) {
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t b = 0; b < K / Q6_K::kElems; ++b) {
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * Q6_K::kBytes;
      prefetch_ahead(blk, Q6_K::kBytes);
      scale[r] = q6_scales(blk);
    }
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const float* xe = x + b * Q6_K::kElems + 64 * h;
      for (int r = 0; r < R; ++r) q6_pair_products(q6_pair(rows[r] + b * Q6_K::kBytes, h / 2, h % 2, scale[r]), xe, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = add(acc[r][0], acc[r][1]);
}

// The activations in the lane order of row_acc_q6_k: per 64 elements (a pair of quarters), four
// vectors of 16 (k = 0..3) whose lane i < 8 is element 4i + k and lane i >= 8 element 32 + 4(i - 8) + k.
inline void permute_q6_k(const float* x, int64_t K, float* out) {
  for (int64_t c = 0; c < K / 64; ++c)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 16; ++i) out[64 * c + 16 * k + i] = x[64 * c + 32 * (i / 8) + 4 * (i % 8) + k];
}
#endif

#include "q8.h"  // the int8-activation kernels (VNNI builds), inside this namespace

// Formats whose kernel in this build reads the activations in another order than the row's: callers
// pass them through prepare_x<F> once per call.
template <typename F>
constexpr bool kPermutesX = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
constexpr bool kPermutesX<Q4_K> = true;
template <>
constexpr bool kPermutesX<Q6_K> = true;
#endif

// x [K] as the kernel of F reads it: x itself, or its permutation written to buf [K].
template <typename F>
inline const float* prepare_x(const float* x, int64_t K, float* buf) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (kPermutesX<F>) {
    if constexpr (std::is_same_v<F, Q4_K>) permute_q4_k(x, K, buf);
    if constexpr (std::is_same_v<F, Q6_K>) permute_q6_k(x, K, buf);
    return buf;
  }
#endif
  (void)K, (void)buf;
  return x;
}

// Calls fn(std::integral_constant<int, M>{}) for a run-time token count M in 1..kMaxTokens.
template <typename Fn>
inline void with_tokens(int M, const Fn& fn) {
  switch (M) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// The row products of F for M tokens (1..kMaxTokens) with the generic kernels (fp8.h's for FP8,
// bf16w.h's for bf16): the
// formats without AVX-512 kernels of their own (see rows_dot_range).
template <typename F>
inline void rows_dot(const uint8_t* row, int64_t K, const float* const* xs, int M, float* out) {
  with_tokens(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    if constexpr (std::is_same_v<F, Fp8E4m3>)
      fp8::row_dot_fp8<kM>(row, K, xs, out);
    else if constexpr (std::is_same_v<F, Bf16>)
      bf16w::row_dot_bf16<kM>(row, K, xs, out);
    else
      row_dot<F, kM>(row, K, xs, out);
  });
}

// fp32 activations meeting a format with a VNNI kernel (kQ8: the GGML formats) go through that kernel split into three
// int8 pieces (Q8Rows::quantize, split): about 21 bits of each 256-element block's largest magnitude
// (20 for Q8_0's rows, q8_top), an error near 1e-6 of a product's largest output (Q8_0: 2e-6) where
// the fp32 kernels' is 2e-7, and the products
// at the int8 kernels' instruction count (a Q4_K_M decode step 5.9 -> 4.7 ms). On by default;
// HEARTH_SPLIT_ACTIVATIONS=0 keeps the fp32 kernels (read once per process).
inline bool split_activations() {
  static const bool on = [] {
    const char* v = std::getenv("HEARTH_SPLIT_ACTIVATIONS");
    return v == nullptr || v[0] != '0';
  }();
  return on;
}

// Formats with a VNNI kernel in this build (q8.h: the int8 mode, and fp32 activations in three pieces):
// the GGML formats, where the build has VNNI.
#ifdef HEARTH_Q8_ACTIVATIONS
template <typename F>
constexpr bool kQ8 = !std::is_same_v<F, Fp8E4m3> && !std::is_same_v<F, Bf16>;
#else
template <typename F>
constexpr bool kQ8 = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Rows [r0, r1) sixteen at a time for kM tokens: fill(r, n, part) leaves the per-token vectors of rows
// r .. r + n - 1 (n <= 16) in part[t][0 .. n); the rest are zeroed, and transpose_sum16 sums each
// row's vector into out[t][row - r0]. A row's sum comes from its own vector alone (whatever its
// neighbours), so results do not depend on how rows are cut into pieces nor on the other tokens.
template <int kM, typename Fill>
inline void sum16_rows(int64_t r0, int64_t r1, float* const* out, const Fill& fill) {
  __m512 part[kM][16];  // [token][row of the sixteen]
  for (int64_t r = r0; r < r1; r += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, r1 - r));
    fill(r, n, part);
    for (int i = n; i < 16; ++i)
      for (int t = 0; t < kM; ++t) part[t][i] = _mm512_setzero_ps();
    for (int t = 0; t < kM; ++t)
      _mm512_mask_storeu_ps(out[t] + (r - r0), static_cast<__mmask16>((1u << n) - 1), transpose_sum16(part[t]));
  }
}
#endif

// Rows [r0, r1) of a weight (row r at w + r * rb) times M quantized activation rows (kQ8<F> formats
// only; nothing otherwise) into out[m][r - r0], sixteen rows (AVX-512) or eight at a time (sum16_rows,
// sum8_rows: a reduction per row costs as much as a third of a short row's products, the experts'
// one-super-block down rows).
template <typename F>
inline void rows_dot_q8_range(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, int64_t K, const Q8Row* xs,
                              int M, float* const* out) {
#ifdef HEARTH_Q8_ACTIVATIONS
  auto run = [&](auto pieces) {
    constexpr int P = decltype(pieces)::value;
    with_tokens(M, [&](auto m) {
      constexpr int kM = decltype(m)::value;
      auto fill = [&](int64_t r, int n, auto part) {
        for (int i = 0; i < n; ++i) {
          std::remove_reference_t<decltype(part[0][0])> v[kM];
          if constexpr (std::is_same_v<F, Q6_K>)
            row_acc_q6_k_q8<kM, P>(w + (r + i) * rb, K, xs, v);
          else if constexpr (kQ8<F>)  // (no code for the formats without the kernel: callers never get here)
            row_acc_k_q8<F, kM, P>(w + (r + i) * rb, K, xs, v);
          for (int t = 0; t < kM; ++t) part[t][i] = v[t];
        }
      };
#ifdef HEARTH_Q8_512
      sum16_rows<kM>(r0, r1, out, fill);
#else
      sum8_rows<kM>(r0, r1, out, fill);
#endif
    });
  };
  if (xs[0].q2 != nullptr)
    run(std::integral_constant<int, 3>{});
  else
    run(std::integral_constant<int, 1>{});
#else
  (void)w, (void)rb, (void)r0, (void)r1, (void)K, (void)xs, (void)M, (void)out;
#endif
}

// Formats with AVX-512 kernels that leave one vector per row and token (row_acc_q4_k, row_acc_q6_k)
// and, for one token, take several rows at once, their streams interleaved (rows_acc_q4_k_1,
// rows_acc_q6_k_1).
template <typename F>
constexpr bool kInterleaves = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
constexpr bool kInterleaves<Q4_K> = true;
template <>
constexpr bool kInterleaves<Q6_K> = true;
#endif

// Rows [r0, r1) of a weight (row r at w + r * rb) times M activation rows xs (as F's kernel reads
// them) into out[m][r - r0]. kInterleaves formats go sixteen rows at a time (sum16_rows: a reduction
// per row costs a tenth of a short row's products); a lone token's rows go eight (Q4_K) or four
// (Q6_K) at a time through the interleaved kernels.
template <typename F>
inline void rows_dot_range(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, int64_t K, const float* const* xs,
                           int M, float* const* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (kInterleaves<F>) {
    constexpr bool q4 = std::is_same_v<F, Q4_K>;
    with_tokens(M, [&](auto m) {
      constexpr int kM = decltype(m)::value;
      sum16_rows<kM>(r0, r1, out, [&](int64_t r, int n, vf (*part)[16]) {
        int i = 0;
        if constexpr (kM == 1) {  // R rows at a time, R = 8 (Q4_K only), 4, then 2
          auto interleaved = [&](auto rc) {
            constexpr int R = decltype(rc)::value;
            for (; i + R <= n; i += R) {
              const uint8_t* rows[R];
              for (int j = 0; j < R; ++j) rows[j] = w + (r + i + j) * rb;
              if constexpr (q4) rows_acc_q4_k_1<R>(rows, K, xs[0], part[0] + i);
              else rows_acc_q6_k_1<R>(rows, K, xs[0], part[0] + i);
            }
          };
          if constexpr (q4) interleaved(std::integral_constant<int, 8>{});
          interleaved(std::integral_constant<int, 4>{});
          interleaved(std::integral_constant<int, 2>{});
        }
        for (; i < n; ++i) {
          vf v[kM];
          if constexpr (q4) row_acc_q4_k<kM>(w + (r + i) * rb, K, xs, v);
          else row_acc_q6_k<kM>(w + (r + i) * rb, K, xs, v);
          for (int t = 0; t < kM; ++t) part[t][i] = v[t];
        }
      });
    });
    return;
  }
#endif
  float dots[kMaxTokens];
  for (int64_t r = r0; r < r1; ++r) {
    rows_dot<F>(w + r * rb, K, xs, M, dots);
    for (int m = 0; m < M; ++m) out[m][r - r0] = dots[m];
  }
}

// Calls fn(F{}) for the format code (see kCode); false for an unknown code.
template <typename Fn>
inline bool by_format(int code, const Fn& fn) {
  switch (code) {
    case Q8_0::kCode: fn(Q8_0{}); return true;
    case Q4_0::kCode: fn(Q4_0{}); return true;
    case Q4_K::kCode: fn(Q4_K{}); return true;
    case Q5_K::kCode: fn(Q5_K{}); return true;
    case Q6_K::kCode: fn(Q6_K{}); return true;
    case Mxfp4::kCode: fn(Mxfp4{}); return true;
    case Fp8E4m3::kCode: fn(Fp8E4m3{}); return true;
    case Bf16::kCode: fn(Bf16{}); return true;
    default: return false;
  }
}

template <typename F>
constexpr int64_t row_bytes(int64_t K) { return K / F::kElems * F::kBytes; }

// out [M, N] = x [M, K] @ W^T, W N rows of K elements in format F; threads over rows, each row read
// once per 8 tokens.
template <typename F>
void linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int threads,
                 bool q8 = false) {
  const int64_t rb = row_bytes<F>(K);
  // Each token's row as F's kernel reads it: quantized once for the VNNI products (one int8 piece in the
  // int8-activation mode, three for fp32 activations), else x itself or its permutation.
  // (The activations are quantized per 256 elements: Q8_0 rows of other lengths keep fp32.)
  const bool split = kQ8<F> && !q8 && split_activations() && K % 256 == 0;
  const bool use_q8 = kQ8<F> && (q8 || split) && K % 256 == 0;
  Q8Rows xq;
  std::vector<Q8Row> qrows(use_q8 ? M : 0);
  std::vector<float> buf(kPermutesX<F> && !use_q8 ? M * K : 0);
  std::vector<const float*> rows(M);
  if (use_q8) xq.resize(M, K, split, q8_top<F>(split));
  for (int64_t m = 0; m < M; ++m) {
    if (use_q8)
      xq.quantize(m, x + m * K), qrows[m] = xq.row(m);
    else
      rows[m] = prepare_x<F>(x + m * K, K, buf.data() + (kPermutesX<F> ? m * K : 0));
  }
  hearth::parallel_for(0, N, 16, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTokens) {
      const int mt = static_cast<int>(std::min<int64_t>(kMaxTokens, M - m0));
      float* outs[kMaxTokens];
      for (int m = 0; m < mt; ++m) outs[m] = out + (m0 + m) * N + r0;
      if (use_q8)
        rows_dot_q8_range<F>(w, rb, r0, r1, K, qrows.data() + m0, mt, outs);
      else
        rows_dot_range<F>(w, rb, r0, r1, K, rows.data() + m0, mt, outs);
    }
  });
}

// out [K] = a row of blocks decoded to fp32, each weight q * scale + bias in one rounding (the value
// the products use).
template <typename F>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  if constexpr (std::is_same_v<F, Fp8E4m3>) {
    fp8::decode_row(row, K, out);
  } else if constexpr (std::is_same_v<F, Bf16>) {
    bf16w::decode_row(row, K, out);
  } else {
    Unpacked<F::kElems, F::kGroupElems> u;
    for (int64_t b = 0; b < K / F::kElems; ++b) {
      F::unpack(row + b * F::kBytes, u);
      float* o = out + b * F::kElems;
      for (int g = 0; g < F::kElems / F::kGroupElems; ++g) {
        const vf s = set1(u.scale[g]), bias = set1(u.bias[g]);
        for (int c = 0; c < F::kGroupElems / kLanes; ++c) {
          const int e = g * F::kGroupElems + c * kLanes;
          storef(o + e, fma(widen(u.q + e), s, bias));
        }
      }
    }
  }
}

// out [rows, K] fp32 = rows of blocks (row r at w + r * stride bytes) decoded, in parallel over rows:
// what prefill multiplies with a GEMM.
template <typename F>
void dequantize_impl(const uint8_t* w, int64_t rows, int64_t K, int64_t stride, float* out, int threads) {
  hearth::parallel_for(0, rows, 8, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) decode_row<F>(w + r * stride, K, out + r * K);
  });
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

#if defined(__AVX512F__)
// exp(x) for 16 lanes, within about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), a
// degree-7 polynomial for exp(r) (Cephes' coefficients), then scaled by 2^n (vscalefps saturates to
// 0 and infinity by itself).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// act [I] = silu(gate) * up for gate_up [2I] (gate first), in fp32.
inline void silu_gate(const float* gate_up, int64_t I, float* act) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= I; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate_up + i), u = _mm512_loadu_ps(gate_up + I + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(act + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
  }
#endif
  for (; i < I; ++i) act[i] = silu(gate_up[i]) * gate_up[I + i];
}

// The routed (token, expert) pairs of rows [pairs] (-1: computed elsewhere) grouped by expert: order
// holds the pairs sorted by row (stable), each group a row's run of them, at most `most` pairs a
// group. False when a row is at or past n_rows.
struct PairGroup { int64_t row, start; int count; };

inline bool routed_groups(const int64_t* rows, int64_t pairs, int64_t n_rows, int most, std::vector<int64_t>& order,
                          std::vector<PairGroup>& groups) {
  order.reserve(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    if (rows[p] >= n_rows) return false;
    if (rows[p] >= 0) order.push_back(p);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t row = rows[order[i]];
    if (groups.empty() || groups.back().row != row || groups.back().count == most)
      groups.push_back({row, static_cast<int64_t>(i), 0});
    ++groups.back().count;
  }
  return true;
}

// out [T, H] = for every token the k terms y[pair] * weights[pair] in order (pairs with rows < 0 left
// out), vectorised over channels.
inline void weighted_sum(const int64_t* rows, const float* weights, const float* y, int64_t T, int64_t k, int64_t H,
                         float* out) {
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * H;
    std::fill(o, o + H, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      if (rows[t * k + j] < 0) continue;
      const float w = weights[t * k + j];
      const float* yj = y + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) o[h] += yj[h] * w;
    }
  }
}

// The routed experts of T tokens (k each), SiLU-gated, weighted and summed in fp32:
//   x [T, H]; pool rows[T * k] (-1: computed elsewhere); weights [T * k] fp32; out [T, H].
// Expert `row` has gate_up rows (2I of H elements, format FG) at gu + row * gu_stride and down rows
// (H of I elements, format FD) at dn + row * dn_stride. The (token, expert) pairs are grouped by
// expert, up to 8 tokens a group, so each expert's rows are read once per step; threads run over
// (group, row). Returns false when a row is out of [0, n_rows).
template <typename FG, typename FD>
bool experts_impl(const float* x, int64_t T, int64_t H, int64_t I, const uint8_t* gu, int64_t gu_stride,
                  const uint8_t* dn, int64_t dn_stride, int64_t n_rows, const int64_t* rows, int64_t k,
                  const float* weights, float* out, int threads, bool q8 = false) {
  const int64_t pairs = T * k;
  std::vector<int64_t> order;
  std::vector<PairGroup> groups;
  if (!routed_groups(rows, pairs, n_rows, kMaxTokens, order, groups)) return false;
  const int64_t G = static_cast<int64_t>(groups.size());
  // Every pair's rows are written before they are read (pairs computed elsewhere are never read), so
  // the scratch is left uninitialised: zeroing it cost more than the sort and grouping above.
  const std::unique_ptr<float[]> proj(new float[pairs * 2 * I]), act(new float[pairs * I]), y(new float[pairs * H]);
  // Where the format has a VNNI kernel: tokens and gated products quantized, in one piece (the
  // int8-activation mode) or three (fp32 activations, split_activations).
  const bool split = !q8 && split_activations();
  const bool gq8 = kQ8<FG> && (q8 || split) && H % 256 == 0, dq8 = kQ8<FD> && (q8 || split) && I % 256 == 0;
  // Each token's activations as FG's kernel reads them, and (below) each pair's gated product as FD's.
  std::vector<float> xbuf(kPermutesX<FG> && !gq8 ? T * H : 0), abuf(kPermutesX<FD> && !dq8 ? pairs * I : 0);
  std::vector<const float*> xrow(T);
  if (!gq8)
    for (int64_t t = 0; t < T; ++t) xrow[t] = prepare_x<FG>(x + t * H, H, xbuf.data() + (kPermutesX<FG> ? t * H : 0));
  Q8Rows xq, aq;
  std::vector<Q8Row> xq_row(gq8 ? T : 0), aq_row(dq8 ? pairs : 0);
  if (gq8) {
    xq.resize(T, H, split, q8_top<FG>(split));
    for (int64_t t = 0; t < T; ++t) xq.quantize(t, x + t * H), xq_row[t] = xq.row(t);
  }
  // One pass over every group's R rows of K elements (format F = decltype(f); row rr of the group's
  // expert at base + row * stride + rr * rb) into dst [pairs, R]: pair p's activations are x_of(p) (as
  // F's kernel reads them) or, in the int8 mode, q_of(p). Threads run over (group, row).
  auto pass = [&](auto f, const uint8_t* base, int64_t stride, int64_t R, int64_t K, bool use_q8, const auto& x_of,
                  const auto& q_of, float* dst) {
    using F = decltype(f);
    const int64_t rb = row_bytes<F>(K);
    hearth::parallel_for(0, G * R, 32, threads, [&](int64_t r0, int64_t r1) {
      // Group by group (one division per group, not per row: the down projection's rows are short);
      // [rr, re) are the group's rows in this piece.
      for (int64_t r = r0; r < r1;) {
        const int64_t gi = r / R, rr = r - gi * R, re = std::min(R, r1 - gi * R);
        const PairGroup& g = groups[gi];
        const uint8_t* w = base + g.row * stride;
        float* out[kMaxTokens];  // row 0 of each pair's dst
        for (int m = 0; m < g.count; ++m) out[m] = dst + order[g.start + m] * R;
        r = gi * R + re;
        if (use_q8) {
          Q8Row qs[kMaxTokens];
          for (int m = 0; m < g.count; ++m) qs[m] = q_of(order[g.start + m]), out[m] += rr;
          rows_dot_q8_range<F>(w, rb, rr, re, K, qs, g.count, out);
        } else {
          const float* xs[kMaxTokens];
          for (int m = 0; m < g.count; ++m) xs[m] = x_of(order[g.start + m]), out[m] += rr;
          rows_dot_range<F>(w, rb, rr, re, K, xs, g.count, out);
        }
      }
    });
  };
  pass(FG{}, gu, gu_stride, 2 * I, H, gq8, [&](int64_t p) { return xrow[p / k]; },
       [&](int64_t p) { return xq_row[p / k]; }, proj.get());
  std::vector<const float*> arow(pairs);
  if (dq8) aq.resize(pairs, I, split, q8_top<FD>(split));
  for (const int64_t p : order) {
    silu_gate(proj.get() + p * 2 * I, I, act.get() + p * I);
    if (dq8)
      aq.quantize(p, act.get() + p * I), aq_row[p] = aq.row(p);
    else
      arow[p] = prepare_x<FD>(act.get() + p * I, I, abuf.data() + (kPermutesX<FD> ? p * I : 0));
  }
  pass(FD{}, dn, dn_stride, H, I, dq8, [&](int64_t p) { return arow[p]; }, [&](int64_t p) { return aq_row[p]; },
       y.get());
  weighted_sum(rows, weights, y.get(), T, k, H, out);
  return true;
}

}  // namespace hearth::blocks
