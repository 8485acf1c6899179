// The torch entry points of the trie reductions and their output cache, bound as
// genlm_fast._C's functions of the same names (bindings.cpp documents the arguments).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace genlm_fast {

// trie_reduce_cpu_op.cpp
std::tuple<at::Tensor, int64_t> trie_reduce_cpu(
    const at::Tensor& values, const at::Tensor& parent, const at::Tensor& node_of_leaf,
    const at::Tensor& leaf_token, const at::Tensor& empty_nodes, const at::Tensor& run_end,
    const at::Tensor& run_depth, const at::Tensor& run_child_slot,
    const at::Tensor& run_join_slot, const at::Tensor& run_leaf, const at::Tensor& run_of,
    int64_t max_depth, const std::string& reduction, bool check_indices, int64_t num_threads,
    bool float64_result);
void empty_output_cache();                 // frees the cached result blocks
std::vector<int64_t> output_cache_sizes();  // their bytes, least recently returned first

#ifdef WITH_CUDA
// trie_reduce_cuda_op.cpp
at::Tensor trie_reduce_cuda(const at::Tensor& values, const at::Tensor& leaf_token,
                            const at::Tensor& column_leaf, const at::Tensor& tile_node_lo,
                            const at::Tensor& tile_run_ptr, const at::Tensor& run_bounds,
                            const at::Tensor& node_src, const at::Tensor& tile_scratch_ptr,
                            const at::Tensor& scratch_src, const at::Tensor& scratch_slot,
                            const at::Tensor& span_node, const at::Tensor& span_left,
                            const at::Tensor& span_right, const at::Tensor& span_tile_lo,
                            const at::Tensor& span_tile_hi, int64_t span_narrow,
                            int64_t span_warp, const at::Tensor& scratch,
                            const std::string& reduction, int64_t num_nodes,
                            int64_t num_scratch, int64_t tile);
#endif

}  // namespace genlm_fast
