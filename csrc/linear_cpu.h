// Small-batch float32 linear layer on the CPU (the decoding steps of AsyncTransformer):
// algorithm and layout at the top of linear_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

namespace genlm_fast {
namespace cpu {

constexpr int64_t kPanel = 16;  // output features per panel of a packed weight

// W [N, K] float32 -> panels [ceil(N / 16), K, 16] (rows past N zero)
torch::Tensor pack_linear_weight(const torch::Tensor& weight);

// x [M, K] @ W^T (+ bias) -> [M, N], W given as its panels; isa: auto, avx512, baseline
torch::Tensor linear_small_batch(const torch::Tensor& x, const torch::Tensor& panels,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features,
                                 const std::string& isa);

// acc[m, 16] = x[m, :k] @ panel[k, 16] (x's rows ldx apart): one panel of a packed weight, on the
// calling thread (the building block of linear_small_batch and of the fused decoder); avx512
// picks the AVX-512 kernel (the caller checked that the CPU runs it), else the plain loop
void panel_dot(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panel, float* acc,
               bool avx512);

// panel_dot of two panels at once (pa into acc, pb into acc2): the same sums, faster; next_a and
// next_b (or null: what follows pa and pb) are the panels to fetch from memory meanwhile
void panel_dot2(const float* x, int64_t ldx, int64_t m, int64_t k, const float* pa, const float* pb,
                float* acc, float* acc2, bool avx512, const float* next_a = nullptr,
                const float* next_b = nullptr);

// the widest kernel this CPU runs: "avx512" or "baseline"
std::string linear_best_isa();

}  // namespace cpu
}  // namespace genlm_fast
