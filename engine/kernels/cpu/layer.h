// One decoder layer's decode step in one call: RMSNorm, grouped-query attention with RoPE over the
// paged KV cache, RMSNorm, then a softmax top-k MoE block (with an optional sigmoid-gated shared
// expert) or a gated MLP, each with its residual add, for up to 8 single-token sequences.
//
// It composes the kernels the module path calls one by one (linear_impl, rms_norm_impl, experts_impl and
// the block-format kernels) and adds RoPE, the KV write, decode attention and the router. Every
// intermediate tensor the module path materialises is rounded to the model dtype at the same point, so
// an fp32 model gets the module path's results up to fp32 summation order, and a bf16 model the same
// roundings (the attention's fp32 softmax and value sum follow torch's CPU flash kernel: exp in fp32,
// the probabilities rounded to the model dtype before the value product, the fp32 sum as divisor).
//
// The Python side (engine/layers/native.py) describes a layer once as a LayerDesc (pointers, sizes and
// formats: int64 fields, the few real numbers as doubles) and each step as a StepDesc; the layer updates
// the hidden states in place. Included by decode.cpp inside its own namespace, after the float
// kernels it reuses (linear_impl, rms_norm_impl, experts_impl), so it has no includes of its own.
#pragma once

namespace layer {

using hearth::from_float;
namespace blocks = hearth::blocks;
#if defined(__AVX512F__)
using hearth::vec::transpose_sum16;
#endif

// A projection: `rows` outputs of `cols` inputs, in the model dtype (fmt -1) or a block format (its
// code; fp32 models only), with an optional bias (model dtype).
struct Proj {
  int64_t w, rows, cols, fmt, bias;
};

// Field order is the Python side's LAYER_FIELDS (checked at load through layer_desc_size()).
struct LayerDesc {
  int64_t dtype, hidden;
  int64_t in_norm;
  double in_eps;
  int64_t heads, kv_heads, head_dim, window;
  double scale;
  Proj q, k, v;  // k.w == 0: q holds the fused q | k | v rows
  int64_t q_norm, k_norm;
  double qk_eps;
  Proj o;
  int64_t k_cache, v_cache;  // [slots, kv_heads, head_dim] in the model dtype
  int64_t post_norm;
  double post_eps;
  int64_t mlp;  // 0: none (the caller runs the feed-forward), 1: MoE, 2: gated MLP
  Proj router;
  int64_t n_experts, top_k, normalize, weights_fp32;
  int64_t gate_up, gu_stride, down, dn_stride, n_rows, row_base, inter, gu_fmt, dn_fmt;  // expert banks
  Proj gate, up, down_proj;  // the shared expert (mlp 1; gate.w == 0: none) or the dense MLP (mlp 2)
  int64_t shared_gate;       // [1, hidden] sigmoid gate of the shared expert, or 0
  int64_t act_q8;            // the int8-activation mode for the block formats that have its kernel
  double residual;           // each branch's scale before its residual add (1: none; Granite's multiplier)
};

// One decode step: token t is the last of a sequence holding ctx_len[t] tokens after the step, whose
// position p lives in slot first_slot[t] + p (consecutive blocks), or else in
// table[t * table_stride + p / block_size] * block_size + p % block_size.
struct StepDesc {
  int64_t tokens, cos, sin, rope_width, slots, ctx_len, first_slot, table, table_stride, block_size;
};

constexpr int64_t kMaxTokens = 8;

// out [M, rows] = x [M, cols] @ W^T (+ bias), rounded to T (q8: the int8-activation mode, see q8.h).
template <typename T>
void project(const Proj& p, const T* x, int64_t M, T* out, int threads, bool q8 = false) {
  if (p.fmt < 0) {
    linear_impl<T>(x, M, p.cols, ptr<const T>(p.w), p.rows, ptr<const T>(p.bias), out, threads);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    blocks::by_format(static_cast<int>(p.fmt), [&](auto f) {
      blocks::linear_impl<decltype(f)>(x, M, p.cols, ptr<const uint8_t>(p.w), p.rows, out, threads, q8);
    });
    if (p.bias != 0) {
      const float* b = ptr<const float>(p.bias);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < p.rows; ++r) out[m * p.rows + r] += b[r];
    }
  }
}

