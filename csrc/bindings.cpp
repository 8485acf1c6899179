// Python bindings of the trie kernels: module genlm_fast._C (or genlm_fast_C when JIT-built).
//
//   trie_reduce_cpu(values, parent, node_of_leaf, leaf_token, empty_nodes, run_end, run_depth,
//                   run_child_slot, run_join_slot, run_leaf, run_of, max_depth, reduction,
//                   check_indices=True, num_threads=0, float64_result=False)
//                   -> (Tensor[B, N], bad_row)
//                   the result is float32, or float64 for sum/max of float64 values or with
//                   float64_result (float32 values are then read as they are)
//                   bad_row = -1, or the first row the kernel rejected (a NaN for sum/max;
//                   no finite maximum for log_mass), whose result is then incomplete
//   trie_reduce_cuda(values, leaf_token, column_leaf, tile_node_lo, tile_run_ptr, run_bounds,
//                    node_src, tile_scratch_ptr, scratch_src, scratch_slot, span_node,
//                    span_left, span_right, span_tile_lo, span_tile_hi, span_narrow,
//                    span_warp, scratch, reduction, num_nodes, num_scratch, tile)
//                    -> Tensor[B, num_nodes]   (only when built with -DWITH_CUDA; scratch is a
//                    float64 [B, num_scratch + 2] workspace the caller allocates, its last
//                    column each row's check, NaN exactly for a bad row (log_mass: else
//                    log(sum exp(x - m)) with the row max m in the column before; sum/max:
//                    else 0); spanning nodes [0, span_narrow) are narrow (a thread each),
//                    [span_narrow, span_warp) a warp each, the rest a block each)
//   cpu_team_size(bytes) -> int  the threads a CPU kernel's parallel region over about
//                   `bytes` of memory traffic gets now (cpu_threads.h: usable CPUs, contention,
//                   torch's setting, the work); cpu_free_cpus() -> int  the first two alone;
//                   cpu_threads_info() -> dict of what they are decided from
//   empty_output_cache()  frees the cached blocks large CPU results reuse (OutputPool below)
//   output_cache_sizes()  the bytes of each cached block, least recently returned first
//   DecoderSpec, DecoderCPU(spec, weights): a decoder-only transformer's forward over
//                   a few new tokens per row in one call (decoder_cpu.cpp; the Python side:
//                   genlm_fast/backend/llm/decoder.py); decoder_supported() -> bool;
//                   WeightWatch(params, dicts).changed() -> what was replaced or edited
//                   first (a dict of the model's structure, or a parameter), or -1;
//                   stream_read(data, streams), fma_rate(iterations): the memory and
//                   arithmetic floors bench/lm_floor.py compares a forward with
//   pack_linear_weight(weight) -> panels;  linear_small_batch(x, panels, bias, out_features,
//                   isa="auto") -> x @ weight.T + bias;  linear_best_isa() -> "avx512" | ...
//                   the small-batch float32 linear layer of linear_cpu.cpp (AsyncTransformer's
//                   decoding steps on the CPU: genlm_fast/backend/llm/cpu_linear.py)
//
// The index arrays are the int32 arrays of genlm_fast.ops.layout.TrieLayout.device_arrays,
// plus those the CUDA path derives once per layout (cuda_backend.py: `column_leaf[c]` = the
// leaf position reading column c, or -1) and the CPU path (cpu_backend.py caches them):
// `node_of_leaf[pos]` = the node receiving leaf position pos (non-decreasing), `empty_nodes` = the
// nodes with no leaves (they are 0 under "max"), the runs of single-child links the row sweep
// steps over (see trie_reduce_cpu.h) and the maximum depth. Validation of
// dtypes, devices, shapes and contiguity always runs; check_indices=True also checks every
// index (O(N + L)) so that malformed arrays raise instead of reading out of bounds.

#include <torch/extension.h>

