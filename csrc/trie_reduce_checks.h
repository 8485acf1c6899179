// Argument checks shared by the torch entry points of the CPU and CUDA trie reductions
// (trie_reduce_cpu_op.cpp, trie_reduce_cuda_op.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

namespace genlm_fast {

inline int parse_reduction(const std::string& r) {
  if (r == "sum") return 0;
  if (r == "max") return 1;
  if (r == "log_mass") return 2;
  TORCH_CHECK(false, "trie_reduce: unknown reduction '", r,
              "'; expected 'sum', 'max' or 'log_mass'");
  return -1;
}

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    default: return -1;
  }
}

inline void check_values(const at::Tensor& values, int reduction, const char* device_name) {
  TORCH_CHECK(values.dim() == 2, "trie_reduce: values must be a 2-D [batch, columns] tensor, got ",
              values.dim(), " dimensions");
  TORCH_CHECK(values.is_contiguous(), "trie_reduce: values must be contiguous (call .contiguous())");
  const int code = dtype_code(values.scalar_type());
  if (reduction == 2) {
    TORCH_CHECK(code >= 0, "trie_reduce: log_mass needs float16, bfloat16, float32 or float64 "
                "logits, got ", values.scalar_type());
  } else {
    TORCH_CHECK(code == 0 || code == 1, "trie_reduce: sum/max need float32 or float64 values, got ",
                values.scalar_type(), " (convert half precision with .float())");
  }
  (void)device_name;
}

inline void check_index(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "trie_reduce: index array '", name,
              "' must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, "trie_reduce: index array '", name, "' must be 1-D, got ", t.dim(),
              " dimensions");
  TORCH_CHECK(t.is_contiguous(), "trie_reduce: index array '", name, "' must be contiguous");
  TORCH_CHECK(t.device() == device, "trie_reduce: index array '", name, "' is on ", t.device(),
              " but values are on ", device);
}

}  // namespace genlm_fast
