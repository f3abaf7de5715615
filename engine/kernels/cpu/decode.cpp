// Decode (few-token) CPU kernels: matrix-vector products that stream the weights at memory speed,
// RMSNorm, and a whole MoE layer's routed experts for one token in one call. This source is built once
// per instruction set, each time through a wrapper that names the module: decode_avx2.cpp (AVX2 + FMA +
// F16C; the dispatcher loads it only on CPUs that have them), decode_avx512.cpp (AVX-512, where the
// block-quantized kernels of blocks.h use 16 lanes) and decode_avx512vnni.cpp (AVX-512 VNNI, which adds
// the opt-in int8-activation kernels of q8.h).
//
// Numerics follow PyTorch's own low-precision kernels: products are accumulated in fp32 and every
// intermediate tensor the reference materialises (projection outputs, the activation, the gated
// product, the weighted expert outputs) is rounded to the model dtype at the same points. Only the
// order of the fp32 accumulation inside a dot product differs.
#include <vector>

#include "blocks.h"
#include "experts_gemm.h"
#include "native.h"

#ifndef HEARTH_DECODE_MODULE
#error "decode.cpp is built through a per-instruction-set wrapper (decode_avx2.cpp, ...) that names the module"
#endif

namespace {

using hearth::bf16;
using hearth::f16;
using hearth::fastcall;
using hearth::ptr;
using hearth::round_to;
using hearth::to_float;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return hearth::vec::widen_bf16x8(p); }
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum(__m256 v) { return hearth::vec::hsum8(v); }

// Dot product of one weight row (K elements) with an fp32 vector.
template <typename W>
inline float dot(const W* w, const float* x, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += to_float(w[k]) * x[k];
  return s;
}

#if defined(__AVX512F__)
// The same dot product 16 lanes wide, bit for bit: zmm b0 holds the 8-lane kernel's accumulators a0
// (elements k..k+7 of each 32) and a1 (k+8..k+15), b1 holds a2 and a3, and they are reduced in the
// 8-lane kernel's order. Half the instructions, the same rounding (tests hold the engine to
// transformers bit for bit in bf16 greedy decoding).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return hearth::vec::widen_bf16x16(p); }
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// out[m] = row w . xs[m] for M tokens at once, each token's as described above: the row's vectors are
// loaded and widened once for all the tokens, and the 2M independent accumulator chains keep the FMA
// units busy where one token's two chains wait on the FMA latency.
template <int M, typename W>
inline void dots16(const W* w, const float* const* xs, int64_t K, float* out) {
  __m512 b0[M], b1[M];
  for (int m = 0; m < M; ++m) b0[m] = b1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    // Rows are contiguous: fetching ahead (into L1 1 KiB ahead, into L2 8 KiB ahead) keeps more
    // lines in flight than the hardware prefetcher alone (decode is bound by how fast weights stream in).
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 8192, _MM_HINT_T1);
    const __m512 w0 = load16(w + k), w1 = load16(w + k + 16);
    for (int m = 0; m < M; ++m) {
      b0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[m] + k), b0[m]);
      b1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[m] + k + 16), b1[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const float* x = xs[m];
    __m256 a0 = _mm512_castps512_ps256(b0[m]), a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b0[m]), 1));
    __m256 a2 = _mm512_castps512_ps256(b1[m]), a3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b1[m]), 1));
    int64_t j = k;
    for (; j + 8 <= K; j += 8) a0 = _mm256_fmadd_ps(load8(w + j), _mm256_loadu_ps(x + j), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; j < K; ++j) s += to_float(w[j]) * x[j];
    out[m] = s;
  }
}

// One token (HEARTH_DOT in this build).
template <typename W>
inline float dot16(const W* w, const float* x, int64_t K) {
  float s;
  dots16<1>(w, &x, K, &s);
  return s;
}
#define HEARTH_DOT dot16

