// bf16 weights kept as hearth's bf16 blocks (see hearth/engine/quant/formats.py: 32 bf16 values in 64
// bytes, no scale) times fp32 activations, for 1 to 8 tokens at once: a bf16 GGUF file computed with
// fp32 activations keeps its weights as stored (the file's bytes, not twice them) and reads half the
// bytes per token of fp32 weights. blocks.h dispatches its Bf16 format here; the calling convention is
// its row_dot's. A bf16 value widens to fp32 exactly (its 16 bits as the high half of the fp32); the
// products accumulate in fp32, two accumulators per token whatever the token count.
#pragma once

#include "native.h"
#include "vec.h"

namespace hearth::bf16w {

constexpr int kBlockElems = 32, kBlockBytes = 64;

using namespace hearth::vec;  // NOLINT: the lane-width vector all the block kernels compute in

// kLanes bf16 values at p (2 * kLanes bytes) widened to fp32.
inline vf widen(const uint8_t* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return widen_bf16x16(p);
#else
  return widen_bf16x8(p);
#endif
}

// out[m] = row . xs[m] for M tokens, the row of K elements (a multiple of 32).
template <int M>
inline void row_dot_bf16(const uint8_t* row, int64_t K, const float* const* xs, float* out) {
  vf acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
  for (int64_t k = 0; k < K; k += 2 * kLanes) {
    // Fetched ahead as blocks.h's prefetch_ahead does (decode is bound by how fast weights stream in).
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * k) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * k) + 8192, _MM_HINT_T1);
    const vf w0 = widen(row + 2 * k), w1 = widen(row + 2 * (k + kLanes));
    for (int m = 0; m < M; ++m) {
      acc[m][0] = fma(w0, loadf(xs[m] + k), acc[m][0]);
      acc[m][1] = fma(w1, loadf(xs[m] + k + kLanes), acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(add(acc[m][0], acc[m][1]));
}

// out [K] = the row's weights in fp32.
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += kLanes) storef(out + k, widen(row + 2 * k));
}

}  // namespace hearth::bf16w
