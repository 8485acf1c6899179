// Small-batch float32 linear layer on the CPU (the decoding steps of AsyncTransformer):
// algorithm and layout at the top of linear_cpu.cpp.
#pragma once

#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace genlm_fast {
namespace cpu {

constexpr int64_t kPanel = 16;  // output features per panel of a packed weight

// A 16-bit weight as stored (a model loaded in bfloat16 or float16). Both widen to float32
// exactly (bfloat16 is the high half of a float32), and the products below sum in float32 as
// for float32 weights.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

inline float widen(float w) { return w; }
inline float widen(BFloat16 w) {
  const uint32_t bits = static_cast<uint32_t>(w.bits) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float widen(Float16 w) {
  return static_cast<float>(c10::Half(w.bits, c10::Half::from_bits()));
}

// weight j (0 .. 15) of k-step k of a panel: bfloat16 panels hold their k-steps in pairs, each
// pair one 32-bit unit ([K / 2][16][2]), the others one value per k-step ([K][16])
template <class W>
inline float panel_weight(const W* panel, int64_t k, int64_t j) {
  return widen(panel[k * kPanel + j]);
}
inline float panel_weight(const BFloat16* panel, int64_t k, int64_t j) {
  return widen(panel[(k & ~int64_t{1}) * kPanel + 2 * j + (k & 1)]);
}

// W [N, K] float32, bfloat16 or float16 -> panels [ceil(N / 16), K, 16] of its dtype (rows past
// N zero; bfloat16 pairs its k-steps: linear_cpu.cpp), written into `out` when given (a tensor
// of that shape and dtype whose panels may lie any distance apart, each [K, 16] contiguous:
// a slice of a larger allocation, or every other panel of one) and returned
torch::Tensor pack_linear_weight(const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& out);

// x [M, K] float32 @ W^T (+ bias) -> [M, N] float32, W given as its panels (pack_linear_weight's
// layout and dtype, the panels any distance apart, as `out` there); isa: auto, avx512, baseline
torch::Tensor linear_small_batch(const torch::Tensor& x, const torch::Tensor& panels,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features,
                                 const std::string& isa);

// acc[m, 16] = x[m, :k] @ panel[k, 16] (x's rows ldx apart): one panel of a packed weight, on the
// calling thread (the building block of linear_small_batch and of the fused decoder); avx512
// picks the AVX-512 kernel (the caller checked that the CPU runs it), else the plain loop.
// W: float, BFloat16 or Float16 (instantiated for each)
template <class W>
void panel_dot(const float* x, int64_t ldx, int64_t m, int64_t k, const W* panel, float* acc,
               bool avx512);

// panel_dot of two panels at once (pa into acc, pb into acc2): the same sums, faster; next_a and
// next_b (or null: what follows pa and pb) are the panels to fetch from memory meanwhile
template <class W>
void panel_dot2(const float* x, int64_t ldx, int64_t m, int64_t k, const W* pa, const W* pb,
                float* acc, float* acc2, bool avx512, const W* next_a = nullptr,
                const W* next_b = nullptr);

// One product x [m, k] (rows ldx apart) @ a packed weight, its panels (panel_stride values
// apart) shared out among the threads of the enclosing OpenMP region: each thread takes runs of
// consecutive units of two panels (panel_dot2, the next pair fetched meanwhile; a last odd
// panel alone), the next run when done, so a thread slowed by other work holds no one up.
// `epilogue(p, acc)` gets panel p's [m, 16] sums; with `pairs` the panels alternate two
// weights (the fused decoder's gate and up), and epilogue(q, acc) gets pair q's [2, m, 16].
// acc: this thread's [2, m, 16] scratch. No barrier at the end (the caller places its own).
template <class W, class Epilogue>
void product_panels(const float* x, int64_t ldx, int64_t m, int64_t k, const W* panels,
                    int64_t panel_stride, int64_t count, bool pairs, bool avx512, float* acc,
                    Epilogue epilogue) {
  const int64_t units = pairs ? count : (count + 1) / 2;
  const int64_t run = std::max<int64_t>(1, units / (16 * omp_get_num_threads()));
  float* acc2 = acc + m * kPanel;
#pragma omp for schedule(dynamic, run) nowait
  for (int64_t q = 0; q < units; ++q) {
    const W* pa = panels + 2 * q * panel_stride;
    if (pairs || 2 * q + 1 < count) {
      // (the next pair's addresses only prefetch: past the last panel they are never read)
      panel_dot2(x, ldx, m, k, pa, pa + panel_stride, acc, acc2, avx512, pa + 2 * panel_stride,
                 pa + 3 * panel_stride);
      if (pairs) {
        epilogue(q, acc);
      } else {
        epilogue(2 * q, acc);
        epilogue(2 * q + 1, acc2);
      }
    } else {
      panel_dot(x, ldx, m, k, pa, acc, avx512);
      epilogue(2 * q, acc);
    }
  }
}

// the widest kernel this CPU runs: "avx512" or "baseline"
std::string linear_best_isa();

}  // namespace cpu
}  // namespace genlm_fast