// dots16 for a run-time token count M (1..8).
template <typename W>
inline void dots(const W* w, const float* const* xs, int64_t K, int M, float* out) {
  hearth::blocks::with_tokens(M, [&](auto m) { dots16<decltype(m)::value>(w, xs, K, out); });
}
#else
#define HEARTH_DOT dot

template <typename W>
inline void dots(const W* w, const float* const* xs, int64_t K, int M, float* out) {
  for (int m = 0; m < M; ++m) out[m] = dot(w, xs[m], K);
}
#endif

using hearth::blocks::silu;

template <typename T>
std::vector<float> to_floats(const T* p, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(p[i]);
  return out;
}

// x: [M, K] with M small (decode steps of a few sequences). Each weight row is read from memory once
// and reused from L1 for every token; each token's dot product runs in exactly the order of the
// single-token case, so a sequence gets bit-identical results alone or in a batch.
template <typename T>
void linear_impl(const T* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias, T* out, int threads) {
  const auto xf = to_floats(x, M * K);
  const auto bf = bias != nullptr ? to_floats(bias, N) : std::vector<float>();
  hearth::parallel_for(0, N, 16, threads, [&](int64_t r0, int64_t r1) {
    const float* xs[hearth::blocks::kMaxTokens];
    float s[hearth::blocks::kMaxTokens];
    for (int64_t m0 = 0; m0 < M; m0 += hearth::blocks::kMaxTokens) {
      const int mt = static_cast<int>(std::min<int64_t>(hearth::blocks::kMaxTokens, M - m0));
      for (int m = 0; m < mt; ++m) xs[m] = xf.data() + (m0 + m) * K;
      for (int64_t r = r0; r < r1; ++r) {
        dots(w + r * K, xs, K, mt, s);
        for (int m = 0; m < mt; ++m)
          out[(m0 + m) * N + r] = hearth::from_float<T>(bf.empty() ? s[m] : s[m] + bf[r]);
      }
    }
  });
}

// One token's k routed experts: gate_up [rows, 2I, H], down [rows, H, I], pool rows ids[k], routing
// weights (widened to fp32; `weights_fp32` says whether they were fp32 to begin with) -> out [H],
// rounded to the model dtype unless `fp32_out` (a partial sum that another path's part is added to).
template <typename T>
void experts_impl(const T* x, int64_t H, const T* gate_up, const T* down, int64_t I, const int64_t* ids, int64_t k,
                  const float* weights, bool weights_fp32, void* out, bool fp32_out, int threads) {
  const auto xf = to_floats(x, H);
  std::vector<float> proj(k * 2 * I), act(k * I), y(k * H);
  hearth::parallel_for(0, k * 2 * I, 32, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = r / (2 * I), row = r % (2 * I);
      proj[r] = round_to<T>(HEARTH_DOT(gate_up + (ids[j] * 2 * I + row) * H, xf.data(), H));
    }
  });
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < I; ++i) {
      const float g = proj[j * 2 * I + i], u = proj[j * 2 * I + I + i];
      act[j * I + i] = round_to<T>(round_to<T>(silu(g)) * u);
    }
  hearth::parallel_for(0, k * H, 32, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = r / H, row = r % H;
      y[r] = round_to<T>(HEARTH_DOT(down + (ids[j] * H + row) * I, act.data() + j * I, I));
    }
  });
  // Weighted sum over the k experts with fp32 accumulation; each weighted term is rounded to the
  // promoted dtype of (model dtype, weight dtype), as the reference's elementwise product is.
  for (int64_t h = 0; h < H; ++h) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float term = y[j * H + h] * weights[j];
      s += weights_fp32 ? term : round_to<T>(term);
    }
    if (fp32_out)
      static_cast<float*>(out)[h] = s;
    else
      static_cast<T*>(out)[h] = hearth::from_float<T>(s);
  }
}

