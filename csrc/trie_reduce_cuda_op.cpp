// genlm_fast._C.trie_reduce_cuda: checks the tensors and index arrays, allocates the result
// and the staging workspace, and launches the CUDA kernels (trie_reduce_cuda.cu) on the
// current stream. Compiled only into a CUDA build (-DWITH_CUDA).

#ifdef WITH_CUDA

#include "trie_reduce_ops.h"

// c10's stream header (what at::cuda::getCurrentCUDAStream re-exports) instead of
// ATen/cuda/CUDAContext.h, which also drags in the cuBLAS/cuSPARSE headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trie_reduce_checks.h"
#include "trie_reduce_cuda.h"

namespace genlm_fast {

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

}  // namespace genlm_fast

#endif  // WITH_CUDA
