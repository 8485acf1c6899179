// How many threads a parallel region of the CPU kernels gets (cpu_threads.cpp).
//
// Every `#pragma omp parallel` in csrc/ takes its team size from team_size(), so that one
// place decides how the kernels share the machine. A fork-join region with a static split
// finishes when its slowest thread does: when one team thread is waiting for a CPU (another
// process holds it), the whole region waits a scheduler time slice (milliseconds) for it,
// and a kernel that runs hundreds of regions loses that much in each. So a region gets no
// more threads than
//   * the CPUs this process may run on: its affinity mask, capped by the cgroup's CPU quota
//     (v1 or v2), read once;
//   * the CPUs among those that other processes have left free, measured over the last
//     kSampleIntervalNs (below);
//   * torch's thread setting (the user's cap, torch.set_num_threads);
//   * the work: one thread per kMinBytesPerThread of memory traffic, so that a region too
//     small to repay waking a thread runs on the caller alone.
//
// Contention: the busy time of the usable CPUs (/proc/stat) minus this process's own CPU
// time (CLOCK_PROCESS_CPUTIME_ID), over the wall time since the last reading, is the number
// of CPUs other work kept busy. It is read at most once per sample interval
// (kSampleIntervalNs in cpu_threads.cpp), by whichever call finds the last reading stale (a
// read of /proc/stat); every other call costs a clock read and a few atomic loads. Busy
// other work takes CPUs away from the team for as long as it runs: a competing busy loop on
// a 2-CPU machine leaves one thread. The reading is an average over its window (/proc/stat
// counts in clock ticks: a shorter window would be noise), so the team follows a change
// within one or two intervals; after a pause of this process, the first reading spans the
// pause, and what other work did then decides the next interval.
#pragma once

#include <cstdint>

namespace genlm_fast {
namespace cpu {

// bytes of memory traffic below which one more thread is not worth its wake-up
constexpr int64_t kMinBytesPerThread = int64_t{256} << 10;

// Threads for a parallel region that reads and writes about `bytes` of memory (>= 1).
int team_size(int64_t bytes);

// The usable CPUs that other work leaves free (>= 1): team_size's bound before torch's
// setting and the work's size.
int free_cpus();

// The CPUs this process may run on (affinity capped by the cgroup quota, >= 1), fixed for the
// process: what a kernel splits its work by when the split changes its rounding, so that
// results do not depend on how many threads run it.
int usable_cpus();

// What team_size decides from, for reports and tests.
struct ThreadsInfo {
  int affinity_cpus;    // CPUs in this process's affinity mask
  double quota_cpus;    // the cgroup's CPU quota in CPUs, 0 if none
  int usable_cpus;      // affinity capped by the quota (at least 1)
  double others_busy;   // CPUs other work kept busy over the last reading's window
  int free_cpus;        // usable CPUs left by the others (at least 1)
  int torch_threads;    // torch's intra-op thread setting
  bool contention_known;  // false where /proc/stat cannot be read (no contention measure)
};
ThreadsInfo threads_info();

}  // namespace cpu
}  // namespace genlm_fast
