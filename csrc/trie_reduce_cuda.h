// Launcher interface of the CUDA trie kernels (trie_reduce_cuda.cu). Plain pointers only:
// the .cu compiles standalone with `nvcc -c`, and bindings.cpp (built with -DWITH_CUDA)
// passes torch tensors' data pointers and the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace genlm_fast {
namespace cuda {

// leaf positions per tile the tile kernel accepts: its shared arrays, sized for this many
// whatever the layout's tile (2 * 64 * 33 doubles at most, 40 KiB with the static ones), fit
// the 48 KiB a launch gets without opting in (genlm_fast/ops/layout.py uses 64)
constexpr int kMaxTile = 64;

// batches of at least this many rows have their values staged for the tile kernel's gather
// (trie_reduce_cuda.cu, (a1)): a column's values for 8 rows of float fill a 32-byte sector
constexpr int kStageMinRows = 8;

enum DType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };
enum Reduction : int { kSum = 0, kMax = 1, kLogMass = 2 };

// The tile decomposition of genlm_fast/ops/layout.py, for one trie mode. All device pointers.
struct TrieArgs {
  const void* values;  // [B, C] contiguous, dtype as below
  void* staged;        // workspace of B * C values of that dtype (B >= kStageMinRows; C >= L),
                       // or null: no staging. Its contents on return are unspecified.
  int dtype;           // DType (sum/max: kF32 or kF64 only)
  int64_t B, C;
  const int32_t* leaf_token;  // [L] column of each leaf position
  int64_t L;
  const int32_t* column_leaf;  // [n_column_leaf <= C] its inverse: the leaf position of each
  int64_t n_column_leaf;       // column, -1 for a column no leaf reads (staging only)
  const int32_t* tile_node_lo;  // [n_tiles + 1] the node ids tile t owns (and writes):
                                // [tile_node_lo[t], tile_node_lo[t + 1])
  int64_t n_tiles;
  const int32_t* tile_run_ptr;  // [n_tiles + 1] CSR of the tiles' runs (layout.py)
  const int32_t* run_bounds;    // local positions a | b << 16 of each run
  const int32_t* node_src;      // [num_nodes] a node's source code in its owning tile: a
                                // position < tile, tile + run, 2 * tile - 2 (the whole
                                // tile) or 2 * tile - 1 (none)
  const int32_t* tile_scratch_ptr;  // [n_tiles + 1] CSR of the tiles' scratch values
  const int32_t* scratch_src;       // their source codes
  const int32_t* scratch_slot;      // their scratch slots
  const int32_t* span_node;   // [S] spanning nodes
  const int32_t* span_left;   // scratch slot of the left piece or -1
  const int32_t* span_right;  // scratch slot of the right piece or -1
  const int32_t* span_tile_lo;  // first whole tile (its total sits in scratch slot = tile id)
  const int32_t* span_tile_hi;  // one past the last whole tile
  int64_t S;
  int64_t span_narrow;  // spans [0, span_narrow) are narrow: a thread each,
  int64_t span_warp;    // [span_narrow, span_warp) a warp each, the rest a block each
  int64_t num_nodes;
  double* scratch;  // [B, scratch_stride] workspace; scratch_stride >= num_scratch + 2, the
                    // last column of each row holds the row check on return: NaN exactly
                    // for a bad row (a NaN value; log_mass: or a +inf logit, or no finite
                    // one), else log_mass log(sum exp(x - m)), sum and max 0; log_mass
                    // leaves the row's max m in the column before it
  int64_t scratch_stride;
  int tile;                // leaf positions per tile, <= kMaxTile
  void* out;               // [B, num_nodes] float32, or float64 when out_double
  bool out_double;         // only with kF64 input and sum/max
  int reduction;           // Reduction
};

// Enqueues the kernels on `stream`; returns the launch status (cudaGetLastError()).
cudaError_t trie_reduce(const TrieArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace genlm_fast
