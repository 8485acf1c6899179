// The machine's floors for bench/lm_floor.py, which compares a CPU forward with them; built on
// first use by bench/probes.py (torch.utils.cpp_extension.load), never part of genlm_fast._C.
//
//   stream_read(data, streams, threads, ahead=0) -> the sum of `data`, each of `threads` threads
//       reading its share as `streams` interleaved sequential streams, each stream's line
//       `ahead` bytes on prefetched (0: none) as the panel kernels do (the time to read the
//       weights once: a forward's software prefetches can read faster than the hardware
//       prefetcher alone, so a floor takes the best of both)
//   fma_rate(iterations, threads) -> FLOP/s of register-only float32 multiply-adds on `threads`
//       threads, `iterations` each
//   isa() -> the instructions both use: "avx512" or "avx2", the widest this CPU runs by
//       genlm_fast's own check (csrc/cpu_features.h), as its CPU kernels pick theirs
//
// The caller passes the team size of the kernel it compares.

#include <torch/extension.h>

#include <omp.h>

#include "cpu_features.h"  // genlm_fast's own check (csrc/), so both pick alike

#include <cstdint>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define GF_PROBES 1
#define GF_AVX512 __attribute__((target("avx512f")))
#define GF_AVX2 __attribute__((target("avx2,fma")))
#else
#define GF_PROBES 0
#define GF_AVX512
#define GF_AVX2
#endif

namespace {

std::string isa() {
  if (GF_PROBES && genlm_fast::cpu::cpu_has("avx512")) return "avx512";
  if (GF_PROBES && genlm_fast::cpu::cpu_has("avx2")) return "avx2";
  return "none";
}

#if GF_PROBES
// (vectors pass between the helpers below only inside the functions they are inlined into:
// no call ever crosses the ABI that -Wpsabi warns about)
#pragma GCC diagnostic ignored "-Wpsabi"

// One thread's share of each probe, written once over a generic vector of W floats; each
// instantiation is inlined whole (flatten) into a function compiled for the instructions
// that hold W floats in one register, so the vectors are zmm (W = 16) or ymm (W = 8).
template <int W>
struct Probe {
  typedef float Vec __attribute__((vector_size(W * sizeof(float))));

  static inline Vec load(const float* p) {
    Vec v;
    __builtin_memcpy(&v, p, sizeof(Vec));
    return v;
  }
  static inline Vec splat(float f) { return Vec{} + f; }
  static inline float sum(Vec v) {
    float lanes[W];
    __builtin_memcpy(lanes, &v, sizeof(Vec));
    float total = 0.0f;
    for (float lane : lanes) total += lane;
    return total;
  }

  // x[lo, hi) read as `streams` interleaved sequential streams, two vectors at a time, each
  // 64-byte line `ahead` floats on prefetched first (none when 0)
  static inline double read(const float* x, int64_t lo, int64_t hi, int64_t streams,
                            int64_t ahead) {
    const int64_t len = (hi - lo) / streams / (2 * W) * (2 * W);
    Vec a = splat(0.0f), b = splat(0.0f);
    for (int64_t i = 0; i < len; i += 2 * W)
      for (int64_t s = 0; s < streams; ++s) {
        const float* p = x + lo + s * len + i;
        if (ahead) {  // (past the end of the share: a prefetch never faults)
          for (int64_t line = 0; line < 2 * W; line += 16) __builtin_prefetch(p + ahead + line);
        }
        a += load(p);
        b += load(p + W);
      }
    double total = sum(a + b);
    for (int64_t i = lo + streams * len; i < hi; ++i) total += x[i];
    return total;
  }

  // FLOPs of `iterations` rounds of 12 independent multiply-add chains (enough in flight to
  // fill the FMA units); the result's sum keeps the loop alive (it is ~0: adds nothing)
  static inline double fmas(int64_t iterations) {
    Vec acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = splat(0.001f * static_cast<float>(i));
    const Vec m = splat(0.999f), c = splat(1e-4f);
    for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = acc[i] * m + c;
    Vec total = acc[0];
    for (int i = 1; i < 12; ++i) total += acc[i];
    return 2.0 * W * 12 * static_cast<double>(iterations) + 0.0 * sum(total);
  }
};

GF_AVX512 __attribute__((flatten)) double read_avx512(const float* x, int64_t lo, int64_t hi,
                                                      int64_t streams, int64_t ahead) {
  return Probe<16>::read(x, lo, hi, streams, ahead);
}
GF_AVX2 __attribute__((flatten)) double read_avx2(const float* x, int64_t lo, int64_t hi,
                                                  int64_t streams, int64_t ahead) {
  return Probe<8>::read(x, lo, hi, streams, ahead);
}
GF_AVX512 __attribute__((flatten)) double fmas_avx512(int64_t iterations) {
  return Probe<16>::fmas(iterations);
}
GF_AVX2 __attribute__((flatten)) double fmas_avx2(int64_t iterations) {
  return Probe<8>::fmas(iterations);
}
#endif

double stream_read(const torch::Tensor& data, int64_t streams, int64_t threads, int64_t ahead) {
  TORCH_CHECK(data.scalar_type() == torch::kFloat32 && data.device().is_cpu() &&
                  data.is_contiguous() && streams >= 1 && threads >= 1 && ahead >= 0,
              "stream_read: a contiguous float32 CPU tensor, streams >= 1, threads >= 1 and "
              "ahead >= 0");
  const std::string with = isa();
  TORCH_CHECK(with != "none", "stream_read: this CPU runs neither the avx512 nor the avx2 kernels");
#if GF_PROBES
  pybind11::gil_scoped_release released;
  const float* x = data.data_ptr<float>();
  const int64_t n = data.numel();
  const bool wide = with == "avx512";
  const int64_t floats_ahead = ahead / static_cast<int64_t>(sizeof(float));
  double total = 0.0;
#pragma omp parallel num_threads(static_cast<int>(threads)) reduction(+ : total)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = n * tid / nth, hi = n * (tid + 1) / nth;
    total += wide ? read_avx512(x, lo, hi, streams, floats_ahead)
                  : read_avx2(x, lo, hi, streams, floats_ahead);
  }
  return total;
#else
  return 0.0;
#endif
}

double fma_rate(int64_t iterations, int64_t threads) {
  TORCH_CHECK(iterations >= 1 && threads >= 1, "fma_rate: iterations >= 1 and threads >= 1");
  const std::string with = isa();
  TORCH_CHECK(with != "none", "fma_rate: this CPU runs neither the avx512 nor the avx2 kernels");
#if GF_PROBES
  pybind11::gil_scoped_release released;
  const bool wide = with == "avx512";
  double flops = 0.0;
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(static_cast<int>(threads)) reduction(+ : flops)
  flops += wide ? fmas_avx512(iterations) : fmas_avx2(iterations);
  return flops / (omp_get_wtime() - start);
#else
  return 0.0;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "genlm_fast benchmark probes: the machine's memory and arithmetic floors";
  m.def("isa", &isa, "The instructions the probes use here: avx512, avx2 or none");
  m.def("stream_read", &stream_read,
        "Sum of a float32 tensor read as `streams` sequential streams per thread, each line "
        "`ahead` bytes on prefetched (0: none)",
        pybind11::arg("data"), pybind11::arg("streams"), pybind11::arg("threads"),
        pybind11::arg("ahead") = 0);
  m.def("fma_rate", &fma_rate, "FLOP/s of register-only float32 multiply-adds",
        pybind11::arg("iterations"), pybind11::arg("threads"));
}