// x [rows, width] * cos + rotate_half(x) * sin on the first R channels of each row (R = rope width),
// each product and the sum rounded to T as the module path's tensors are. cos/sin: [tokens, R].
template <typename T>
void rotate(T* x, int64_t tokens, int64_t heads, int64_t width, int64_t R, const T* cos, const T* sin) {
  const int64_t half = R / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + (t * heads + h) * width;
      const T* c = cos + t * R;
      const T* s = sin + t * R;
      float lo[512], hi[512];
      for (int64_t i = 0; i < half; ++i) lo[i] = to_float(row[i]), hi[i] = to_float(row[i + half]);
      for (int64_t i = 0; i < half; ++i) {
        row[i] = from_float<T>(round_to<T>(lo[i] * to_float(c[i])) + round_to<T>(-hi[i] * to_float(s[i])));
        row[i + half] = from_float<T>(round_to<T>(hi[i] * to_float(c[i + half])) +
                                      round_to<T>(lo[i] * to_float(s[i + half])));
      }
    }
}

#if defined(__AVX512F__)
// scores [groups, n] = q [groups, D] . keys of positions 0..n-1, times scale, for fp32 keys with D = 16 NC:
// 16 positions at a time (the tail padded with a zero row), their lane-wise products summed by
// transpose_sum16.
template <int NC, typename Slot>
void key_scores_nc(const float* q, int64_t groups, const float* kc, int64_t stride, const Slot& slot, int64_t n,
                   float scale, float* scores) {
  alignas(64) static const float zeros[16 * NC] = {};
  __m512 part[16];
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n - p0));
    const float* keys[16];
    for (int i = 0; i < 16; ++i) keys[i] = i < cnt ? kc + slot(p0 + i) * stride : zeros;
    for (int64_t j = 0; j < groups; ++j) {
      __m512 qj[NC];
      for (int c = 0; c < NC; ++c) qj[c] = _mm512_loadu_ps(q + j * 16 * NC + 16 * c);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        __m512 acc = _mm512_mul_ps(qj[0], _mm512_loadu_ps(keys[i]));
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qj[c], _mm512_loadu_ps(keys[i] + 16 * c), acc);
        part[i] = acc;
      }
      const __m512 dots = _mm512_mul_ps(transpose_sum16(part), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + j * n + p0, static_cast<__mmask16>((1u << cnt) - 1), dots);
    }
  }
}

// key_scores_nc for a head width D = 16 NC with NC from this one up to 16 (D a multiple of 16, at most
// 256); false for any other D.
template <int NC = 1, typename Slot>
bool key_scores16(const float* q, int64_t groups, int64_t D, const float* kc, int64_t stride, const Slot& slot,
                  int64_t n, float scale, float* scores) {
  if (D == 16 * NC) {
    key_scores_nc<NC>(q, groups, kc, stride, slot, n, scale, scores);
    return true;
  }
  if constexpr (NC < 16)
    return key_scores16<NC + 1>(q, groups, D, kc, stride, slot, n, scale, scores);
  else
    return false;
}

// acc [groups, D] += sum over positions p of w[j, p] * value(p) for groups j0 .. j0 + JT - 1 and the
// NC * 16 channels from c0: JT * NC accumulators stay in registers while each value row is read once.
template <int NC, int JT, typename Slot>
void value_tile(const float* w, int64_t j0, int64_t jn, int64_t n, int64_t c0, int64_t D, const float* vc,
                int64_t stride, const Slot& slot, float* acc) {
  __m512 a[JT][NC];
  for (int j = 0; j < JT; ++j)
    for (int c = 0; c < NC; ++c) a[j][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const float* v = vc + slot(p) * stride + c0;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int j = 0; j < JT; ++j) {
      if (j >= jn) break;
      const __m512 wj = _mm512_set1_ps(w[(j0 + j) * n + p]);
      for (int c = 0; c < NC; ++c) a[j][c] = _mm512_fmadd_ps(wj, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < JT && j < jn; ++j)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (j0 + j) * D + c0 + 16 * c, a[j][c]);
}

// acc [groups, D] = sum over positions p of w[j, p] * value(p), for fp32 values with D a multiple of 16,
// in tiles of at most 16 register accumulators (all of it at once for 4 groups of 64 channels).
template <typename Slot>
void value_sum16(const float* w, int64_t groups, int64_t n, int64_t D, const float* vc, int64_t stride,
                 const Slot& slot, float* acc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64)
    for (int64_t j0 = 0; j0 < groups; j0 += 4)
      value_tile<4, 4>(w, j0, std::min<int64_t>(4, groups - j0), n, c0, D, vc, stride, slot, acc);
  for (; c0 < D; c0 += 16)
    for (int64_t j0 = 0; j0 < groups; j0 += 8)
      value_tile<1, 8>(w, j0, std::min<int64_t>(8, groups - j0), n, c0, D, vc, stride, slot, acc);
}

