// genlm_fast._C.trie_reduce_cpu: checks the tensors and index arrays, allocates the result
// (large ones from OutputPool) and runs the CPU kernel (trie_reduce_cpu.cpp) without the GIL.

#include "trie_reduce_ops.h"

#include "trie_reduce_checks.h"
#include "trie_reduce_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace genlm_fast {
namespace {

// Output memory for large CPU results. A [B, N] result is big (52 MB for 32 rows of
// Llama-3), and glibc serves anything over 32 MB with a fresh mmap on every call: faulting
// and zeroing those pages took longer than the reduction itself. So blocks of at least
// kPoolMinBytes come from a small free list instead: 2 MiB-aligned, advised to use
// transparent huge pages when first touched, and handed back to the list by the tensor's
// deleter (so a block is reused only after every view of the previous result is gone). At
// most kPoolMaxBlocks blocks / kPoolMaxBytes stay cached, the most recently returned ones.
class OutputPool {
 public:
  static constexpr size_t kAlign = size_t(1) << 21;
  static constexpr size_t kPoolMinBytes = size_t(16) << 20;
  static constexpr size_t kPoolMaxBlocks = 4;
  static constexpr size_t kPoolMaxBytes = size_t(1) << 30;

  static at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                          c10::elementSize(dtype);
    const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (nbytes < kPoolMinBytes) return at::empty(sizes, options);
    const size_t size = (nbytes + kAlign - 1) / kAlign * kAlign;
    void* block = instance().take(size);
    TORCH_CHECK(block != nullptr, "trie_reduce_cpu: out of memory allocating ", size,
                " bytes for the result");
    return at::from_blob(block, sizes, [size](void* p) { instance().give(p, size); }, options);
  }

  static void clear() { instance().drain(); }

  static std::vector<int64_t> cached_sizes() { return instance().sizes(); }

 private:
  static OutputPool& instance() {
    static OutputPool* pool = new OutputPool();  // never destroyed: tensors may outlive exit
    return *pool;
  }

  void* take(size_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = free_.size(); i-- > 0;) {  // the most recent block of that size
        if (free_[i].second == size) {
          void* p = free_[i].first;
          cached_ -= size;
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return p;
        }
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, size) != 0) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, size, MADV_HUGEPAGE);  // a hint; harmless where THP is off
#endif
    return p;
  }

  // The returned block becomes the most recent; the oldest ones make room for it. (Keeping
  // the old ones instead left a pool full of sizes no longer asked for, e.g. another trie's
  // or batch size's, and every later result paid for fresh pages.)
  void give(void* p, size_t size) {
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (size > kPoolMaxBytes) {
        evicted.push_back(p);
      } else {
        while (!free_.empty() &&
               (free_.size() >= kPoolMaxBlocks || cached_ + size > kPoolMaxBytes)) {
          evicted.push_back(free_.front().first);
          cached_ -= free_.front().second;
          free_.erase(free_.begin());
        }
        free_.emplace_back(p, size);
        cached_ += size;
      }
    }
    for (void* q : evicted) std::free(q);
  }

  std::vector<int64_t> sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> out;
    for (const auto& b : free_) out.push_back(static_cast<int64_t>(b.second));
    return out;
  }

  void drain() {
    std::vector<std::pair<void*, size_t>> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (auto& b : blocks) std::free(b.first);
  }

  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> free_;  // (block, bytes)
  size_t cached_ = 0;
};

}  // namespace

