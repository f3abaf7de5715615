// What every native kernel module shares: dtype codes, half-precision conversions that round exactly
// as PyTorch's c10::BFloat16 / c10::Half do, a parallel loop that splits a range the way
// at::parallel_for does (on the OpenMP runtime torch itself loaded: same soname, one thread pool), and
// the argument parsing of the Python entry points.
//
// The modules take raw pointers (tensor.data_ptr()) and sizes as Python ints, not torch tensors: they
// build without torch's headers and keep working when torch is upgraded (no C++ ABI to match). The
// Python side (kernels/cpu/__init__.py) checks dtypes, shapes and contiguity before calling.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hearth {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16 <-> fp32 with round-to-nearest-even (NaN stays a quiet NaN), as c10::BFloat16.
inline float to_float(bf16 v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }
inline bf16 to_bf16(float f) {
  if (std::isnan(f)) return {0x7FC0};
  const uint32_t u = float_to_bits(f);
  return {static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFF) >> 16)};
}

#ifdef __F16C__
// IEEE fp16 <-> fp32 with round-to-nearest-even in hardware (exactly c10::Half's conversions).
inline float to_float(f16 v) { return _cvtsh_ss(v.bits); }
inline f16 to_f16(float f) { return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))}; }
#endif

inline float to_float(float v) { return v; }

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline bf16 from_float<bf16>(float v) { return to_bf16(v); }
#ifdef __F16C__
template <>
inline f16 from_float<f16>(float v) { return to_f16(v); }
#endif

// Round an fp32 value to the model dtype and back (identity for fp32).
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

// f(begin, end) over [begin, end) in up to `threads` contiguous chunks of at least `grain` items,
// serially inside a parallel region (at::parallel_for's rules).
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t tasks = std::min<int64_t>(std::max(threads, 1), (range + grain - 1) / grain);
  if (tasks <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + tasks - 1) / tasks;
#pragma omp parallel num_threads(static_cast<int>(tasks))
  {
    const int64_t lo = begin + omp_get_thread_num() * chunk;
    if (lo < end) f(lo, std::min(end, lo + chunk));
  }
}

// Python ints (None: 0) -> int64 arguments, for METH_FASTCALL entry points; false with a TypeError set.
inline bool int_args(PyObject* const* args, Py_ssize_t n, Py_ssize_t want, int64_t* out, const char* name) {
  if (n != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, n);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = args[i] == Py_None ? 0 : PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// A METH_FASTCALL function as the PyCFunction that PyMethodDef holds.
template <typename F>
inline PyCFunction fastcall(F fn) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

template <typename T>
inline T* ptr(int64_t address) { return reinterpret_cast<T*>(static_cast<intptr_t>(address)); }

// source_hash(): a hash of the kernel sources the module was built from (set by setup.py), so that an
// editable checkout whose sources changed since the last build (or whose rebuild of one library
// failed) falls back instead of running stale code. Every module exports it.
inline PyObject* py_source_hash(PyObject*, PyObject*) {
#ifdef HEARTH_SOURCE_HASH
  return PyUnicode_FromString(HEARTH_SOURCE_HASH);
#else
  return PyUnicode_FromString("");
#endif
}

}  // namespace hearth