// row [n] <- exp(row - max(row)); returns the sum.
inline float softmax_numerators(float* row, int64_t n) {
  float top = -INFINITY;
  for (int64_t p = 0; p < n; ++p) top = std::max(top, row[p]);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - p0 >= 16 ? 0xFFFF : (1u << (n - p0)) - 1);
    const __m512 e = blocks::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + p0), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(row + p0, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// Decode attention of token t's query heads [heads, D] over its sequence's cached keys and values
// (the window's last `window` positions, or all), one task per (token, KV head); out [tokens, heads, D].
// fp32 scores and softmax; the probabilities are rounded to T before the value sum (as torch's CPU
// flash kernel does for half types; the identity for fp32, the only dtype run here in practice).
template <typename T>
void attend(const LayerDesc& d, const StepDesc& s, const T* q, T* out, int threads) {
  const int64_t D = d.head_dim, groups = d.heads / d.kv_heads, kvh = d.kv_heads;
  const T* kc = ptr<const T>(d.k_cache);
  const T* vc = ptr<const T>(d.v_cache);
  const int64_t* ctx = ptr<const int64_t>(s.ctx_len);
  const int64_t* first = ptr<const int64_t>(s.first_slot);
  const int64_t* table = ptr<const int64_t>(s.table);
  hearth::parallel_for(0, s.tokens * kvh, 1, threads, [&](int64_t a, int64_t b) {
    std::vector<float> scores, acc(groups * D), qf(groups * D), sums(groups);
    for (int64_t task = a; task < b; ++task) {
      const int64_t t = task / kvh, g = task % kvh, L = ctx[t];
      const int64_t start = d.window > 0 ? std::max<int64_t>(0, L - d.window) : 0, n = L - start;
      auto slot = [&](int64_t i) {  // the cache slot of the window's i-th position
        const int64_t p = start + i;
        return first[t] >= 0 ? first[t] + p
                             : table[t * s.table_stride + p / s.block_size] * s.block_size + p % s.block_size;
      };
      for (int64_t i = 0; i < groups * D; ++i) qf[i] = to_float(q[(t * d.heads + g * groups) * D + i]);
      scores.assign(groups * n, 0.f);
      bool fast = false;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (key_scores16(qf.data(), groups, D, kc + g * D, kvh * D, slot, n, static_cast<float>(d.scale),
                         scores.data())) {
          for (int64_t j = 0; j < groups; ++j) sums[j] = softmax_numerators(scores.data() + j * n, n);
          fast = true;
        }
      }
#endif
      if (!fast) {
        for (int64_t p = 0; p < n; ++p) {
          const T* key = kc + (slot(p) * kvh + g) * D;
          for (int64_t j = 0; j < groups; ++j)
            scores[j * n + p] = HEARTH_DOT(key, qf.data() + j * D, D) * static_cast<float>(d.scale);
        }
        for (int64_t j = 0; j < groups; ++j) {
          float* sc = scores.data() + j * n;
          const float top = *std::max_element(sc, sc + n);
          sums[j] = 0.f;
          for (int64_t p = 0; p < n; ++p) sums[j] += (sc[p] = std::exp(sc[p] - top));
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if (fast) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>)
          value_sum16(scores.data(), groups, n, D, vc + g * D, kvh * D, slot, acc.data());
#endif
      } else {
        for (int64_t p = 0; p < n; ++p) {
          const T* val = vc + (slot(p) * kvh + g) * D;
          for (int64_t j = 0; j < groups; ++j) {
            const float w = round_to<T>(scores[j * n + p]);
            float* a = acc.data() + j * D;
            for (int64_t i = 0; i < D; ++i) a[i] += w * to_float(val[i]);  // vectorised: no reduction
          }
        }
      }
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t i = 0; i < D; ++i)
          out[(t * d.heads + g * groups + j) * D + i] = from_float<T>(acc[j * D + i] / sums[j]);
    }
  });
}

// Softmax over E logits in fp32, the k largest (ties: lower expert first), renormalised if asked;
// weights rounded to T unless the family keeps them in fp32.
template <typename T>
void route(const LayerDesc& d, const T* logits, int64_t* rows, float* weights) {
  const int64_t E = d.n_experts, k = d.top_k;
  std::vector<float> probs(E);
  std::vector<int64_t> order(E);
  float top = -INFINITY, sum = 0.f;
  for (int64_t e = 0; e < E; ++e) top = std::max(top, to_float(logits[e]));
  for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(to_float(logits[e]) - top));
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  float chosen = 0.f;
  for (int64_t j = 0; j < k; ++j) chosen += probs[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    float w = probs[order[j]];
    if (d.normalize) w /= chosen;
    weights[j] = d.weights_fp32 ? w : round_to<T>(w);
    rows[j] = d.row_base + order[j];
  }
}

