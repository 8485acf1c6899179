// The machine's floors for bench/lm_floor.py, which compares a CPU forward with them; built on
// first use by bench/probes.py (torch.utils.cpp_extension.load), never part of genlm_fast._C.
//
//   stream_read(data, streams, threads) -> the sum of `data`, each of `threads` threads reading
//       its share as `streams` interleaved sequential streams (the time to read the weights once)
//   fma_rate(iterations, threads) -> FLOP/s of register-only AVX-512 multiply-adds on `threads`
//       threads, `iterations` each
//
// Both need AVX-512F, as the fused decoder does; the caller passes the decoder's team size.

#include <torch/extension.h>

#include <omp.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GF_PROBES 1
#define GF_AVX512 __attribute__((target("avx512f")))
#else
#define GF_PROBES 0
#define GF_AVX512
#endif

namespace {

bool avx512_supported() {
#if GF_PROBES
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

#if GF_PROBES
GF_AVX512 double stream_read_avx512(const float* x, int64_t n, int64_t streams, int threads) {
  double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = n * tid / nth, hi = n * (tid + 1) / nth;
    const int64_t len = (hi - lo) / streams / 32 * 32;  // each stream: whole pairs of vectors
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 32)
      for (int64_t s = 0; s < streams; ++s) {
        const float* p = x + lo + s * len + i;
        a = _mm512_add_ps(a, _mm512_loadu_ps(p));
        b = _mm512_add_ps(b, _mm512_loadu_ps(p + 16));
      }
    for (int64_t i = lo + streams * len; i < hi; ++i) total += x[i];
    total += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  return total;
}

GF_AVX512 double fma_rate_avx512(int64_t iterations, int threads) {
  double flops = 0.0;
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
  {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, c);
    __m512 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
    // (the sum keeps the loop alive; it is ~0, and a finite value adds nothing)
    flops += 2.0 * 16 * 12 * static_cast<double>(iterations) + 0.0 * _mm512_reduce_add_ps(sum);
  }
  return flops / (omp_get_wtime() - start);
}
#endif

double stream_read(const torch::Tensor& data, int64_t streams, int64_t threads) {
  TORCH_CHECK(data.scalar_type() == torch::kFloat32 && data.device().is_cpu() &&
                  data.is_contiguous() && streams >= 1 && threads >= 1,
              "stream_read: a contiguous float32 CPU tensor, streams >= 1 and threads >= 1");
  TORCH_CHECK(avx512_supported(), "stream_read: this CPU lacks AVX-512F");
#if GF_PROBES
  pybind11::gil_scoped_release released;
  return stream_read_avx512(data.data_ptr<float>(), data.numel(), streams,
                            static_cast<int>(threads));
#else
  return 0.0;
#endif
}

double fma_rate(int64_t iterations, int64_t threads) {
  TORCH_CHECK(iterations >= 1 && threads >= 1, "fma_rate: iterations >= 1 and threads >= 1");
  TORCH_CHECK(avx512_supported(), "fma_rate: this CPU lacks AVX-512F");
#if GF_PROBES
  pybind11::gil_scoped_release released;
  return fma_rate_avx512(iterations, static_cast<int>(threads));
#else
  return 0.0;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "genlm_fast benchmark probes: the machine's memory and arithmetic floors";
  m.def("avx512_supported", &avx512_supported, "Whether this CPU runs the probes (AVX-512F)");
  m.def("stream_read", &stream_read,
        "Sum of a float32 tensor read as `streams` sequential streams per thread",
        pybind11::arg("data"), pybind11::arg("streams"), pybind11::arg("threads"));
  m.def("fma_rate", &fma_rate, "FLOP/s of register-only AVX-512 multiply-adds",
        pybind11::arg("iterations"), pybind11::arg("threads"));
}
