// The kernels every machine gets (no vector-ISA flags): CPU feature detection for the dispatcher,
// the expert cache's control step on host-memory tables, and the virtual device's batched row copy.
#include <vector>

#include "native.h"

namespace {

// Feature bits reported to the dispatcher (kernels/cpu/__init__.py reads the same bits).
enum Feature : int {
  kAvx2 = 1 << 0,  // AVX2 + FMA + F16C: the decode kernels of decode.cpp
  kAvx512 = 1 << 1,  // AVX-512 F/BW/VL
  kAvx512Bf16 = 1 << 2,
  kAvx512Vnni = 1 << 3,
  kAmx = 1 << 4,  // AMX tiles (bf16/int8)
  kAvxVnni = 1 << 5,  // AVX-VNNI: vpdpbusd on 256 bits with a VEX encoding (no AVX-512 needed)
};

int cpu_features() {
  int bits = 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) bits |= kAvx2;  // F16C comes with them
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    bits |= kAvx512;
  if (__builtin_cpu_supports("avx512bf16")) bits |= kAvx512Bf16;
  if (__builtin_cpu_supports("avx512vnni")) bits |= kAvx512Vnni;
  if (__builtin_cpu_supports("amx-tile")) bits |= kAmx;
  if (__builtin_cpu_supports("avxvnni")) bits |= kAvxVnni;
#endif
  return bits;
}

// The cache-control step (same rules and results as cache_step in experts/cache.py, which a GPU runs
// inside a CUDA graph): dedupe the routed ids, classify hits and misses, read q = qtable[m], take the q
// least recently used slots not hit in this step (ties by slot number) and update the tables in place.
// Writes pair_slot[n] (the slot serving each routed pair after the fills, -1: the CPU) and the fill plan
// src/dst[num_candidates] (-1 past q); returns q.
int64_t cache_step(const int64_t* ids, int64_t n, int64_t* slot_of, int64_t* expert_of, int64_t num_slots,
                   int64_t* last_used, int64_t* clock, const int64_t* qtable, int64_t q_len, int64_t* stats,
                   int64_t num_candidates, int64_t* pair_slot, int64_t* src, int64_t* dst) {
  const int64_t now = clock[0];
  std::vector<int64_t> unique(ids, ids + n);
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  std::vector<int64_t> misses, hit_slots;
  std::vector<char> was_hit(num_slots, 0);
  for (int64_t g : unique) {
    const int64_t s = slot_of[g];
    if (s >= 0) {
      hit_slots.push_back(s);
      was_hit[s] = 1;
    } else {
      misses.push_back(g);  // ascending id order, as in the tensor version
    }
  }
  const int64_t m = misses.size(), hits = hit_slots.size();
  const int64_t q_want = qtable[std::min(m, q_len - 1)];
  const int64_t q = std::min({q_want, num_slots - hits, num_candidates});
  std::vector<std::pair<int64_t, int64_t>> free;  // (last used, slot) of the slots this step may take
  free.reserve(num_slots - hits);
  for (int64_t s = 0; s < num_slots; ++s)
    if (!was_hit[s]) free.emplace_back(last_used[s], s);
  std::partial_sort(free.begin(), free.begin() + q, free.end());
  std::fill(src, src + num_candidates, -1);
  std::fill(dst, dst + num_candidates, -1);
  int64_t evictions = 0;
  for (int64_t r = 0; r < q; ++r) {
    const int64_t v = free[r].second, g = misses[r], old = expert_of[v];
    if (old >= 0) {
      slot_of[old] = -1;
      ++evictions;
    }
    slot_of[g] = v;
    expert_of[v] = g;
    last_used[v] = now;
    src[r] = g;
    dst[r] = v;
  }
  for (int64_t s : hit_slots) last_used[s] = now;
  clock[0] = now + 1;
  const int64_t add[6] = {1, hits, m, q, m - q, evictions};
  for (int i = 0; i < 6; ++i) stats[i] += add[i];
  for (int64_t i = 0; i < n; ++i) pair_slot[i] = slot_of[ids[i]];
  return q;
}

// One batched fill: row dst_rows[j] of dst = row src_rows[j] of src, for every j (the virtual
// device's counterpart of a batched host-to-device copy). Parallel over 64 KiB pieces so that even one
// large row uses every thread. Returns -1 when a row index is out of range (nothing is copied).
int copy_rows(char* dst, const int64_t* dst_rows, int64_t dst_len, const char* src, const int64_t* src_rows,
              int64_t src_len, int64_t n, int64_t row_bytes, int threads) {
  for (int64_t j = 0; j < n; ++j)
    if (dst_rows[j] < 0 || dst_rows[j] >= dst_len || src_rows[j] < 0 || src_rows[j] >= src_len) return -1;
  const int64_t piece = 64 << 10, pieces = (row_bytes + piece - 1) / piece;
  hearth::parallel_for(0, n * pieces, 1, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t j = i / pieces, off = (i % pieces) * piece, len = std::min(piece, row_bytes - off);
      std::memcpy(dst + dst_rows[j] * row_bytes + off, src + src_rows[j] * row_bytes + off, len);
    }
  });
  return 0;
}

// -- Python entry points (METH_FASTCALL; pointers and sizes as ints) -------------------------------
PyObject* py_cpu_features(PyObject*, PyObject*) { return PyLong_FromLong(cpu_features()); }

// cache_step(ids, n, slot_of, expert_of, num_slots, last_used, clock, qtable, q_len, stats, num_candidates,
//            pair_slot, src, dst) -> q
PyObject* py_cache_step(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[14];
  if (!hearth::int_args(args, n, 14, a, "cache_step")) return nullptr;
  using hearth::ptr;
  const int64_t q = cache_step(ptr<const int64_t>(a[0]), a[1], ptr<int64_t>(a[2]), ptr<int64_t>(a[3]), a[4],
                               ptr<int64_t>(a[5]), ptr<int64_t>(a[6]), ptr<const int64_t>(a[7]), a[8],
                               ptr<int64_t>(a[9]), a[10], ptr<int64_t>(a[11]), ptr<int64_t>(a[12]),
                               ptr<int64_t>(a[13]));
  return PyLong_FromLongLong(q);
}

// copy_rows(dst, dst_rows, dst_len, src, src_rows, src_len, n, row_bytes, threads) -> 0, or -1 (out of range)
PyObject* py_copy_rows(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t a[9];
  if (!hearth::int_args(args, n, 9, a, "copy_rows")) return nullptr;
  using hearth::ptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = copy_rows(ptr<char>(a[0]), ptr<const int64_t>(a[1]), a[2], ptr<const char>(a[3]), ptr<const int64_t>(a[4]),
                 a[5], a[6], a[7], static_cast<int>(a[8]));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyMethodDef methods[] = {
    {"cpu_features", py_cpu_features, METH_NOARGS, "feature bits of this CPU (see kernels/cpu/__init__.py)"},
    {"source_hash", hearth::py_source_hash, METH_NOARGS, "hash of the sources this module was built from"},
    {"cache_step", hearth::fastcall(py_cache_step), METH_FASTCALL,
     "the expert cache's control step on host-memory tables"},
    {"copy_rows", hearth::fastcall(py_copy_rows), METH_FASTCALL,
     "dst[dst_rows[j]] = src[src_rows[j]], rows copied in parallel"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_base", "hearth's kernels for every CPU", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__native_base() { return PyModule_Create(&module); }