// down(round(silu(gate(x))) * up(x)) for M tokens -> out [M, hidden], every tensor rounded to T.
template <typename T>
void gated_mlp(const LayerDesc& d, const T* x, int64_t M, T* out, int threads) {
  const int64_t I = d.gate.rows;
  std::vector<T> g(M * I), u(M * I);
  project(d.gate, x, M, g.data(), threads, d.act_q8 != 0);
  project(d.up, x, M, u.data(), threads, d.act_q8 != 0);
  for (int64_t i = 0; i < M * I; ++i) {
    const float sg = round_to<T>(blocks::silu(to_float(g[i])));
    g[i] = from_float<T>(sg * to_float(u[i]));
  }
  project(d.down_proj, g.data(), M, out, threads, d.act_q8 != 0);
}

// The routed experts (pool rows [M, k], fp32 weights [M, k]) plus the shared expert of M tokens ->
// out [M, hidden] in T.
template <typename T>
void moe(const LayerDesc& d, const T* x, int64_t M, const int64_t* rows, const float* weights, T* out, int threads) {
  const int64_t H = d.hidden, k = d.top_k;
  std::vector<float> sum(M * H);
  if (d.gu_fmt < 0) {
    for (int64_t t = 0; t < M; ++t)
      experts_impl<T>(x + t * H, H, ptr<const T>(d.gate_up), ptr<const T>(d.down), d.inter, rows + t * k, k,
                      weights + t * k, d.weights_fp32 != 0, sum.data() + t * H, true, threads);
  } else if constexpr (std::is_same_v<T, float>) {
    blocks::by_format(static_cast<int>(d.gu_fmt), [&](auto fg) {
      blocks::by_format(static_cast<int>(d.dn_fmt), [&](auto fd) {
        blocks::experts_impl<decltype(fg), decltype(fd)>(x, M, H, d.inter, ptr<const uint8_t>(d.gate_up), d.gu_stride,
                                                         ptr<const uint8_t>(d.down), d.dn_stride, d.n_rows, rows, k,
                                                         weights, sum.data(), threads, d.act_q8 != 0);
      });
    });
  }
  for (int64_t i = 0; i < M * H; ++i) out[i] = from_float<T>(sum[i]);
  if (d.gate.w == 0) return;
  std::vector<T> shared(M * H);
  gated_mlp<T>(d, x, M, shared.data(), threads);
  if (d.shared_gate != 0) {
    std::vector<T> gate(M);
    linear_impl<T>(x, M, H, ptr<const T>(d.shared_gate), 1, nullptr, gate.data(), threads);
    for (int64_t t = 0; t < M; ++t) {
      const float sg = round_to<T>(1.0f / (1.0f + std::exp(-to_float(gate[t]))));
      for (int64_t i = 0; i < H; ++i) shared[t * H + i] = from_float<T>(sg * to_float(shared[t * H + i]));
    }
  }
  for (int64_t i = 0; i < M * H; ++i) out[i] = from_float<T>(to_float(out[i]) + to_float(shared[i]));
}

template <typename T>
void add_into(T* h, const T* y, int64_t n, double scale) {
  const float s = static_cast<float>(scale);  // (torch multiplies by a Python float in the tensor's type)
  if (s == 1.0f) {
    for (int64_t i = 0; i < n; ++i) h[i] = from_float<T>(to_float(h[i]) + to_float(y[i]));
  } else {  // the branch scaled and rounded to T first, as the module path's tensor is
    for (int64_t i = 0; i < n; ++i) h[i] = from_float<T>(to_float(h[i]) + round_to<T>(to_float(y[i]) * s));
  }
}

