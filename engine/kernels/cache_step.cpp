// The expert cache's control step for tables held in host memory (the virtual device), in one call.
//
// Same rules and the same results as the fixed-shape tensor version in engine/hierarchy/cache.py
// (which is what a GPU runs, inside a CUDA graph): on the CPU that version is ~50 small tensor ops,
// each costing microseconds of dispatch, while the decision itself is a few dozen integer moves.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

std::vector<torch::Tensor> cache_step_host(torch::Tensor ids, torch::Tensor slot_of, torch::Tensor expert_of,
                                           torch::Tensor last_used, torch::Tensor clock, torch::Tensor qtable,
                                           torch::Tensor stats, int64_t num_candidates) {
  for (const auto* t : {&ids, &slot_of, &expert_of, &last_used, &clock, &qtable, &stats})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->is_contiguous(),
                "cache tables must be contiguous int64 CPU tensors");
  const int64_t n = ids.numel(), num_slots = expert_of.numel() - 1, q_len = qtable.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* so = slot_of.data_ptr<int64_t>();
  int64_t* eo = expert_of.data_ptr<int64_t>();
  int64_t* lu = last_used.data_ptr<int64_t>();
  int64_t* st = stats.data_ptr<int64_t>();
  const int64_t now = clock.data_ptr<int64_t>()[0];

  std::vector<int64_t> unique(id, id + n);
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  std::vector<int64_t> misses, hit_slots;
  std::vector<char> was_hit(num_slots, 0);
  for (int64_t g : unique) {
    const int64_t s = so[g];
    if (s >= 0) {
      hit_slots.push_back(s);
      was_hit[s] = 1;
    } else {
      misses.push_back(g);  // ascending id order, as in the tensor version
    }
  }
  const int64_t m = misses.size(), hits = hit_slots.size();
  const int64_t q_want = qtable.data_ptr<int64_t>()[std::min(m, q_len - 1)];
  const int64_t q = std::min({q_want, num_slots - hits, num_candidates});
  // Victims: least recently used slots not hit in this step; ties by slot number.
  std::vector<std::pair<int64_t, int64_t>> free;
  free.reserve(num_slots - hits);
  for (int64_t s = 0; s < num_slots; ++s)
    if (!was_hit[s]) free.emplace_back(lu[s], s);
  std::partial_sort(free.begin(), free.begin() + q, free.end());

  auto opts = ids.options();
  auto src = torch::full({num_candidates}, -1, opts), dst = torch::full({num_candidates}, -1, opts);
  int64_t* sp = src.data_ptr<int64_t>();
  int64_t* dp = dst.data_ptr<int64_t>();
  int64_t evictions = 0;
  for (int64_t r = 0; r < q; ++r) {
    const int64_t v = free[r].second, g = misses[r], old = eo[v];
    if (old >= 0) {
      so[old] = -1;
      ++evictions;
    }
    so[g] = v;
    eo[v] = g;
    lu[v] = now;
    sp[r] = g;
    dp[r] = v;
  }
  for (int64_t s : hit_slots) lu[s] = now;
  clock.data_ptr<int64_t>()[0] = now + 1;
  const int64_t add[6] = {1, hits, m, q, m - q, evictions};
  for (int i = 0; i < 6; ++i) st[i] += add[i];
  auto pair_slot = torch::empty({n}, opts);
  int64_t* ps = pair_slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) ps[i] = so[id[i]];
  return {pair_slot, src, dst, torch::full({}, q, opts)};
}

// One batched fill: dst[dst_rows[j]] = src[src_rows[j]] for every j, rows copied in parallel
// (the virtual device's counterpart of one batched host-to-device copy).
void copy_rows(torch::Tensor dst, torch::Tensor dst_rows, torch::Tensor src, torch::Tensor src_rows) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() && src.is_contiguous() &&
                  dst.scalar_type() == src.scalar_type() && dst[0].numel() == src[0].numel(),
              "copy_rows: contiguous CPU tensors with rows of the same size and dtype");
  TORCH_CHECK(dst_rows.numel() == src_rows.numel() && dst_rows.scalar_type() == torch::kInt64 &&
                  src_rows.scalar_type() == torch::kInt64,
              "copy_rows: int64 row lists of equal length");
  const int64_t n = dst_rows.numel(), row_bytes = src[0].numel() * src.element_size();
  auto d = dst_rows.contiguous(), s = src_rows.contiguous();
  const int64_t* dp = d.data_ptr<int64_t>();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(dp[j] >= 0 && dp[j] < dst.size(0) && sp[j] >= 0 && sp[j] < src.size(0), "copy_rows: row out of range");
  char* out = static_cast<char*>(dst.data_ptr());
  const char* in = static_cast<const char*>(src.data_ptr());
  // Parallel over 64 KiB pieces so that even one large row uses every thread.
  const int64_t piece = 64 << 10, pieces = (row_bytes + piece - 1) / piece;
  at::parallel_for(0, n * pieces, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t j = i / pieces, off = (i % pieces) * piece, len = std::min(piece, row_bytes - off);
      std::memcpy(out + dp[j] * row_bytes + off, in + sp[j] * row_bytes + off, len);
    }
  });
}