#include "cpu_threads.h"
#include "decoder_cpu.h"
#include "linear_cpu.h"
#include "trie_reduce_cpu.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#ifdef WITH_CUDA
// c10's stream header (what at::cuda::getCurrentCUDAStream re-exports) instead of
// ATen/cuda/CUDAContext.h, which also drags in the cuBLAS/cuSPARSE headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trie_reduce_cuda.h"
#endif


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

int parse_reduction(const std::string& r) {
  if (r == "sum") return 0;
  if (r == "max") return 1;
  if (r == "log_mass") return 2;
  TORCH_CHECK(false, "trie_reduce: unknown reduction '", r,
              "'; expected 'sum', 'max' or 'log_mass'");
  return -1;
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    default: return -1;
  }
}

void check_values(const at::Tensor& values, int reduction, const char* device_name) {
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

void check_index(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "trie_reduce: index array '", name,
              "' must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, "trie_reduce: index array '", name, "' must be 1-D, got ", t.dim(),
              " dimensions");
  TORCH_CHECK(t.is_contiguous(), "trie_reduce: index array '", name, "' must be contiguous");
  TORCH_CHECK(t.device() == device, "trie_reduce: index array '", name, "' is on ", t.device(),
              " but values are on ", device);
}

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

#ifdef WITH_CUDA
at::Tensor trie_reduce_cuda(const at::Tensor& values, const at::Tensor& leaf_token,
                            const at::Tensor& column_leaf, const at::Tensor& tile_node_lo,
                            const at::Tensor& tile_run_ptr,
                            const at::Tensor& run_bounds, const at::Tensor& node_src,
                            const at::Tensor& tile_scratch_ptr, const at::Tensor& scratch_src,
                            const at::Tensor& scratch_slot, const at::Tensor& span_node,
                            const at::Tensor& span_left, const at::Tensor& span_right,
                            const at::Tensor& span_tile_lo, const at::Tensor& span_tile_hi,
                            int64_t span_narrow, int64_t span_warp,
                            const at::Tensor& scratch,
                            const std::string& reduction, int64_t num_nodes,
                            int64_t num_scratch, int64_t tile) {
  const int red = parse_reduction(reduction);
  TORCH_CHECK(values.is_cuda(), "trie_reduce_cuda: values must be a CUDA tensor, got one on ",
              values.device());
  check_values(values, red, "cuda");
  const at::Device dev = values.device();
  check_index(leaf_token, "leaf_token", dev);
  check_index(column_leaf, "column_leaf", dev);
  check_index(tile_node_lo, "tile_node_lo", dev);
  check_index(tile_run_ptr, "tile_run_ptr", dev);
  check_index(run_bounds, "run_bounds", dev);
  check_index(node_src, "node_src", dev);
  check_index(tile_scratch_ptr, "tile_scratch_ptr", dev);
  check_index(scratch_src, "scratch_src", dev);
  check_index(scratch_slot, "scratch_slot", dev);
  check_index(span_node, "span_node", dev);
  check_index(span_left, "span_left", dev);
  check_index(span_right, "span_right", dev);
  check_index(span_tile_lo, "span_tile_lo", dev);
  check_index(span_tile_hi, "span_tile_hi", dev);
  const int64_t B = values.size(0), C = values.size(1);
  const int64_t n_tiles = tile_node_lo.numel() - 1;
  const int64_t S = span_node.numel();
  TORCH_CHECK(n_tiles >= 1, "trie_reduce_cuda: tile_node_lo needs at least 2 entries");
  TORCH_CHECK(tile_run_ptr.numel() == n_tiles + 1 && tile_scratch_ptr.numel() == n_tiles + 1,
              "trie_reduce_cuda: tile_run_ptr and tile_scratch_ptr need n_tiles + 1 = ",
              n_tiles + 1, " entries, got ", tile_run_ptr.numel(), " and ",
              tile_scratch_ptr.numel());
  TORCH_CHECK(node_src.numel() == num_nodes, "trie_reduce_cuda: node_src needs one entry per "
              "node (", num_nodes, "), got ", node_src.numel());
  TORCH_CHECK(scratch_slot.numel() == scratch_src.numel(),
              "trie_reduce_cuda: scratch_src and scratch_slot lengths differ");
  TORCH_CHECK(tile >= 1 && tile <= genlm_fast::cuda::kMaxTile,
              "trie_reduce_cuda: tile must be in [1, ", genlm_fast::cuda::kMaxTile, "], got ", tile);
  TORCH_CHECK(span_left.numel() == S && span_right.numel() == S && span_tile_lo.numel() == S &&
                  span_tile_hi.numel() == S,
              "trie_reduce_cuda: span_* arrays have different lengths");
  TORCH_CHECK(span_narrow >= 0 && span_narrow <= span_warp && span_warp <= S,
              "trie_reduce_cuda: need 0 <= span_narrow <= span_warp <= S = ", S, ", got ",
              span_narrow, " and ", span_warp);
  TORCH_CHECK(num_nodes >= 1, "trie_reduce_cuda: num_nodes must be positive");
  TORCH_CHECK(column_leaf.numel() <= C && leaf_token.numel() <= C,
              "trie_reduce_cuda: rows have ", C, " entries, fewer than the column_leaf (",
              column_leaf.numel(), ") or leaf_token (", leaf_token.numel(), ") entries");
  TORCH_CHECK(num_scratch >= n_tiles, "trie_reduce_cuda: num_scratch (", num_scratch,
              ") must cover the ", n_tiles, " tile totals");
  TORCH_CHECK(scratch.device() == dev && scratch.scalar_type() == at::kDouble &&
                  scratch.is_contiguous() && scratch.dim() == 2 && scratch.size(0) >= B &&
                  scratch.size(1) >= num_scratch + 2,
              "trie_reduce_cuda: scratch must be a contiguous float64 [B, num_scratch + 2] tensor "
              "on the values' device, got ", scratch.scalar_type(), " ", scratch.sizes(), " on ",
              scratch.device());
  const bool out_double = values.scalar_type() == at::kDouble && red != 2;
  at::Tensor out =
      at::empty({B, num_nodes}, values.options().dtype(out_double ? at::kDouble : at::kFloat));
  if (B == 0) return out;
  const c10::cuda::CUDAGuard guard(dev);
  genlm_fast::cuda::TrieArgs A;
  A.values = values.data_ptr();
  // the tile kernel's gather reads the values staged, a block's rows side by side in leaf
  // order (see trie_reduce_cuda.cu, (a1)); a batch too small to gain from it gets none
  at::Tensor staged;
  if (B >= genlm_fast::cuda::kStageMinRows) staged = at::empty_like(values);
  A.staged = staged.defined() ? staged.data_ptr() : nullptr;
  A.dtype = dtype_code(values.scalar_type());
  A.B = B;
  A.C = C;
  A.leaf_token = leaf_token.data_ptr<int32_t>();
  A.L = leaf_token.numel();
  A.column_leaf = column_leaf.data_ptr<int32_t>();
  A.n_column_leaf = column_leaf.numel();
  A.tile_node_lo = tile_node_lo.data_ptr<int32_t>();
  A.n_tiles = n_tiles;
  A.tile_run_ptr = tile_run_ptr.data_ptr<int32_t>();
  A.run_bounds = run_bounds.data_ptr<int32_t>();
  A.node_src = node_src.data_ptr<int32_t>();
  A.tile_scratch_ptr = tile_scratch_ptr.data_ptr<int32_t>();
  A.scratch_src = scratch_src.data_ptr<int32_t>();
  A.scratch_slot = scratch_slot.data_ptr<int32_t>();
  A.span_node = span_node.data_ptr<int32_t>();
  A.span_left = span_left.data_ptr<int32_t>();
  A.span_right = span_right.data_ptr<int32_t>();
  A.span_tile_lo = span_tile_lo.data_ptr<int32_t>();
  A.span_tile_hi = span_tile_hi.data_ptr<int32_t>();
  A.S = S;
  A.span_narrow = span_narrow;
  A.span_warp = span_warp;
  A.num_nodes = num_nodes;
  A.scratch = scratch.data_ptr<double>();
  A.scratch_stride = scratch.size(1);
  A.tile = static_cast<int>(tile);
  A.out = out.data_ptr();
  A.out_double = out_double;
  A.reduction = red;
  const cudaError_t err =
      genlm_fast::cuda::trie_reduce(A, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "trie_reduce_cuda: kernel launch failed: ",
              cudaGetErrorString(err));
  return out;
}
#endif

}  // namespace

