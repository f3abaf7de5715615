// The routed experts of a prompt's many tokens (prefill, fp32 activations), each expert's weights
// decoded six rows at a time into a buffer the core's caches hold and multiplied in fp32 by a register-blocked kernel, experts
// shared out whole between the threads.
//
// Why not decode each expert and call the BLAS: at the experts' shapes (tens of tokens, a 2048 x 1024
// weight) a 2-core Zen 3 runs MKL's sgemm at 108-133 GFLOP/s with both threads on one product, and
// writes and reads each decoded expert (8 MB in fp32) once more. One expert a thread, its rows decoded
// where the products read them, keeps both cores on independent work with no barrier inside an expert.
//
// Numerics: each output is one fp32 dot product of a decoded weight row (decode_row: the value the
// decode kernels use) with an fp32 activation row, accumulated in fp32 in the order of k (one fused
// multiply-add per element). Included by decode.cpp after blocks.h.
#pragma once

#include <atomic>
#include <limits>

#include "blocks.h"

namespace hearth::blocks {
namespace experts_gemm {

constexpr int kRows = 6;    // weight rows per register block
constexpr int kTokens = 16;  // tokens per register block (two 8-lane vectors)

// C[r][t] = sum_k W[r][k] X[k][t] for R weight rows (w: R rows of K floats, row stride K) and 16 tokens
// (xt: [K][16], the tokens' activations transposed); stored to c[r * 16 + t].
template <int R>
inline void block(const float* w, int64_t K, const float* xt, float* c) {
  // Accumulators as named registers: GCC kept an array of them on the stack (a store per
  // multiply-add, half the speed).
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 x0 = _mm256_loadu_ps(xt + k * kTokens), x1 = _mm256_loadu_ps(xt + k * kTokens + 8);
    __m256 wr = _mm256_broadcast_ss(w + k);
    a00 = _mm256_fmadd_ps(wr, x0, a00), a01 = _mm256_fmadd_ps(wr, x1, a01);
    if constexpr (R > 1) {
      wr = _mm256_broadcast_ss(w + K + k);
      a10 = _mm256_fmadd_ps(wr, x0, a10), a11 = _mm256_fmadd_ps(wr, x1, a11);
    }
    if constexpr (R > 2) {
      wr = _mm256_broadcast_ss(w + 2 * K + k);
      a20 = _mm256_fmadd_ps(wr, x0, a20), a21 = _mm256_fmadd_ps(wr, x1, a21);
    }
    if constexpr (R > 3) {
      wr = _mm256_broadcast_ss(w + 3 * K + k);
      a30 = _mm256_fmadd_ps(wr, x0, a30), a31 = _mm256_fmadd_ps(wr, x1, a31);
    }
    if constexpr (R > 4) {
      wr = _mm256_broadcast_ss(w + 4 * K + k);
      a40 = _mm256_fmadd_ps(wr, x0, a40), a41 = _mm256_fmadd_ps(wr, x1, a41);
    }
    if constexpr (R > 5) {
      wr = _mm256_broadcast_ss(w + 5 * K + k);
      a50 = _mm256_fmadd_ps(wr, x0, a50), a51 = _mm256_fmadd_ps(wr, x1, a51);
    }
  }
  const __m256 acc[kRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kTokens, acc[r][0]);
    _mm256_storeu_ps(c + r * kTokens + 8, acc[r][1]);
  }
}

template <int R = kRows>
inline void block_rows(int n, const float* w, int64_t K, const float* xt, float* c) {
  if constexpr (R > 1) {
    if (n < R) return block_rows<R - 1>(n, w, K, xt, c);
  }
  block<R>(w, K, xt, c);
}

// out [tiles][N][16] = rows [0, N) of one weight (format F, row r at base + r * rb) times the tokens'
// activations packed as xt [tiles][K][16]. wbuf holds kRows decoded rows.
template <typename F>
void weight_times_tokens(const uint8_t* base, int64_t rb, int64_t N, int64_t K, const float* xt, int64_t tiles,
                         float* wbuf, float* out) {
  for (int64_t r0 = 0; r0 < N; r0 += kRows) {
    const int rn = static_cast<int>(std::min<int64_t>(kRows, N - r0));
    for (int r = 0; r < rn; ++r) decode_row<F>(base + (r0 + r) * rb, K, wbuf + r * K);
    for (int64_t tile = 0; tile < tiles; ++tile)
      block_rows(rn, wbuf, K, xt + tile * K * kTokens, out + (tile * N + r0) * kTokens);
  }
}

