// Small-batch float32 linear layer on the CPU (the decoding steps of AsyncTransformer):
// algorithm and layout at the top of linear_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

namespace genlm_fast {
namespace cpu {

// W [N, K] float32 -> panels [ceil(N / 16), K, 16] (rows past N zero)
torch::Tensor pack_linear_weight(const torch::Tensor& weight);

// x [M, K] @ W^T (+ bias) -> [M, N], W given as its panels; isa: auto, avx512, baseline
torch::Tensor linear_small_batch(const torch::Tensor& x, const torch::Tensor& panels,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features,
                                 const std::string& isa);

// the widest kernel this CPU runs: "avx512" or "baseline"
std::string linear_best_isa();

}  // namespace cpu
}  // namespace genlm_fast
