// Single-token (decode) CPU kernels: matrix-vector products that stream weights at memory speed,
// and a whole MoE layer's routed experts for one token in one call.
//
// Numerics follow PyTorch's own low-precision kernels: products are accumulated in fp32 and every
// intermediate tensor the reference materialises (projection outputs, the activation, the gated
// product, the weighted expert outputs) is rounded to the model dtype at the same points. Only the
// order of the fp32 accumulation inside a dot product differs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x55));
  return _mm_cvtss_f32(lo);
}

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
  for (; k < K; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

// Round an fp32 value to the model dtype and back (identity for fp32).
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

template <typename T>
std::vector<float> to_float(const torch::Tensor& t) {
  auto c = t.contiguous();
  const T* p = c.data_ptr<T>();
  std::vector<float> out(c.numel());
  for (int64_t i = 0; i < c.numel(); ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// x: [M, K] with M small (decode steps of a few sequences). Each weight row is read from memory
// once and reused from L1 for every token; each token's dot product runs in exactly the order of
// the single-token case, so a sequence gets bit-identical results alone or in a batch.
template <typename T>
torch::Tensor linear_impl(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const int64_t N = w.size(0), K = w.size(1), M = x.numel() / K;
  auto xf = to_float<T>(x);
  std::vector<float> bf;
  if (bias.has_value()) bf = to_float<T>(*bias);
  auto out = torch::empty({M, N}, x.options());
  T* o = out.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t m = 0; m < M; ++m) {
        float s = dot(wp + r * K, xf.data() + m * K, K);
        if (!bf.empty()) s += bf[r];
        o[m * N + r] = static_cast<T>(s);
      }
    }
  });
  return out;
}

template <typename T>
torch::Tensor experts_impl(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                           const std::vector<int64_t>& ids, const torch::Tensor& weights, bool fp32_out) {
  const int64_t k = ids.size(), H = gate_up.size(2), I = down.size(2);
  auto xf = to_float<T>(x);
  const T* gu = gate_up.data_ptr<T>();
  const T* dn = down.data_ptr<T>();
  std::vector<float> proj(k * 2 * I), act(k * I), y(k * H);
  at::parallel_for(0, k * 2 * I, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = r / (2 * I), row = r % (2 * I);
      proj[r] = round_to<T>(dot(gu + (ids[j] * 2 * I + row) * H, xf.data(), H));
    }
  });
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = 0; i < I; ++i) {
      const float g = proj[j * 2 * I + i], u = proj[j * 2 * I + I + i];
      act[j * I + i] = round_to<T>(round_to<T>(silu(g)) * u);
    }
  at::parallel_for(0, k * H, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = r / H, row = r % H;
      y[r] = round_to<T>(dot(dn + (ids[j] * H + row) * I, act.data() + j * I, I));
    }
  });
  // Weighted sum over the k experts with fp32 accumulation; each weighted term is rounded to the
  // promoted dtype of (model dtype, weight dtype), as the reference's elementwise product is.
  const bool fp32_weights = weights.scalar_type() == torch::kFloat32;
  auto wf = weights.to(torch::kFloat32).contiguous();
  const float* wv = wf.data_ptr<float>();
  // fp32_out keeps the fp32 sum unrounded: a partial sum that another path's part is added to.
  auto out = torch::empty({1, H}, x.options().dtype(fp32_out ? torch::kFloat32 : x.scalar_type()));
  for (int64_t h = 0; h < H; ++h) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float term = y[j * H + h] * wv[j];
      s += fp32_weights ? term : round_to<T>(term);
    }
    if (fp32_out)
      out.data_ptr<float>()[h] = s;
    else
      out.data_ptr<T>()[h] = static_cast<T>(s);
  }
  return out;
}

// RMSNorm over the last dimension, in the reference's order: fp32 normalise, round to the model
// dtype, then scale by the weight (rounded again).
template <typename T>
torch::Tensor rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  auto out = torch::empty_like(xc);
  const T* xp = xc.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        const float v = static_cast<float>(row[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) {
        const float normed = round_to<T>(static_cast<float>(row[i]) * inv);
        op[r * D + i] = static_cast<T>(static_cast<float>(wp[i]) * normed);
      }
    }
  });
  return out;
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

}  // namespace

torch::Tensor linear_decode(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(),
              "x must be [M, K] in the weight's dtype");
  switch (w.scalar_type()) {
    case torch::kFloat32: return linear_impl<float>(x, w, bias);
    case torch::kBFloat16: return linear_impl<at::BFloat16>(x, w, bias);
    case torch::kFloat16: return linear_impl<at::Half>(x, w, bias);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

torch::Tensor experts_decode(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down, std::vector<int64_t> ids,
                             torch::Tensor weights, bool fp32_out) {
  check_cpu(gate_up, "gate_up");
  check_cpu(down, "down");
  TORCH_CHECK(x.numel() == gate_up.size(2) && x.scalar_type() == gate_up.scalar_type(), "bad x");
  switch (gate_up.scalar_type()) {
    case torch::kFloat32: return experts_impl<float>(x, gate_up, down, ids, weights, fp32_out);
    case torch::kBFloat16: return experts_impl<at::BFloat16>(x, gate_up, down, ids, weights, fp32_out);
    case torch::kFloat16: return experts_impl<at::Half>(x, gate_up, down, ids, weights, fp32_out);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_cpu(weight, "weight");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == weight.scalar_type() && x.size(-1) == weight.numel(),
              "x must be a CPU tensor [..., D] in the weight's dtype");
  switch (x.scalar_type()) {
    case torch::kFloat32: return rms_norm_impl<float>(x, weight, eps);
    case torch::kBFloat16: return rms_norm_impl<at::BFloat16>(x, weight, eps);
    case torch::kFloat16: return rms_norm_impl<at::Half>(x, weight, eps);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

// Defined in cache_step.cpp.
std::vector<torch::Tensor> cache_step_host(torch::Tensor ids, torch::Tensor slot_of, torch::Tensor expert_of,
                                           torch::Tensor last_used, torch::Tensor clock, torch::Tensor qtable,
                                           torch::Tensor stats, int64_t num_candidates);
void copy_rows(torch::Tensor dst, torch::Tensor dst_rows, torch::Tensor src, torch::Tensor src_rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cache_step_host", &cache_step_host, "the expert cache's control step on host-memory tables");
  m.def("copy_rows", &copy_rows, "dst[dst_rows[j]] = src[src_rows[j]], rows copied in parallel");
  m.def("rms_norm", &rms_norm, "weight * round(x * rsqrt(mean(x^2) + eps)) over the last dimension");
  m.def("linear_decode", &linear_decode, "y[1,N] = x[1,K] @ w[N,K]^T (+ bias) for one token");
  m.def("experts_decode", &experts_decode, "weighted sum of one token's routed experts (fp32_out: unrounded fp32 sum)",
        py::arg("x"), py::arg("gate_up"), py::arg("down"), py::arg("ids"), py::arg("weights"),
        py::arg("fp32_out") = false);
}
