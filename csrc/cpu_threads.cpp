// Team sizes of the CPU kernels' parallel regions: see cpu_threads.h.

#include "cpu_threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#endif

namespace genlm_fast {
namespace cpu {

namespace {

// how often the contention measure is read, and the shortest window it is taken over
constexpr int64_t kSampleIntervalNs = 100'000'000;
// a CPU counts as free when other work keeps less than 1 - kFreeSlack of it busy: /proc/stat
// counts in clock ticks, so a reading over one sample interval is off by a tick or two per
// CPU, a fraction of a CPU that the slack must cover
constexpr double kFreeSlack = 0.35;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if defined(__linux__)
// the whole of a small file (at most `limit` bytes), or "" if it cannot be read
std::string read_file(const std::string& path, size_t limit = 1 << 16) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[4096];
  while (out.size() < limit) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

std::vector<int> affinity_ids() {
  for (int n = 1024; n <= (1 << 18); n *= 4) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set);
    if (sched_getaffinity(0, size, set) == 0) {
      std::vector<int> ids;
      for (int c = 0; c < n; ++c)
        if (CPU_ISSET_S(c, size, set)) ids.push_back(c);
      CPU_FREE(set);
      return ids;
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;  // EINVAL: the mask is wider than n
  }
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  std::vector<int> ids;
  for (int c = 0; c < std::max(1L, n); ++c) ids.push_back(c);
  return ids;
}

// quota / period of one cgroup directory, or 0 if it sets none
double quota_in(const std::string& dir, bool v2) {
  if (v2) {
    const std::string text = read_file(dir + "/cpu.max");
    if (text.empty() || text.compare(0, 3, "max") == 0) return 0.0;
    double quota = 0, period = 0;
    if (std::sscanf(text.c_str(), "%lf %lf", &quota, &period) == 2 && quota > 0 && period > 0)
      return quota / period;
    return 0.0;
  }
  const double quota = std::atof(read_file(dir + "/cpu.cfs_quota_us").c_str());
  const double period = std::atof(read_file(dir + "/cpu.cfs_period_us").c_str());
  return quota > 0 && period > 0 ? quota / period : 0.0;
}

// The smallest CPU quota (in CPUs) on this process's cgroup path and its ancestors, v2 or v1,
// or 0 if none sets one. A container may show its own cgroup at the mount's root while
// /proc/self/cgroup names the host's path: walking up to the root finds it either way.
double cgroup_quota() {
  const std::string text = read_file("/proc/self/cgroup");
  double best = 0.0;
  auto consider = [&](const std::string& root, std::string path, bool v2) {
    while (true) {
      const double q = quota_in(root + path, v2);
      if (q > 0 && (best == 0.0 || q < best)) best = q;
      if (path.empty() || path == "/") break;
      const size_t slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  };
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      consider("/sys/fs/cgroup", path, true);
      continue;
    }
    bool has_cpu = false;  // "cpu" among the comma-separated controllers
    for (size_t p = 0; p <= controllers.size();) {
      size_t q = controllers.find(',', p);
      if (q == std::string::npos) q = controllers.size();
      has_cpu = has_cpu || controllers.compare(p, q - p, "cpu") == 0;
      p = q + 1;
    }
    if (!has_cpu) continue;
    for (const char* mount : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct",
                              "/sys/fs/cgroup/cpuacct,cpu"})
      consider(mount, path, false);
  }
  return best;
}