std::tuple<at::Tensor, int64_t> trie_reduce_cpu(
    const at::Tensor& values, const at::Tensor& parent, const at::Tensor& node_of_leaf,
    const at::Tensor& leaf_token, const at::Tensor& empty_nodes, const at::Tensor& run_end,
    const at::Tensor& run_depth, const at::Tensor& run_child_slot,
    const at::Tensor& run_join_slot, const at::Tensor& run_leaf, const at::Tensor& run_of,
    int64_t max_depth, const std::string& reduction, bool check_indices, int64_t num_threads,
    bool float64_result) {
  const int red = parse_reduction(reduction);
  TORCH_CHECK(!(float64_result && red == 2), "trie_reduce_cpu: float64_result is for sum and "
              "max; log_mass results are float32");
  TORCH_CHECK(values.device().is_cpu(), "trie_reduce_cpu: values must be a CPU tensor, got one on ",
              values.device());
  check_values(values, red, "cpu");
  const at::Device dev = values.device();
  check_index(parent, "parent", dev);
  check_index(node_of_leaf, "node_of_leaf", dev);
  check_index(leaf_token, "leaf_token", dev);
  check_index(empty_nodes, "empty_nodes", dev);
  check_index(run_end, "run_end", dev);
  check_index(run_depth, "run_depth", dev);
  check_index(run_child_slot, "run_child_slot", dev);
  check_index(run_join_slot, "run_join_slot", dev);
  check_index(run_leaf, "run_leaf", dev);
  check_index(run_of, "run_of", dev);
  const int64_t B = values.size(0), C = values.size(1);
  const int64_t N = parent.numel(), L = leaf_token.numel(), E = empty_nodes.numel();
  const int64_t R = run_end.numel();
  TORCH_CHECK(N >= 1, "trie_reduce_cpu: the trie has no nodes (parent is empty)");
  TORCH_CHECK(N < (int64_t(1) << 31) - 1 && L < (int64_t(1) << 31) - 1,
              "trie_reduce_cpu: too many nodes/leaves for int32 indices");
  TORCH_CHECK(node_of_leaf.numel() == L, "trie_reduce_cpu: node_of_leaf has ",
              node_of_leaf.numel(), " entries but leaf_token has ", L);
  TORCH_CHECK(R >= 1 && run_depth.numel() == R && run_child_slot.numel() == R &&
                  run_join_slot.numel() == R && run_leaf.numel() == R + 1 && run_of.numel() == N,
              "trie_reduce_cpu: the run arrays need R >= 1 entries (run_end, run_depth, "
              "run_child_slot, run_join_slot), R + 1 (run_leaf) and N (run_of); got ", R, ", ",
              run_depth.numel(), ", ", run_child_slot.numel(), ", ", run_join_slot.numel(), ", ",
              run_leaf.numel(), ", ", run_of.numel(), " with N = ", N);
  TORCH_CHECK(max_depth >= 0 && max_depth < N, "trie_reduce_cpu: max_depth = ", max_depth,
              " is not in [0, N)");
  const int32_t* par = parent.data_ptr<int32_t>();
  const int32_t* ln = node_of_leaf.data_ptr<int32_t>();
  const int32_t* lt = leaf_token.data_ptr<int32_t>();
  const int32_t* en = empty_nodes.data_ptr<int32_t>();
  const int32_t* rend = run_end.data_ptr<int32_t>();
  const int32_t* rdep = run_depth.data_ptr<int32_t>();
  const int32_t* rcs = run_child_slot.data_ptr<int32_t>();
  const int32_t* rjs = run_join_slot.data_ptr<int32_t>();
  const int32_t* rleaf = run_leaf.data_ptr<int32_t>();
  const int32_t* rof = run_of.data_ptr<int32_t>();
  if (check_indices) {
    std::vector<int32_t> depth(N), children(N, 0), first_child(N, -1);
    for (int64_t n = 0; n < N; ++n) {
      const int32_t p = par[n];
      TORCH_CHECK(p == -1 || (p > n && p < N), "trie_reduce_cpu: parent[", n, "] = ", p,
                  " is not a post-order parent (need n < parent < N, or -1 for a root)");
      if (p >= 0 && children[p]++ == 0) first_child[p] = static_cast<int32_t>(n);
    }
    for (int64_t n = N - 1; n >= 0; --n) {  // parents first
      depth[n] = par[n] == -1 ? 0 : depth[par[n]] + 1;
      TORCH_CHECK(depth[n] <= max_depth, "trie_reduce_cpu: node ", n, " has depth ", depth[n],
                  " > max_depth = ", max_depth);
    }
    int32_t prev = 0;
    for (int64_t i = 0; i < L; ++i) {
      TORCH_CHECK(ln[i] >= prev && ln[i] < N, "trie_reduce_cpu: node_of_leaf must be "
                  "non-decreasing node ids in [0, N); node_of_leaf[", i, "] = ", ln[i]);
      prev = ln[i];
      TORCH_CHECK(lt[i] >= 0 && lt[i] < C, "trie_reduce_cpu: leaf_token[", i, "] = ", lt[i],
                  " is outside the ", C, " value columns");
    }
    for (int64_t i = 0; i < E; ++i)
      TORCH_CHECK(en[i] >= 0 && en[i] < N, "trie_reduce_cpu: empty_nodes[", i, "] = ", en[i],
                  " is not a node id");
    // runs: consecutive chains whose nodes above the first have one child (the node below)
    // and no leaf, with the depths and leaf ranges the sweep relies on
    TORCH_CHECK(rleaf[0] == 0 && rleaf[R] == L, "trie_reduce_cpu: run_leaf must start at 0 and "
                "end at L = ", L);
    const int32_t identity_slot = static_cast<int32_t>(max_depth) + 1;  // never written
    int32_t start = 0;
    for (int64_t i = 0; i < R; ++i) {
      const int32_t end = rend[i];
      TORCH_CHECK(end > start && end <= N && (i + 1 < R || end == N), "trie_reduce_cpu: "
                  "run_end must increase to N; run_end[", i, "] = ", end);
      for (int32_t n = start; n < end; ++n) {
        TORCH_CHECK(rof[n] == i, "trie_reduce_cpu: run_of[", n, "] = ", rof[n], ", not ", i);
        TORCH_CHECK(n == start || (par[n - 1] == n && children[n] == 1),
                    "trie_reduce_cpu: node ", n, " of run ", i, " is not the single-child "
                    "parent of node ", n - 1);
      }
      const int32_t top = end - 1;
      const bool first = par[top] == -1 || first_child[par[top]] == top;
      const int32_t child_slot = children[start] ? depth[start] + 1 : identity_slot;
      const int32_t join_slot = first ? identity_slot : depth[top];
      TORCH_CHECK(rdep[i] == depth[top] && rcs[i] == child_slot && rjs[i] == join_slot,
                  "trie_reduce_cpu: run ", i, " has run_depth ", rdep[i], ", run_child_slot ",
                  rcs[i], " and run_join_slot ", rjs[i], " but its nodes say ", depth[top], ", ",
                  child_slot, " and ", join_slot);
      TORCH_CHECK(rleaf[i] <= rleaf[i + 1], "trie_reduce_cpu: run_leaf must not decrease");
      for (int32_t p = rleaf[i]; p < rleaf[i + 1]; ++p)
        TORCH_CHECK(ln[p] == start, "trie_reduce_cpu: leaf position ", p, " (node ", ln[p],
                    ") is listed under run ", i, ", which starts at node ", start);
      start = end;
    }
  }
  const bool out_double = (values.scalar_type() == at::kDouble || float64_result) && red != 2;
  at::Tensor out = OutputPool::empty({B, N}, out_double ? at::kDouble : at::kFloat);
  genlm_fast::cpu::Args A;
  A.values = values.data_ptr();
  A.in_type = dtype_code(values.scalar_type());
  A.B = B;
  A.C = C;
  A.parent = par;
  A.run_end = rend;
  A.run_depth = rdep;
  A.run_child_slot = rcs;
  A.run_join_slot = rjs;
  A.run_leaf = rleaf;
  A.run_of = rof;
  A.num_runs = R;
  A.max_depth = static_cast<int32_t>(max_depth);
  A.node_of_leaf = ln;
  A.leaf_token = lt;
  A.N = N;
  A.L = L;
  A.empty_nodes = en;
  A.E = E;
  A.out = out.data_ptr();
  A.out_double = out_double;
  A.reduction = red;
  A.num_threads = static_cast<int>(std::max<int64_t>(0, num_threads));  // 0: team_size
  int64_t status;
  {
    pybind11::gil_scoped_release no_gil;
    status = genlm_fast::cpu::trie_reduce(A);
  }
  return {out, status - 1};
}

void empty_output_cache() { OutputPool::clear(); }

std::vector<int64_t> output_cache_sizes() { return OutputPool::cached_sizes(); }

}  // namespace genlm_fast
