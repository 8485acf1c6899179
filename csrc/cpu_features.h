// What the running CPU can execute: the one check the CPU kernels make before they run code
// compiled for an instruction set beyond baseline x86-64 (the build passes no -march, so one
// binary serves every x86-64 CPU and picks its kernels when it runs).
#pragma once

#include <string>

namespace genlm_fast {
namespace cpu {

// Whether this CPU runs the kernels named `isa`: "baseline" (any CPU), "avx2" (AVX2 with FMA
// and F16C: linear_rows) or "avx512" (AVX-512F: the fused decoder, linear_small_batch,
// linear_rows).
// Any other name: false.
inline bool cpu_has(const std::string& isa) {
  if (isa == "baseline") return true;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (isa == "avx512") return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

}  // namespace cpu
}  // namespace genlm_fast