// Busy ticks (everything but idle and iowait; steal included: the hypervisor gave the CPU
// to someone else) summed over the CPUs c with wanted[c], from /proc/stat; -1 if it cannot be read.
int64_t busy_ticks(const std::vector<char>& wanted) {
  // the per-CPU lines come first: read only as far as they go (the rest can be long). The
  // file stays open: reading it again from offset 0 regenerates it, without the cost of an
  // open and a close each time (about half of a reading's cost)
  static const int fd = ::open("/proc/stat", O_RDONLY | O_CLOEXEC);
  static std::string text;  // (callers hold the sampler's mutex)
  if (fd < 0) return -1;
  text.resize(512 + 256 * (wanted.size() + 1));
  ssize_t n;
  do {
    n = ::pread(fd, &text[0], text.size(), 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return -1;
  text.resize(static_cast<size_t>(n));
  int64_t busy = 0;
  size_t start = text.find('\n');  // skip the "cpu " total line
  bool any = false;
  while (start != std::string::npos && text.compare(start + 1, 3, "cpu") == 0) {
    const char* p = text.c_str() + start + 4;
    char* end = nullptr;
    const long id = std::strtol(p, &end, 10);
    if (end != p && id >= 0 && static_cast<size_t>(id) < wanted.size() && wanted[id]) {
      unsigned long long f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const int got = std::sscanf(end, "%llu %llu %llu %llu %llu %llu %llu %llu", &f[0], &f[1],
                                  &f[2], &f[3], &f[4], &f[5], &f[6], &f[7]);
      if (got >= 4) {
        // user nice system idle iowait irq softirq steal (guest time is within user)
        busy += static_cast<int64_t>(f[0] + f[1] + f[2] + f[5] + f[6] + f[7]);
        any = true;
      }
    }
    start = text.find('\n', start + 1);
  }
  return any ? busy : -1;
}

int64_t process_cpu_ns() {
  timespec ts{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return -1;
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
#endif

struct Cpus {
  std::vector<int> ids;
  std::vector<char> wanted;  // wanted[c]: CPU c is in the affinity mask
  double quota = 0.0;
  int usable = 1;
};

const Cpus& cpus() {
  static const Cpus c = [] {
    Cpus c;
#if defined(__linux__)
    c.ids = affinity_ids();
    c.quota = cgroup_quota();
#else
    c.ids = {0};
#endif
    const int affinity = std::max<int>(1, static_cast<int>(c.ids.size()));
    int usable = affinity;
    // a quota of 1.5 CPUs gives 1 thread: a team over its quota is throttled as a whole
    if (c.quota > 0) usable = std::min(usable, std::max(1, static_cast<int>(c.quota)));
    c.usable = usable;
    const int top = c.ids.empty() ? 0 : *std::max_element(c.ids.begin(), c.ids.end());
    c.wanted.assign(top + 1, 0);
    for (int id : c.ids) c.wanted[id] = 1;
    return c;
  }();
  return c;
}

// The contention measure (cpu_threads.h): one reading per kSampleIntervalNs at most.
class Sampler {
 public:
  Sampler() {
    const Cpus& c = cpus();
    free_.store(c.usable, std::memory_order_relaxed);
    std::lock_guard<std::mutex> hold(mutex_);
    read(now_ns());
  }

  int free_cpus() {
    const int64_t now = now_ns();
    if (now >= next_ns_.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> hold(mutex_, std::try_to_lock);
      if (hold.owns_lock() && now >= next_ns_.load(std::memory_order_relaxed)) read(now);
    }
    return free_.load(std::memory_order_relaxed);
  }

  double others() const { return others_milli_.load(std::memory_order_relaxed) / 1000.0; }
  bool known() const { return known_.load(std::memory_order_relaxed); }

 private:
  void read(int64_t now) {
    next_ns_.store(now + kSampleIntervalNs, std::memory_order_relaxed);
#if defined(__linux__)
    const Cpus& c = cpus();
    const int64_t busy = busy_ticks(c.wanted), self = process_cpu_ns();
    if (busy < 0 || self < 0) return;  // no measure: the team stays at the usable CPUs
    if (wall_ns_ > 0 && now - wall_ns_ >= kSampleIntervalNs / 2) {
      static const double tick_ns = 1e9 / static_cast<double>(std::max(1L, sysconf(_SC_CLK_TCK)));
      const double window = static_cast<double>(now - wall_ns_);
      double others = (static_cast<double>(busy - busy_) * tick_ns -
                       static_cast<double>(self - self_ns_)) / window;
      const double affinity = static_cast<double>(c.ids.size());
      others = std::min(affinity, std::max(0.0, others));
      others_milli_.store(static_cast<int64_t>(std::lround(others * 1000.0)),
                          std::memory_order_relaxed);
      const int left = static_cast<int>(std::floor(affinity - others + kFreeSlack));
      free_.store(std::max(1, std::min(c.usable, left)), std::memory_order_relaxed);
      known_.store(true, std::memory_order_relaxed);
    }
    wall_ns_ = now;
    busy_ = busy;
    self_ns_ = self;
#else
    (void)now;
#endif
  }

  std::mutex mutex_;
  std::atomic<int64_t> next_ns_{0};
  std::atomic<int> free_{1};
  std::atomic<int64_t> others_milli_{0};
  std::atomic<bool> known_{false};
  // the last reading (under mutex_)
  int64_t wall_ns_ = 0, busy_ = 0, self_ns_ = 0;
};

Sampler& sampler() {
  static Sampler s;
  return s;
}

}  // namespace

int team_size(int64_t bytes) {
  const int64_t by_work = std::max<int64_t>(1, bytes / kMinBytesPerThread);
  const int64_t cap = std::min(at::get_num_threads(), sampler().free_cpus());
  return static_cast<int>(std::max<int64_t>(1, std::min(cap, by_work)));
}

int free_cpus() { return sampler().free_cpus(); }

int usable_cpus() { return cpus().usable; }

ThreadsInfo threads_info() {
  const Cpus& c = cpus();
  Sampler& s = sampler();
  ThreadsInfo info;
  info.affinity_cpus = static_cast<int>(c.ids.size());
  info.quota_cpus = c.quota;
  info.usable_cpus = c.usable;
  info.free_cpus = s.free_cpus();
  info.others_busy = s.others();
  info.torch_threads = at::get_num_threads();
  info.contention_known = s.known();
  return info;
}

}  // namespace cpu
}  // namespace genlm_fast