// The attention's first half on h [tokens, hidden]: the input norm, the q/k/v projections, the q/k
// norms and RoPE; writes this step's keys and values into the cache and the queries to q
// [tokens, heads, head_dim].
template <typename T>
void attention_in(const LayerDesc& d, const StepDesc& s, const T* h, T* q, int threads) {
  const int64_t M = s.tokens, H = d.hidden, D = d.head_dim;
  const int64_t qs = d.heads * D, kvs = d.kv_heads * D;
  std::vector<T> xn(M * H), k(M * kvs), v(M * kvs);
  rms_norm_impl<T>(h, M, H, ptr<const T>(d.in_norm), static_cast<float>(d.in_eps), xn.data(), threads);
  if (d.k.w == 0) {
    std::vector<T> qkv(M * (qs + 2 * kvs));
    project(d.q, xn.data(), M, qkv.data(), threads, d.act_q8 != 0);
    for (int64_t t = 0; t < M; ++t) {
      const T* row = qkv.data() + t * (qs + 2 * kvs);
      std::copy(row, row + qs, q + t * qs);
      std::copy(row + qs, row + qs + kvs, k.data() + t * kvs);
      std::copy(row + qs + kvs, row + qs + 2 * kvs, v.data() + t * kvs);
    }
  } else {
    project(d.q, xn.data(), M, q, threads, d.act_q8 != 0);
    project(d.k, xn.data(), M, k.data(), threads, d.act_q8 != 0);
    project(d.v, xn.data(), M, v.data(), threads, d.act_q8 != 0);
  }
  if (d.q_norm != 0) {
    rms_norm_impl<T>(q, M * d.heads, D, ptr<const T>(d.q_norm), static_cast<float>(d.qk_eps), q, 1);
    rms_norm_impl<T>(k.data(), M * d.kv_heads, D, ptr<const T>(d.k_norm), static_cast<float>(d.qk_eps), k.data(), 1);
  }
  rotate(q, M, d.heads, D, s.rope_width, ptr<const T>(s.cos), ptr<const T>(s.sin));
  rotate(k.data(), M, d.kv_heads, D, s.rope_width, ptr<const T>(s.cos), ptr<const T>(s.sin));
  const int64_t* slots = ptr<const int64_t>(s.slots);
  for (int64_t t = 0; t < M; ++t) {
    std::copy(k.data() + t * kvs, k.data() + (t + 1) * kvs, ptr<T>(d.k_cache) + slots[t] * kvs);
    std::copy(v.data() + t * kvs, v.data() + (t + 1) * kvs, ptr<T>(d.v_cache) + slots[t] * kvs);
  }
}

// After the attention core, from its output attn [tokens, heads * head_dim]: the output projection and
// residual; with a feed-forward (mlp != 0) the post norm to xn [tokens, hidden], and for a MoE block
// the router's logits [tokens, experts] (model dtype).
template <typename T>
void post_attention(const LayerDesc& d, const StepDesc& s, T* h, const T* attn, T* xn, T* logits, int threads) {
  const int64_t M = s.tokens, H = d.hidden;
  std::vector<T> y(M * H);
  project(d.o, attn, M, y.data(), threads, d.act_q8 != 0);
  add_into(h, y.data(), M * H, d.residual);
  if (d.mlp == 0) return;
  rms_norm_impl<T>(h, M, H, ptr<const T>(d.post_norm), static_cast<float>(d.post_eps), xn, threads);
  if (d.mlp == 1) project(d.router, xn, M, logits, threads);
}

// The feed-forward and its residual from xn [tokens, hidden]; a MoE block's routing is given (pool rows
// and fp32 weights [tokens, top_k]).
template <typename T>
void feed_forward(const LayerDesc& d, const StepDesc& s, T* h, const T* xn, const int64_t* rows, const float* weights,
                  int threads) {
  const int64_t M = s.tokens, H = d.hidden;
  std::vector<T> y(M * H);
  if (d.mlp == 1)
    moe<T>(d, xn, M, rows, weights, y.data(), threads);
  else if (d.mlp == 2)
    gated_mlp<T>(d, xn, M, y.data(), threads);
  else
    return;
  add_into(h, y.data(), M * H, d.residual);
}

// The layer's decode step on h [tokens, hidden] (updated in place), attention and routing included.
template <typename T>
void run(const LayerDesc& d, const StepDesc& s, T* h, int threads) {
  const int64_t M = s.tokens, qs = d.heads * d.head_dim, E = std::max<int64_t>(d.n_experts, 1);
  std::vector<T> q(M * qs), attn(M * qs), xn(M * d.hidden), logits(M * E);
  attention_in<T>(d, s, h, q.data(), threads);
  attend<T>(d, s, q.data(), attn.data(), threads);
  post_attention<T>(d, s, h, attn.data(), xn.data(), logits.data(), threads);
  std::vector<int64_t> rows(M * std::max<int64_t>(d.top_k, 1));
  std::vector<float> weights(rows.size());
  if (d.mlp == 1)
    for (int64_t t = 0; t < M; ++t)
      route<T>(d, logits.data() + t * E, rows.data() + t * d.top_k, weights.data() + t * d.top_k);
  feed_forward<T>(d, s, h, xn.data(), rows.data(), weights.data(), threads);
}

}  // namespace layer