// RMSNorm over the last dimension, in the reference's order: fp32 normalise, round to the model
// dtype, then scale by the weight (rounded again).
template <typename T>
void rms_norm_impl(const T* x, int64_t rows, int64_t D, const T* w, float eps, T* out, int threads) {
  hearth::parallel_for(0, rows, 256, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        const float v = to_float(row[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int64_t i = 0; i < D; ++i) {
        const float normed = round_to<T>(to_float(row[i]) * inv);
        out[r * D + i] = hearth::from_float<T>(to_float(w[i]) * normed);
      }
    }
  });
}

#include "layer.h"

// Calls `fn` with a typed null pointer of the dtype's element type; -1 for an unknown dtype code.
template <typename F>
int by_dtype(int dtype, const F& fn) {
  switch (dtype) {
    case hearth::kFloat32: fn(static_cast<float*>(nullptr)); return 0;
    case hearth::kBFloat16: fn(static_cast<bf16*>(nullptr)); return 0;
    case hearth::kFloat16: fn(static_cast<f16*>(nullptr)); return 0;
    default: return -1;
  }
}

// -- Python entry points (METH_FASTCALL; pointers and sizes as ints; the GIL is released) ---------

// linear_decode(dtype, x, M, K, w, N, bias or None, out, threads): out[M, N] = x[M, K] @ w[N, K]^T (+ bias)
PyObject* py_linear_decode(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[9];
  if (!hearth::int_args(args, n, 9, a, "linear_decode")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = by_dtype(static_cast<int>(a[0]), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    linear_impl<T>(ptr<const T>(a[1]), a[2], a[3], ptr<const T>(a[4]), a[5], ptr<const T>(a[6]), ptr<T>(a[7]),
                   static_cast<int>(a[8]));
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// The routing weights [k] of dtype code `dtype` at `address`, widened to fp32.
bool widen_weights(int64_t address, int dtype, size_t k, std::vector<float>& out) {
  out.resize(k);
  return by_dtype(dtype, [&](auto* tag) {
    using W = std::remove_pointer_t<decltype(tag)>;
    const W* w = ptr<const W>(address);
    for (size_t j = 0; j < k; ++j) out[j] = to_float(w[j]);
  }) == 0;
}

// The pool rows (a list, each in [0, rows)) and routing weights (k of dtype code `dtype` at
// `address`, widened to fp32) of an experts call; false with a Python error set when invalid.
bool routed_args(PyObject* list, int64_t rows, int64_t address, int dtype, const char* name,
                 std::vector<int64_t>& ids, std::vector<float>& weights) {
  const Py_ssize_t k = PyList_GET_SIZE(list);
  ids.resize(k);
  for (Py_ssize_t j = 0; j < k; ++j) {
    ids[j] = PyLong_AsLongLong(PyList_GET_ITEM(list, j));
    if (ids[j] == -1 && PyErr_Occurred()) return false;
    if (ids[j] < 0 || ids[j] >= rows) {
      PyErr_Format(PyExc_ValueError, "%s: pool row %lld out of range [0, %lld)", name,
                   static_cast<long long>(ids[j]), static_cast<long long>(rows));
      return false;
    }
  }
  if (!widen_weights(address, dtype, k, weights)) {
    PyErr_Format(PyExc_ValueError, "%s: unsupported weight dtype", name);
    return false;
  }
  return true;
}

// experts_decode(dtype, x, H, gate_up, down, I, rows, ids (list of pool rows), weights, weights_dtype, out,
//                fp32_out, threads)
PyObject* py_experts_decode(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 13 || !PyList_Check(args[7])) {
    PyErr_SetString(PyExc_TypeError, "experts_decode takes 13 arguments, the 8th a list of pool rows");
    return nullptr;
  }
  PyObject* ints[13];
  std::copy(args, args + 13, ints);
  ints[7] = Py_None;
  int64_t a[13];
  if (!hearth::int_args(ints, 13, 13, a, "experts_decode")) return nullptr;
  std::vector<int64_t> ids;
  std::vector<float> weights;
  if (!routed_args(args[7], a[6], a[8], static_cast<int>(a[9]), "experts_decode", ids, weights)) return nullptr;
  const Py_ssize_t k = static_cast<Py_ssize_t>(ids.size());
  const bool weights_fp32 = a[9] == hearth::kFloat32;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = by_dtype(static_cast<int>(a[0]), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    experts_impl<T>(ptr<const T>(a[1]), a[2], ptr<const T>(a[3]), ptr<const T>(a[4]), a[5], ids.data(), k,
                    weights.data(), weights_fp32, ptr<void>(a[10]), a[11] != 0, static_cast<int>(a[12]));
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// linear_blocks(fmt, x, M, K, w, N, out, threads, q8): out fp32 [M, N] = x fp32 [M, K] @ W^T, W uint8
// [N, K / elems * bytes] in block format `fmt` (a code of blocks.h); q8: the int8-activation mode where
// the format has its kernel. Returns 0, or -1 for an unknown format.
PyObject* py_linear_blocks(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[9];
  if (!hearth::int_args(args, n, 9, a, "linear_blocks")) return nullptr;
  bool ok;
  Py_BEGIN_ALLOW_THREADS
  ok = hearth::blocks::by_format(static_cast<int>(a[0]), [&](auto f) {
    hearth::blocks::linear_impl<decltype(f)>(ptr<const float>(a[1]), a[2], a[3], ptr<const uint8_t>(a[4]), a[5],
                                             ptr<float>(a[6]), static_cast<int>(a[7]), a[8] != 0);
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(ok ? 0 : -1);
}

// experts_blocks(fmt_gate_up, fmt_down, x, T, H, I, gate_up, gu_stride, down, dn_stride, n_rows, rows, k,
//                weights, out, threads, q8): see blocks::experts_impl (rows int64 [T*k], weights fp32 [T*k]).
// Returns 0, -1 for an unknown format, -2 for a row out of range.
PyObject* py_experts_blocks(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[17];
  if (!hearth::int_args(args, n, 17, a, "experts_blocks")) return nullptr;
  int rc = -1;
  Py_BEGIN_ALLOW_THREADS
  hearth::blocks::by_format(static_cast<int>(a[0]), [&](auto fg) {
    hearth::blocks::by_format(static_cast<int>(a[1]), [&](auto fd) {
      const bool ok = hearth::blocks::experts_impl<decltype(fg), decltype(fd)>(
          ptr<const float>(a[2]), a[3], a[4], a[5], ptr<const uint8_t>(a[6]), a[7], ptr<const uint8_t>(a[8]), a[9],
          a[10], ptr<const int64_t>(a[11]), a[12], ptr<const float>(a[13]), ptr<float>(a[14]),
          static_cast<int>(a[15]), a[16] != 0);
      rc = ok ? 0 : -2;
    });
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// experts_gemm(fmt_gate_up, fmt_down, x, T, H, I, gate_up, gu_stride, down, dn_stride, n_rows, rows, k,
//              weights, out, threads): see blocks::experts_gemm_impl (experts_blocks' arguments, any T, fp32
// activations). Returns 0, -1 for an unknown format, -2 for a row out of range.
PyObject* py_experts_gemm(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[16];
  if (!hearth::int_args(args, n, 16, a, "experts_gemm")) return nullptr;
  int rc = -1;
  Py_BEGIN_ALLOW_THREADS
  hearth::blocks::by_format(static_cast<int>(a[0]), [&](auto fg) {
    hearth::blocks::by_format(static_cast<int>(a[1]), [&](auto fd) {
      const bool ok = hearth::blocks::experts_gemm_impl<decltype(fg), decltype(fd)>(
          ptr<const float>(a[2]), a[3], a[4], a[5], ptr<const uint8_t>(a[6]), a[7], ptr<const uint8_t>(a[8]), a[9],
          a[10], ptr<const int64_t>(a[11]), a[12], ptr<const float>(a[13]), ptr<float>(a[14]),
          static_cast<int>(a[15]));
      rc = ok ? 0 : -2;
    });
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// dequantize_blocks(fmt, w, rows, K, stride, out, threads): out fp32 [rows, K] = rows of blocks in format
// `fmt` (row r at w + r * stride bytes) decoded. Returns 0, or -1 for an unknown format.
PyObject* py_dequantize_blocks(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[7];
  if (!hearth::int_args(args, n, 7, a, "dequantize_blocks")) return nullptr;
  bool ok;
  Py_BEGIN_ALLOW_THREADS
  ok = hearth::blocks::by_format(static_cast<int>(a[0]), [&](auto f) {
    hearth::blocks::dequantize_impl<decltype(f)>(ptr<const uint8_t>(a[1]), a[2], a[3], a[4], ptr<float>(a[5]),
                                                 static_cast<int>(a[6]));
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(ok ? 0 : -1);
}

// rms_norm(dtype, x, rows, D, w, eps, out, threads)
PyObject* py_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 8) {
    PyErr_Format(PyExc_TypeError, "rms_norm takes 8 arguments (%zd given)", n);
    return nullptr;
  }
  const double eps = PyFloat_AsDouble(args[5]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  int64_t a[8];
  PyObject* ints[8] = {args[0], args[1], args[2], args[3], args[4], Py_None, args[6], args[7]};
  if (!hearth::int_args(ints, 8, 8, a, "rms_norm")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = by_dtype(static_cast<int>(a[0]), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_impl<T>(ptr<const T>(a[1]), a[2], a[3], ptr<const T>(a[4]), static_cast<float>(eps), ptr<T>(a[6]),
                     static_cast<int>(a[7]));
  });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// decode_layer(part, layer_desc, step_desc, h, a, b, c, c_dtype, threads): one decoder layer's decode step on
// h [tokens, hidden], in place (see layer.h), whole or in parts around torch's attention and router:
//   0: the whole layer (a, b, c unused);
//   1: attention_in, queries to a [tokens, heads, D];
//   2: post_attention from the attention output a; the post norm to b, the router logits to c;
//   3: feed_forward from b = xn, a = the chosen experts int64 [tokens, k] (the layer's own numbering),
//      c = their weights [tokens, k] of dtype code c_dtype.
// Returns 0, -1 for an unknown dtype or part.
PyObject* py_decode_layer(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[9];
  if (!hearth::int_args(args, n, 9, a, "decode_layer")) return nullptr;
  const auto& d = *ptr<const layer::LayerDesc>(a[1]);
  const auto& s = *ptr<const layer::StepDesc>(a[2]);
  const int part = static_cast<int>(a[0]), threads = static_cast<int>(a[8]);
  int rc = part >= 0 && part <= 3 ? 0 : -1;
  std::vector<int64_t> rows;
  std::vector<float> weights;
  if (rc == 0 && part == 3 && d.mlp == 1) {  // pool rows and fp32 weights of the routing torch chose
    const int64_t pairs = s.tokens * d.top_k;
    const int64_t* experts = ptr<const int64_t>(a[4]);
    rows.resize(pairs);
    for (int64_t i = 0; i < pairs; ++i) rows[i] = d.row_base + experts[i];
    if (!widen_weights(a[6], static_cast<int>(a[7]), pairs, weights)) rc = -1;
  }
  Py_BEGIN_ALLOW_THREADS
  if (rc == 0)
    rc = by_dtype(static_cast<int>(d.dtype), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      T* h = ptr<T>(a[3]);
      if (part == 0) layer::run<T>(d, s, h, threads);
      if (part == 1) layer::attention_in<T>(d, s, h, ptr<T>(a[4]), threads);
      if (part == 2) layer::post_attention<T>(d, s, h, ptr<const T>(a[4]), ptr<T>(a[5]), ptr<T>(a[6]), threads);
      if (part == 3) layer::feed_forward<T>(d, s, h, ptr<const T>(a[5]), rows.data(), weights.data(), threads);
    });
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// decode_layers(descs, n, step_desc, h, threads): n whole layers one after another on h (descs: an int64
// array of LayerDesc addresses), in one call: a step of a model whose every layer runs natively pays
// for one crossing from Python and one release of the GIL instead of one per layer. Returns 0, or -1
// for an unknown dtype.
PyObject* py_decode_layers(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[5];
  if (!hearth::int_args(args, n, 5, a, "decode_layers")) return nullptr;
  const int64_t* descs = ptr<const int64_t>(a[0]);
  const auto& s = *ptr<const layer::StepDesc>(a[2]);
  const int threads = static_cast<int>(a[4]);
  int rc = 0;
  Py_BEGIN_ALLOW_THREADS
  for (int64_t i = 0; i < a[1] && rc == 0; ++i) {
    const auto& d = *ptr<const layer::LayerDesc>(descs[i]);
    rc = by_dtype(static_cast<int>(d.dtype), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      layer::run<T>(d, s, ptr<T>(a[3]), threads);
    });
  }
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// The sizes in int64 words of LayerDesc and StepDesc, which the Python side fills.
PyObject* py_layer_desc_size(PyObject*, PyObject*) {
  return Py_BuildValue("(nn)", static_cast<Py_ssize_t>(sizeof(layer::LayerDesc) / 8),
                       static_cast<Py_ssize_t>(sizeof(layer::StepDesc) / 8));
}

// The integer dot-product kernels of this build (q8.h): "avx512-vnni", "avx-vnni" or "avx2".
PyObject* py_q8_kernel(PyObject*, PyObject*) { return PyUnicode_FromString(hearth::blocks::kQ8Kernel); }

PyMethodDef methods[] = {
    {"q8_kernel", py_q8_kernel, METH_NOARGS, "the integer dot-product kernels of this build"},
    {"source_hash", hearth::py_source_hash, METH_NOARGS, "hash of the sources this module was built from"},
    {"decode_layer", fastcall(py_decode_layer), METH_FASTCALL, "one decoder layer's decode step, in place"},
    {"decode_layers", fastcall(py_decode_layers), METH_FASTCALL, "whole decoder layers' decode step, in place"},
    {"layer_desc_size", py_layer_desc_size, METH_NOARGS, "int64 words of LayerDesc and StepDesc"},
    {"linear_decode", fastcall(py_linear_decode), METH_FASTCALL, "out = x @ w^T (+ bias) for a few tokens"},
    {"experts_decode", fastcall(py_experts_decode), METH_FASTCALL, "one token's routed experts, weighted and summed"},
    {"linear_blocks", fastcall(py_linear_blocks), METH_FASTCALL, "fp32 x @ W^T for block-quantized W"},
    {"experts_blocks", fastcall(py_experts_blocks), METH_FASTCALL,
     "a few tokens' routed block-quantized experts, weighted and summed"},
    {"experts_gemm", fastcall(py_experts_gemm), METH_FASTCALL,
     "many tokens' routed block-quantized experts (fp32 activations), weighted and summed"},
    {"dequantize_blocks", fastcall(py_dequantize_blocks), METH_FASTCALL, "rows of blocks decoded to fp32"},
    {"rms_norm", fastcall(py_rms_norm), METH_FASTCALL, "weight * round(x * rsqrt(mean(x^2) + eps))"},
    {nullptr, nullptr, 0, nullptr}};

#define HEARTH_STR2(x) #x
#define HEARTH_STR(x) HEARTH_STR2(x)
#define HEARTH_CAT2(a, b) a##b
#define HEARTH_CAT(a, b) HEARTH_CAT2(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, HEARTH_STR(HEARTH_DECODE_MODULE),
                      "hearth's decode kernels (" HEARTH_STR(HEARTH_DECODE_MODULE) ")", -1, methods};

}  // namespace

PyMODINIT_FUNC HEARTH_CAT(PyInit_, HEARTH_DECODE_MODULE)() { return PyModule_Create(&module); }