static pybind11::dict cpu_threads_info() {
  const genlm_fast::cpu::ThreadsInfo info = genlm_fast::cpu::threads_info();
  pybind11::dict d;
  d["affinity_cpus"] = info.affinity_cpus;
  d["quota_cpus"] = info.quota_cpus;
  d["usable_cpus"] = info.usable_cpus;
  d["others_busy"] = info.others_busy;
  d["free_cpus"] = info.free_cpus;
  d["torch_threads"] = info.torch_threads;
  d["contention_known"] = info.contention_known;
  return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "genlm_fast trie reduction kernels";
  // the first contention reading: the window of the next one starts now
  genlm_fast::cpu::threads_info();
  m.def("cpu_team_size", &genlm_fast::cpu::team_size,
        "Threads for a CPU parallel region over about `bytes` of memory traffic, now",
        pybind11::arg("bytes"));
  m.def("cpu_free_cpus", &genlm_fast::cpu::free_cpus,
        "The usable CPUs other work leaves free now (affinity, cgroup quota, contention)");
  m.def("cpu_threads_info", &cpu_threads_info,
        "What the CPU kernels' team sizes are decided from: usable CPUs (affinity, cgroup "
        "quota), CPUs other work keeps busy, torch's thread setting");
  m.def("trie_reduce_cpu", &trie_reduce_cpu, "Per-node sum/max/log_mass of a vocabulary trie (CPU)",
        pybind11::arg("values"), pybind11::arg("parent"), pybind11::arg("node_of_leaf"),
        pybind11::arg("leaf_token"), pybind11::arg("empty_nodes"), pybind11::arg("run_end"),
        pybind11::arg("run_depth"), pybind11::arg("run_child_slot"),
        pybind11::arg("run_join_slot"), pybind11::arg("run_leaf"), pybind11::arg("run_of"),
        pybind11::arg("max_depth"), pybind11::arg("reduction"),
        pybind11::arg("check_indices") = true, pybind11::arg("num_threads") = 0,
        pybind11::arg("float64_result") = false);
  m.def("empty_output_cache", &OutputPool::clear,
        "Free the cached blocks that large CPU results are reused from");
  m.def("output_cache_sizes", &OutputPool::cached_sizes,
        "Bytes of each cached result block, least recently returned first");
  m.def("pack_linear_weight", &genlm_fast::cpu::pack_linear_weight,
        "A float32 [N, K] weight as the panels linear_small_batch reads", pybind11::arg("weight"));
  m.def("linear_small_batch", &genlm_fast::cpu::linear_small_batch,
        "x @ weight.T + bias for a few rows of x, weight given as its panels",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias"),
        pybind11::arg("out_features"), pybind11::arg("isa") = "auto");
  m.def("linear_best_isa", &genlm_fast::cpu::linear_best_isa,
        "The widest linear_small_batch kernel this CPU runs: avx512 or baseline");
  {
    using genlm_fast::cpu::DecoderCPU;
    using genlm_fast::cpu::DecoderSpec;
    // module_local: another build of these sources (the baseline one the tests load) can
    // then register its own classes in the same process
    pybind11::class_<DecoderSpec>(m, "DecoderSpec", "What a DecoderCPU computes besides weights",
                                 pybind11::module_local())
        .def(pybind11::init<>())
        .def_readwrite("layers", &DecoderSpec::layers)
        .def_readwrite("hidden", &DecoderSpec::hidden)
        .def_readwrite("heads", &DecoderSpec::heads)
        .def_readwrite("kv_heads", &DecoderSpec::kv_heads)
        .def_readwrite("head_dim", &DecoderSpec::head_dim)
        .def_readwrite("inter", &DecoderSpec::inter)
        .def_readwrite("vocab", &DecoderSpec::vocab)
        .def_readwrite("max_positions", &DecoderSpec::max_positions)
        .def_readwrite("layer_norm", &DecoderSpec::layer_norm)
        .def_readwrite("eps", &DecoderSpec::eps)
        .def_readwrite("act", &DecoderSpec::act)
        .def_readwrite("gated", &DecoderSpec::gated)
        .def_readwrite("qk_norm", &DecoderSpec::qk_norm)
        .def_readwrite("post_norms", &DecoderSpec::post_norms)
        .def_readwrite("learned_positions", &DecoderSpec::learned_positions)
        .def_readwrite("embed_scale", &DecoderSpec::embed_scale)
        .def_readwrite("attn_softcap", &DecoderSpec::attn_softcap)
        .def_readwrite("final_softcap", &DecoderSpec::final_softcap)
        .def_readwrite("scaling", &DecoderSpec::scaling)
        .def_readwrite("window", &DecoderSpec::window);
    pybind11::class_<DecoderCPU>(m, "DecoderCPU",
                                 "A decoder-only transformer's forward in one call",
                                 pybind11::module_local())
        .def(pybind11::init<DecoderSpec, std::map<std::string, torch::Tensor>>(),
             pybind11::arg("spec"), pybind11::arg("weights"))
        .def("forward", &DecoderCPU::forward, pybind11::arg("tokens"), pybind11::arg("positions"),
             pybind11::arg("row_start"), pybind11::arg("cos"), pybind11::arg("sin"),
             pybind11::arg("runs"), pybind11::arg("run_start"))
        .def_property_readonly("weight_bytes", &DecoderCPU::weight_bytes)
        .def_property_readonly("weight_dtype", &DecoderCPU::weight_dtype);
    pybind11::class_<genlm_fast::cpu::WeightWatch>(
        m, "WeightWatch", "Whether a model's parameters changed since it was built",
        pybind11::module_local())
        .def(pybind11::init<std::vector<torch::Tensor>,
                            std::vector<std::pair<pybind11::dict,
                                                  genlm_fast::cpu::WeightWatch::DictItems>>>(),
             pybind11::arg("params"), pybind11::arg("dicts"))
        .def("changed", &genlm_fast::cpu::WeightWatch::changed,
             "What changed first (dict i: i, parameter j: len(dicts) + j), or -1");
    m.def("decoder_supported", &genlm_fast::cpu::decoder_supported,
          "Whether this CPU runs DecoderCPU (AVX-512F)");
    m.def("stream_read", &genlm_fast::cpu::stream_read,
          "Sum of a float32 tensor read as `streams` sequential streams per thread",
          pybind11::arg("data"), pybind11::arg("streams") = 2);
    m.def("fma_rate", &genlm_fast::cpu::fma_rate,
          "FLOP/s of register-only AVX-512 multiply-adds on the decoder's threads",
          pybind11::arg("iterations") = 20000000);
  }
#ifdef WITH_CUDA
  m.def("trie_reduce_cuda", &trie_reduce_cuda,
        "Per-node sum/max/log_mass of a vocabulary trie (CUDA, tile decomposition)",
        pybind11::arg("values"), pybind11::arg("leaf_token"), pybind11::arg("column_leaf"),
        pybind11::arg("tile_node_lo"), pybind11::arg("tile_run_ptr"),
        pybind11::arg("run_bounds"), pybind11::arg("node_src"),
        pybind11::arg("tile_scratch_ptr"), pybind11::arg("scratch_src"),
        pybind11::arg("scratch_slot"), pybind11::arg("span_node"), pybind11::arg("span_left"),
        pybind11::arg("span_right"), pybind11::arg("span_tile_lo"), pybind11::arg("span_tile_hi"),
        pybind11::arg("span_narrow"), pybind11::arg("span_warp"), pybind11::arg("scratch"),
        pybind11::arg("reduction"), pybind11::arg("num_nodes"), pybind11::arg("num_scratch"),
        pybind11::arg("tile"));
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
