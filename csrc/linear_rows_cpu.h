// A linear layer on the weight as the model stores it: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// computed in float32 from a float32, bfloat16 or float16 W read in place (no packed copy).
// Algorithm at the top of linear_rows_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

namespace genlm_fast {
namespace cpu {

// x [M, K] float32; weight [N, K] float32, bfloat16 or float16 whose rows are contiguous (any
// row stride); bias [N] of any of those dtypes or none. Returns [M, N] float32. isa: auto, avx512,
// avx2 or baseline.
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, const std::string& isa);

// the widest linear_rows kernel this CPU runs: "avx512" (AVX-512F), "avx2" (AVX2 with FMA and
// F16C) or "baseline"
std::string linear_rows_best_isa();

}  // namespace cpu
}  // namespace genlm_fast
