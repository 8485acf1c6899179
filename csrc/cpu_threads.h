// How many threads a parallel region of the CPU kernels gets.
//
// Every `#pragma omp parallel` in csrc/ takes its team size from team_size(), so that one
// place decides how the kernels share the machine: a region too small to repay waking a
// second thread runs on one, and no region asks for more threads than torch is set to use.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace genlm_fast {
namespace cpu {

// bytes of memory traffic below which one more thread is not worth its wake-up
constexpr int64_t kMinBytesPerThread = int64_t{256} << 10;

// Threads for a parallel region that reads and writes about `bytes` of memory.
inline int team_size(int64_t bytes) {
  const int64_t by_work = std::max<int64_t>(1, bytes / kMinBytesPerThread);
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), by_work));
}

}  // namespace cpu
}  // namespace genlm_fast