// xt [tiles][K][16] = the n rows src(t) (K floats each) transposed, zeros past n.
template <typename Src>
void pack_tokens(int n, int64_t K, const Src& src, float* xt) {
  const int tiles = (n + kTokens - 1) / kTokens;
  std::fill(xt, xt + tiles * K * kTokens, 0.f);
  for (int t = 0; t < n; ++t) {
    const float* row = src(t);
    float* dst = xt + (t / kTokens) * K * kTokens + t % kTokens;
    for (int64_t k = 0; k < K; ++k) dst[k * kTokens] = row[k];
  }
}

// exp(x) for 8 lanes, within a few ulp: x = n ln2 + r (ln2 in two parts), a degree-7 polynomial for
// exp(r) (Cephes' coefficients, as blocks.h's exp16), times 2^n built in the exponent bits. x is
// clamped to [-87, 88] (silu's result for |g| past that is below fp32's normal range either way).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n in two factors, so that n = 128 (x near 88) stays in range
  const __m256i e = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(e, 1);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// act [tiles][I][16] = silu(gate) * up for gate_up [tiles][2I][16] (gate rows first).
inline void silu_gate_tiles(const float* gate_up, int64_t tiles, int64_t I, float* act) {
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* g = gate_up + tile * 2 * I * kTokens;
    const float* u = g + I * kTokens;
    float* a = act + tile * I * kTokens;
    for (int64_t i = 0; i < I * kTokens; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(u + i)));
    }
  }
}

}  // namespace experts_gemm

// The routed experts of T tokens (k each), SiLU-gated, weighted and summed in fp32, as experts_impl
// (the same arguments and layout) but for any number of tokens: each expert's tokens in one group,
// threads taking whole experts, the most tokens first. Returns false when a row is out of [0, n_rows).
template <typename FG, typename FD>
bool experts_gemm_impl(const float* x, int64_t T, int64_t H, int64_t I, const uint8_t* gu, int64_t gu_stride,
                       const uint8_t* dn, int64_t dn_stride, int64_t n_rows, const int64_t* rows, int64_t k,
                       const float* weights, float* out, int threads) {
  namespace eg = experts_gemm;
  const int64_t pairs = T * k;
  std::vector<int64_t> order;
  std::vector<PairGroup> groups;
  if (!routed_groups(rows, pairs, n_rows, std::numeric_limits<int>::max(), order, groups)) return false;
  std::stable_sort(groups.begin(), groups.end(),
                   [](const PairGroup& a, const PairGroup& b) { return a.count > b.count; });
  const std::unique_ptr<float[]> y(new float[pairs * H]);  // each routed pair's expert output
  const int most = groups.empty() ? 0 : groups.front().count;
  const int64_t tiles = (most + eg::kTokens - 1) / eg::kTokens;
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    std::vector<float> xt(tiles * H * eg::kTokens), proj(tiles * 2 * I * eg::kTokens),
        act(tiles * I * eg::kTokens), wbuf(eg::kRows * std::max(H, I)), yt(tiles * H * eg::kTokens);
    for (int64_t gi; (gi = next.fetch_add(1)) < static_cast<int64_t>(groups.size());) {
      const PairGroup& g = groups[gi];
      const int64_t* pair = order.data() + g.start;
      const int64_t gt = (g.count + eg::kTokens - 1) / eg::kTokens;
      eg::pack_tokens(g.count, H, [&](int t) { return x + (pair[t] / k) * H; }, xt.data());
      eg::weight_times_tokens<FG>(gu + g.row * gu_stride, row_bytes<FG>(H), 2 * I, H, xt.data(), gt, wbuf.data(),
                                  proj.data());
      eg::silu_gate_tiles(proj.data(), gt, I, act.data());
      eg::weight_times_tokens<FD>(dn + g.row * dn_stride, row_bytes<FD>(I), H, I, act.data(), gt, wbuf.data(),
                                  yt.data());
      for (int t = 0; t < g.count; ++t) {  // yt [tiles][H][16] -> the pair's row of y
        const float* src = yt.data() + (t / eg::kTokens) * H * eg::kTokens + t % eg::kTokens;
        float* dst = y.get() + pair[t] * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = src[h * eg::kTokens];
      }
    }
  };
  const int team = static_cast<int>(std::min<int64_t>(std::max(threads, 1), static_cast<int64_t>(groups.size())));
  if (team <= 1 || omp_in_parallel()) {
    work();
  } else {
#pragma omp parallel num_threads(team)
    work();
  }
  weighted_sum(rows, weights, y.get(), T, k, H, out);
  return true;
}

}  // namespace hearth::blocks
