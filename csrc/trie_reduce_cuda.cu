// CUDA trie reduction kernels: the tile decomposition of genlm_fast/ops/layout.py (the
// same decomposition as the Triton backend). No torch headers: plain device pointers, sizes
// and a cudaStream_t (see trie_reduce_cuda.h); compiles standalone with `nvcc -c`.
//
// Layout recap. Leaves are sorted by node id ("leaf order"), so the leaves beneath any node
// are one contiguous range of leaf positions. The leaf order is cut into tiles of `tile`
// positions. A node whose range lies inside one tile is "local"; the others are "spanning"
// and are split into an optional left piece, whole tiles, and an optional right piece. The
// pieces and each tile's total are themselves local ranges that write to a per-row scratch
// buffer (tile totals at slots [0, n_tiles), pieces after them). Within a tile, the "unit"
// ranges (one leaf: ~80% of all ranges on real vocabularies, the leaves and the single-child
// chains above them) come first, [tile_range_ptr[t], tile_unit_end[t]); the other ranges
// (empty, or two leaves and more) follow.
//
// Kernels, enqueued in order on one stream:
//  (a) log_mass only: lse = max + log(sum exp(x - max)) of each row over all C columns,
//      stored (double) in the row's last scratch column. (a1) row_lse_partial: grid (splits,
//      rows), each block reads one slice of a row once (kLseUnroll independent loads in
//      flight per thread) keeping an online (max, sum-exp) pair per thread: one float exp per
//      element, the sum in double; it writes the slice's partial (max, sum) to two scratch
//      slots the tile kernel only fills later. (a2) row_lse_merge: one warp per row merges
//      the partials. Splitting rows keeps the device busy even at B = 1.
//  (b) tile: one block per (tile, block of ROWS rows, ROWS = 1..32). The tile's leaf values
//      of those rows, x[row, leaf_token[pos]], are gathered into shared memory once (log_mass:
//      as log-probabilities x - lse, float), laid out [position][row] with an odd row stride,
//      so that both "lanes = rows" and "lanes = positions" accesses are free of bank
//      conflicts. Results go to a shared *stage* indexed by node id: a tile owns one block
//      of node ids (layout.py's tile_node_lo: the nodes whose last leaf is in the tile, ~200
//      on Llama-3), so each row of the block is written out whole, in coalesced lines, once
//      (scattered 4-byte stores to the same lines, as units and other ranges interleave,
//      cost ~2.4x the L2 transactions). Into the stage:
//        units: a thread per unit range copies its leaf's value, for every row. The value
//          is exact (log_mass: the log-probability itself, no exp/log round trip).
//        other ranges: lanes = rows, so a warp walks the same range(s) for its rows with no
//          divergence. sum: a double sum; max: the max (exact); log_mass: per row the
//          tile's largest log-probability is the shift, and a range is shift + log(sum of
//          exp(v - shift)) (float exp, double sum). That is exact to float rounding when the
//          sum is >= kFastMinMass (1e-24): a term exp() flushed or made subnormal is
//          < 2^-126, 64 of them < 1e-36, i.e. < 1e-12 of the range's mass. A range below
//          that (every leaf over ~55 nats under the tile's max, or all -inf: masks of
//          -1e30) is redone on its own lane: its own max, then the sum of exp(v - max):
//          exact whatever the spread. -inf only where every leaf is -inf.
//      A destination >= 0 is a node (to the stage), < 0 is scratch slot -1 - dest (tile
//      totals and pieces, stored directly).
//  (c) span: a spanning node combines its left piece, the totals of its whole tiles and its
//      right piece, all in the row's scratch. Nodes are sorted by tile count and most have
//      a few whole tiles (Llama-3: 5,171 nodes, 5,591 tiles in all): the first
//      `span_narrow` nodes (genlm_fast/ops/layout.py: at most SPAN_NARROW_TILES tiles) get
//      one thread per (node, row), consecutive threads at consecutive nodes; the wide rest
//      (the root and the top levels, a few dozen) one warp per (node, row), its lanes
//      striding over the tiles. One launch: the narrow part is the grid's first blocks.
//      Sums in double; log_mass as the max, then a double sum of exp(v - max).
//  Memory: the output is written once and never read here, so it is stored evict-first
//  (__stcs); the logits are loaded with an L2 evict-last hint (load_keep): (a) reads each
//  row once, coalesced, and (b) gathers every column again, each 32-byte sector by ~8
//  different tile blocks, which then find it in L2 instead of behind ~100 MB of output.
// Empty nodes (no leaves; always local): 0 for sum and max, -inf for log_mass. Floats are
// enough where they are used: the design's bound on log-masses is 1e-4 absolute, these
// kernels stay within a few float ulps of the float64 reference (tests/ops/
// test_cuda_emulation.py runs this file on the CPU and checks it).
// Templates over the input type (float, double, __half, __nv_bfloat16), the output type
// (float, double), the reduction and the rows per tile block.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "trie_reduce_cuda.h"

namespace genlm_fast {
namespace cuda {
namespace {

constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
// tile blocks per SM that shared memory allows (4 x ~47 KiB); as a launch bound it also
// lets ptxas use up to 64 registers a thread (without it, it spilled at 40-48)
constexpr int kTileBlocksPerSM = 4;
constexpr int kGatherUnroll = 8;    // independent leaf loads in flight per thread in (b)
constexpr float kFastMinMass = 1e-24f;
constexpr int kLseThreads = 256;
constexpr int kLseUnroll = 8;       // independent loads in flight per thread in (a1)
constexpr int64_t kLseMinChunk = 4096;  // columns per (a1) block, at least
constexpr int64_t kLseTargetBlocks = 1024;  // (a1) blocks per launch to aim for (B * splits)
constexpr int kSpanWarps = 8;        // (a2) and the wide part of (c): warps per block
constexpr int kSpanThreads = kSpanWarps * 32;  // (c)'s blocks: a thread per narrow node
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ double neg_inf() { return -__longlong_as_double(0x7ff0000000000000LL); }

// logits as the arithmetic type of (a1): float, or double for double logits
__device__ __forceinline__ float to_arith(float v) { return v; }
__device__ __forceinline__ double to_arith(double v) { return v; }
__device__ __forceinline__ float to_arith(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_arith(__nv_bfloat16 v) { return __bfloat162float(v); }

// A load with an L2 evict-last hint (sm_80+; elsewhere, and in the CPU emulation of
// tests/ops/test_cuda_emulation.py, a plain load). Read-only data: ld.global.nc.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define GF_KEEP_LOAD(PTX_TYPE, CONSTRAINT, BITS_T, FROM_BITS, T)                             \
  __device__ __forceinline__ T load_keep(const T* p) {                                     \
    uint64_t policy;                                                                       \
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));             \
    BITS_T bits;                                                                           \
    asm("ld.global.nc.L2::cache_hint." PTX_TYPE " %0, [%1], %2;"                           \
        : CONSTRAINT(bits) : "l"(p), "l"(policy));                                         \
    return FROM_BITS(bits);                                                                \
  }
GF_KEEP_LOAD("b32", "=r", unsigned int, __uint_as_float, float)
GF_KEEP_LOAD("b64", "=l", long long, __longlong_as_double, double)
GF_KEEP_LOAD("b16", "=h", unsigned short, __ushort_as_half, __half)
GF_KEEP_LOAD("b16", "=h", unsigned short, __ushort_as_bfloat16, __nv_bfloat16)
#undef GF_KEEP_LOAD
#else
template <class T>
__device__ __forceinline__ T load_keep(const T* p) { return *p; }
#endif

template <class V>
__device__ __forceinline__ V vmax(V a, V b) { return b > a ? b : a; }

// (m, s) represents m + log(s); merges (m2, s2) into it. m == -inf means "no mass".
__device__ __forceinline__ void lse_merge(double& m, double& s, double m2, double s2) {
  if (m2 == neg_inf()) return;
  if (m2 > m) {
    s = s * exp(m - m2) + s2;  // exp(-inf) = 0 while m is still -inf
    m = m2;
  } else {
    s += s2 * exp(m2 - m);
  }
}

template <int RED>
__device__ __forceinline__ double identity() {
  return RED == kSum ? 0.0 : neg_inf();
}

template <class V>
__device__ __forceinline__ V warp_max(V v) {
  for (int off = 16; off > 0; off >>= 1) v = vmax(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}
// every lane of the warp ends with the merge of all lanes' (m, z) pairs
__device__ __forceinline__ void warp_lse_merge(double& m, double& z) {
  for (int off = 16; off > 0; off >>= 1) {
    const double m2 = __shfl_xor_sync(kFullMask, m, off);
    const double z2 = __shfl_xor_sync(kFullMask, z, off);
    lse_merge(m, z, m2, z2);
  }
}

// ---------------------------------------------------------------------------- (a) row lse

// One logit into a thread's online pair: m the largest logit so far (exact), s the sum of
// exp(x - m) in double; one float exp per logit. A = float, or double for double logits.
template <class A>
__device__ __forceinline__ void online_lse(A& m, double& s, A x) {
  if (x == static_cast<A>(neg_inf())) return;  // no mass (and never -inf - -inf)
  if (x > m) {
    s = s * static_cast<double>(expf(static_cast<float>(m - x))) + 1.0;  // m = -inf: s = 0
    m = x;
  } else {
    s += static_cast<double>(expf(static_cast<float>(x - m)));
  }
}

// (a1) grid (splits, rows): each block reads one contiguous slice of a row ONCE, with
// kLseUnroll independent loads in flight per thread, keeps an online (max, sum-exp) pair per
// thread, merges them across the block and writes the slice's partial (m, s) to scratch
// slots [2 * split, 2 * split + 1] of its row. Those slots are free until the tile kernel,
// which runs after (a2), writes its totals there.
template <class T>
__global__ void __launch_bounds__(kLseThreads)
    row_lse_partial_kernel(const T* __restrict__ values, int64_t C, int64_t chunk,
                           double* __restrict__ scratch, int64_t stride, int64_t row0) {
  using A = decltype(to_arith(T()));
  __shared__ double red_m[kLseThreads / 32];
  __shared__ double red_s[kLseThreads / 32];
  const int64_t row = row0 + blockIdx.y;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t hi = lo + chunk < C ? lo + chunk : C;
  const T* x = values + row * C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  A m = static_cast<A>(neg_inf());
  double s = 0.0;
  int64_t c = lo + threadIdx.x;
  for (; c + (kLseUnroll - 1) * kLseThreads < hi; c += kLseUnroll * kLseThreads) {
    A v[kLseUnroll];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) v[u] = to_arith(load_keep(x + c + u * kLseThreads));
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) online_lse(m, s, v[u]);
  }
  for (; c < hi; c += kLseThreads) online_lse(m, s, to_arith(load_keep(x + c)));

  // block merge: every thread rescales its sum to the block max, then sums
  const double md = static_cast<double>(m);
  const double bm_w = warp_max(md);
  if (lane == 0) red_m[warp] = bm_w;
  __syncthreads();
  double bm = neg_inf();
#pragma unroll
  for (int w = 0; w < kLseThreads / 32; ++w) bm = vmax(bm, red_m[w]);
  const double sc = warp_sum(md == neg_inf() ? 0.0 : s * exp(md - bm));
  if (lane == 0) red_s[warp] = sc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
#pragma unroll
    for (int w = 0; w < kLseThreads / 32; ++w) tot += red_s[w];
    double* out = scratch + row * stride + 2 * static_cast<int64_t>(blockIdx.x);
    out[0] = bm;
    out[1] = tot;
  }
}

// (a2) one warp per row merges the row's `splits` partials into lse = max + log(sum),
// stored in the row's last scratch column.
__global__ void __launch_bounds__(kSpanWarps * 32)
    row_lse_merge_kernel(int64_t rows, int64_t splits, double* __restrict__ scratch,
                         int64_t stride, int64_t row0) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSpanWarps + (threadIdx.x >> 5);
  if (r >= rows) return;  // uniform per warp
  double* sc = scratch + (row0 + r) * stride;
  double m = neg_inf(), z = 0.0;
  for (int64_t k = lane; k < splits; k += 32) lse_merge(m, z, sc[2 * k], sc[2 * k + 1]);
  warp_lse_merge(m, z);
  // no finite logit (all -inf; the dispatcher rejects such rows): NaN, never a silent -inf
  if (lane == 0) sc[stride - 1] = m == neg_inf() ? __longlong_as_double(0x7ff8000000000000LL)
                                                 : m + log(z);
}

// ---------------------------------------------------------------------------- (b) tiles

// What the tile kernel keeps per (position, row): log_mass the log-probability (float),
// sum and max the input itself (the sums accumulate in double).
template <class T, int RED>
using TileValue = std::conditional_t<RED == kLogMass, float, T>;

// A node with no leaves: 0 under sum and max, -inf under log_mass.
template <int RED>
__device__ __forceinline__ double empty_node_value() {
  return RED == kLogMass ? neg_inf() : 0.0;
}

// Dynamic shared memory of a tile block: the gathered values [tile][ROWS + 1], then the
// stage [stage_ids][ROWS + 1] of results by node id. Under 48 KiB with the static arrays
// (no opt-in); stage_ids is what fits, in multiples of 32 (one store per lane).
constexpr size_t kTileDynamicShared = 46 * 1024;
constexpr int kMaxStageIds = 1024;

template <class T, class Out, int RED, int ROWS>
struct TileShape {
  // rounded up to 8 bytes: the stage after the values may hold doubles
  __host__ __device__ static constexpr size_t value_bytes(int tile) {
    return (static_cast<size_t>(ROWS + 1) * tile * sizeof(TileValue<T, RED>) + 7) / 8 * 8;
  }
  __host__ __device__ static constexpr int stage_ids(int tile) {
    const size_t room = (kTileDynamicShared - value_bytes(tile)) / ((ROWS + 1) * sizeof(Out));
    return static_cast<int>((room < kMaxStageIds ? room : kMaxStageIds) / 32 * 32);
  }
  __host__ __device__ static constexpr size_t bytes(int tile) {
    return value_bytes(tile) + static_cast<size_t>(stage_ids(tile)) * (ROWS + 1) * sizeof(Out);
  }
};

// A range of two leaves or more (or none), positions [a, b) of the tile, for row j: sum
// (double), max, or log_mass (float).
template <class T, int RED, int ROWS>
__device__ __forceinline__ auto reduce_range(const TileValue<T, RED>* vals, float shift, int a,
                                             int b, int j) {
  constexpr int kStride = ROWS + 1;
  if constexpr (RED == kSum) {
    double acc = 0.0;
    for (int p = a; p < b; ++p) acc += static_cast<double>(vals[p * kStride + j]);
    return acc;
  } else if constexpr (RED == kMax) {
    if (b <= a) return T(0);  // an empty node is 0 under max
    T m = vals[a * kStride + j];
    for (int p = a + 1; p < b; ++p) m = vmax(m, vals[p * kStride + j]);
    return m;
  } else {
    double sum = 0.0;  // terms exp(v - shift) <= 1; -inf leaves give 0
    for (int p = a; p < b; ++p) sum += expf(vals[p * kStride + j] - shift);
    if (sum >= kFastMinMass) return shift + logf(static_cast<float>(sum));
    // all leaves far below the tile's max (or -inf, or none): by the range's own max
    float m = static_cast<float>(neg_inf());
    for (int p = a; p < b; ++p) m = vmax(m, vals[p * kStride + j]);
    if (m == static_cast<float>(neg_inf())) return m;
    double z = 0.0;
    for (int p = a; p < b; ++p) z += expf(vals[p * kStride + j] - m);
    return m + logf(static_cast<float>(z));
  }
}

// One value to the output, which nothing here reads again: evict-first (see the header).
template <class Out>
__device__ __forceinline__ void store_out(Out* p, Out v) { __stcs(p, v); }

// src[0, rows) to dst[0], dst[row_stride], ...: a unit range's values, to the stage
// (row_stride 1) or to scratch (a tile total or a piece).
template <int ROWS, class Dst, class V>
__device__ __forceinline__ void store_rows(const V* src, Dst* dst, int64_t row_stride, int rows) {
  if (rows == ROWS) {  // a full block of rows: no per-row test
#pragma unroll
    for (int j = 0; j < ROWS; ++j) dst[j * row_stride] = static_cast<Dst>(src[j]);
  } else {
    for (int j = 0; j < rows; ++j) dst[j * row_stride] = static_cast<Dst>(src[j]);
  }
}

template <class T, class Out, int RED, int ROWS>
__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSM)
    tile_kernel(const T* __restrict__ values, int64_t C, const int32_t* __restrict__ leaf_token,
                int64_t L, const int32_t* __restrict__ tile_range_ptr,
                const int32_t* __restrict__ tile_unit_end,
                const int32_t* __restrict__ tile_node_lo,
                const int32_t* __restrict__ range_start, const int32_t* __restrict__ range_end,
                const int32_t* __restrict__ range_dest, double* __restrict__ scratch,
                int64_t stride, Out* __restrict__ out, int64_t num_nodes, int tile,
                int64_t row0, int64_t row_end) {
  using V = TileValue<T, RED>;
  using Shape = TileShape<T, Out, RED, ROWS>;
  constexpr int kStride = ROWS + 1;  // odd: lanes at consecutive rows, positions or node ids
                                     // hit different banks
  extern __shared__ double smem[];
  V* vals = reinterpret_cast<V*>(smem);  // [tile][kStride]
  Out* stage = reinterpret_cast<Out*>(reinterpret_cast<unsigned char*>(smem) +
                                      Shape::value_bytes(tile));  // [stage_ids][kStride]
  const int stage_ids = Shape::stage_ids(tile);
  __shared__ float shift[ROWS];     // log_mass: per row, the tile's largest v (0 if none)
  __shared__ double row_lse[ROWS];  // log_mass: per row, its log-sum-exp
  __shared__ int32_t token[kMaxTile];
  const int t = blockIdx.x;
  const int64_t first_row = row0 + static_cast<int64_t>(blockIdx.y) * ROWS;
  const int rows = row_end - first_row < ROWS ? static_cast<int>(row_end - first_row) : ROWS;
  const int64_t base = static_cast<int64_t>(t) * tile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // the tile's token columns (-1 past the last leaf) and, for log_mass, the rows' lse
  for (int p = threadIdx.x; p < tile; p += kTileThreads)
    token[p] = base + p < L ? leaf_token[base + p] : -1;
  if constexpr (RED == kLogMass) {
    if (threadIdx.x < ROWS)
      row_lse[threadIdx.x] = static_cast<int>(threadIdx.x) < rows
                                 ? scratch[(first_row + threadIdx.x) * stride + stride - 1]
                                 : 0.0;
  }
  __syncthreads();
  // gather: consecutive threads take consecutive rows of a position (ROWS is a power of 2),
  // kGatherUnroll independent loads in flight per thread (the loads are scattered: each is
  // a sector of its own, and one at a time per thread leaves the SM waiting on latency)
  for (int i0 = threadIdx.x; i0 < tile * ROWS; i0 += kGatherUnroll * kTileThreads) {
    T x[kGatherUnroll];
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int i = i0 + u * kTileThreads, j = i % ROWS, p = i / ROWS;
      if (i < tile * ROWS && j < rows && token[p] >= 0)
        x[u] = load_keep(values + (first_row + j) * C + token[p]);
    }
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int i = i0 + u * kTileThreads, j = i % ROWS, p = i / ROWS;
      if (i >= tile * ROWS) break;
      V v = static_cast<V>(neg_inf());  // past the last leaf or row: never read by a range
      if (j < rows && token[p] >= 0) {
        if constexpr (RED == kLogMass)
          v = static_cast<float>(static_cast<double>(to_arith(x[u])) - row_lse[j]);  // -inf stays
        else
          v = x[u];
      }
      vals[p * kStride + j] = v;
    }
  }
  __syncthreads();
  if constexpr (RED == kLogMass) {
    for (int j = warp; j < ROWS; j += kTileWarps) {  // a warp per row
      float m = static_cast<float>(neg_inf());
      for (int p = lane; p < tile; p += 32) m = vmax(m, vals[p * kStride + j]);
      m = warp_max(m);
      if (lane == 0) shift[j] = m == static_cast<float>(neg_inf()) ? 0.0f : m;
    }
    __syncthreads();
  }

  // The node ids the tile owns, [node_lo, node_hi), in passes of stage_ids (one, unless
  // the block is long; a pass even for none: the tile total and pieces go to scratch in
  // the first). Each pass fills the stage with the empty-node value (which also stands for
  // the spanning nodes here, written later by (c)), puts every range whose node is in the
  // pass there, and writes the stage out a row at a time: whole, coalesced lines. The
  // ranges of empty nodes sit in tile 0's list; they give the empty-node value, which their
  // own tile's stage holds already, so a range whose node lies outside the tile is skipped.
  const int r0 = tile_range_ptr[t], u1 = tile_unit_end[t], r1 = tile_range_ptr[t + 1];
  const int64_t node_lo = tile_node_lo[t], node_hi = tile_node_lo[t + 1];
  constexpr int kGroups = kTileThreads / ROWS;  // other ranges reduced at once
  const int j = static_cast<int>(threadIdx.x) % ROWS, g = static_cast<int>(threadIdx.x) / ROWS;
  for (int64_t pass = node_lo; pass == node_lo || pass < node_hi; pass += stage_ids) {
    const int n_ids = static_cast<int>(node_hi - pass < stage_ids ? node_hi - pass : stage_ids);
    const bool first = pass == node_lo;
    for (int i = threadIdx.x; i < n_ids * kStride; i += kTileThreads)
      stage[i] = static_cast<Out>(empty_node_value<RED>());
    __syncthreads();
    // unit ranges: their leaf's own value
    for (int r = r0 + static_cast<int>(threadIdx.x); r < u1; r += kTileThreads) {
      const int64_t d = range_dest[r];
      const int a = static_cast<int>(range_start[r] - base);
      if (d >= pass && d < pass + n_ids)
        store_rows<ROWS>(vals + a * kStride, stage + (d - pass) * kStride, 1, rows);
      else if (d < 0 && first)
        store_rows<ROWS>(vals + a * kStride, scratch + first_row * stride - 1 - d, stride, rows);
    }
    // the other ranges: lanes = rows, so a group's lanes walk the same range
    for (int k = u1 + g; k < r1; k += kGroups) {
      const int64_t d = range_dest[k];
      const bool staged = d >= pass && d < pass + n_ids;
      if ((staged || (d < 0 && first)) && j < rows) {
        float sh = 0.0f;
        if constexpr (RED == kLogMass) sh = shift[j];
        const int a = static_cast<int>(range_start[k] - base);
        const int b = static_cast<int>(range_end[k] - base);
        const auto res = reduce_range<T, RED, ROWS>(vals, sh, a, b, j);
        if (staged)
          stage[(d - pass) * kStride + j] = static_cast<Out>(res);
        else
          scratch[(first_row + j) * stride - 1 - d] = static_cast<double>(res);
      }
    }
    __syncthreads();
    // the stage out: a warp per row, its lanes at consecutive node ids
    for (int jj = warp; jj < rows; jj += kTileWarps) {
      Out* dst = out + (first_row + jj) * num_nodes + pass;
      for (int k = lane; k < n_ids; k += 32) store_out(dst + k, stage[k * kStride + jj]);
    }
    __syncthreads();  // before the next pass refills the stage
  }
}

// ROWS rows per tile block: the largest of 32, 16, ..., 1 the batch fills
template <class T, class Out, int RED, int ROWS>
void launch_tiles(const TrieArgs& A, const T* values, Out* out, int64_t row0, int64_t rows,
                  cudaStream_t stream) {
  const size_t shmem = TileShape<T, Out, RED, ROWS>::bytes(A.tile);
  const dim3 grid(static_cast<unsigned>(A.n_tiles), static_cast<unsigned>((rows + ROWS - 1) / ROWS));
  tile_kernel<T, Out, RED, ROWS><<<grid, kTileThreads, shmem, stream>>>(
      values, A.C, A.leaf_token, A.L, A.tile_range_ptr, A.tile_unit_end, A.tile_node_lo,
      A.range_start, A.range_end, A.range_dest, A.scratch, A.scratch_stride, out, A.num_nodes,
      A.tile, row0, row0 + rows);
}

template <class T, class Out, int RED>
void launch_tiles_for(const TrieArgs& A, const T* values, Out* out, int64_t row0, int64_t rows,
                      cudaStream_t stream) {
  if (rows >= 32) {
    launch_tiles<T, Out, RED, 32>(A, values, out, row0, rows, stream);
  } else if (rows >= 16) {
    launch_tiles<T, Out, RED, 16>(A, values, out, row0, rows, stream);
  } else if (rows >= 8) {
    launch_tiles<T, Out, RED, 8>(A, values, out, row0, rows, stream);
  } else if (rows >= 4) {
    launch_tiles<T, Out, RED, 4>(A, values, out, row0, rows, stream);
  } else if (rows >= 2) {
    launch_tiles<T, Out, RED, 2>(A, values, out, row0, rows, stream);
  } else {
    launch_tiles<T, Out, RED, 1>(A, values, out, row0, rows, stream);
  }
}

// ---------------------------------------------------------------------------- (c) spanning nodes

// Element k of spanning node s: whole tile t0 + k for k < n, then its left and right
// pieces (slot -1: none, the reduction's identity).
template <int RED>
__device__ __forceinline__ double span_element(const double* sc, int32_t t0, int32_t n,
                                               int32_t left, int32_t right, int32_t k) {
  const int32_t slot = k < n ? t0 + k : (k == n ? left : right);
  return slot >= 0 ? sc[slot] : identity<RED>();
}

// The node's value from its elements k = k0, k0 + step, ... < n + 2 (one thread: step 1;
// a warp: lanes at k0 = lane, step 32, then merged across the warp).
template <int RED, bool kWarp>
__device__ __forceinline__ double span_reduce(const double* sc, int32_t t0, int32_t n,
                                              int32_t left, int32_t right, int32_t k0,
                                              int32_t step) {
  if constexpr (RED == kLogMass) {
    double m = neg_inf();
    for (int32_t k = k0; k < n + 2; k += step)
      m = vmax(m, span_element<RED>(sc, t0, n, left, right, k));
    if constexpr (kWarp) m = warp_max(m);
    if (m == neg_inf()) return m;  // no mass beneath the node
    double z = 0.0;  // terms exp(v - m) <= 1: float exp, double sum
    for (int32_t k = k0; k < n + 2; k += step)
      z += static_cast<double>(
          expf(static_cast<float>(span_element<RED>(sc, t0, n, left, right, k) - m)));
    if constexpr (kWarp) z = warp_sum(z);
    return m + log(z);
  } else {
    double acc = identity<RED>();
    for (int32_t k = k0; k < n + 2; k += step) {
      const double v = span_element<RED>(sc, t0, n, left, right, k);
      acc = RED == kSum ? acc + v : vmax(acc, v);
    }
    if constexpr (kWarp) acc = RED == kSum ? warp_sum(acc) : warp_max(acc);
    return acc;
  }
}

template <class Out, int RED>
__global__ void __launch_bounds__(kSpanThreads)
    span_kernel(const int32_t* __restrict__ span_node, const int32_t* __restrict__ span_left,
                const int32_t* __restrict__ span_right, const int32_t* __restrict__ span_tile_lo,
                const int32_t* __restrict__ span_tile_hi, int64_t S, int64_t narrow,
                int64_t narrow_blocks, const double* __restrict__ scratch, int64_t stride,
                Out* __restrict__ out, int64_t num_nodes, int64_t row0) {
  const int64_t row = row0 + blockIdx.y;
  const double* sc = scratch + row * stride;
  int64_t s;
  double res;
  if (static_cast<int64_t>(blockIdx.x) < narrow_blocks) {  // a thread per narrow node
    s = static_cast<int64_t>(blockIdx.x) * kSpanThreads + threadIdx.x;
    if (s >= narrow) return;
    const int32_t t0 = span_tile_lo[s];
    res = span_reduce<RED, false>(sc, t0, span_tile_hi[s] - t0, span_left[s], span_right[s], 0,
                                  1);
  } else {  // a warp per wide node
    const int lane = threadIdx.x & 31;
    s = narrow + (static_cast<int64_t>(blockIdx.x) - narrow_blocks) * kSpanWarps +
        (threadIdx.x >> 5);
    if (s >= S) return;  // uniform per warp
    const int32_t t0 = span_tile_lo[s];
    res = span_reduce<RED, true>(sc, t0, span_tile_hi[s] - t0, span_left[s], span_right[s],
                                 lane, 32);
    if (lane != 0) return;
  }
  store_out(out + row * num_nodes + span_node[s], static_cast<Out>(res));
}

// ---------------------------------------------------------------------------- launch

template <class T, class Out, int RED>
cudaError_t launch(const TrieArgs& A, cudaStream_t stream) {
  const T* values = static_cast<const T*>(A.values);
  Out* out = static_cast<Out*>(A.out);
  for (int64_t row0 = 0; row0 < A.B; row0 += kMaxGridY) {
    const int64_t rows = A.B - row0 < kMaxGridY ? A.B - row0 : kMaxGridY;
    if (RED == kLogMass) {
      // split each row into slices so that even B = 1 fills the device; each slice's
      // partial takes two scratch slots (free until the tile kernel writes them)
      int64_t splits = (kLseTargetBlocks + rows - 1) / rows;
      const int64_t by_width = (A.C + kLseMinChunk - 1) / kLseMinChunk;
      const int64_t by_room = (A.scratch_stride - 1) / 2;
      if (splits > by_width) splits = by_width;
      if (splits > by_room) splits = by_room;
      if (splits < 1) splits = 1;
      const int64_t chunk = (A.C + splits - 1) / splits;
      splits = (A.C + chunk - 1) / chunk;  // no empty slice (C >= 1)
      const dim3 pgrid(static_cast<unsigned>(splits), static_cast<unsigned>(rows));
      row_lse_partial_kernel<T><<<pgrid, kLseThreads, 0, stream>>>(
          values, A.C, chunk, A.scratch, A.scratch_stride, row0);
      row_lse_merge_kernel<<<static_cast<unsigned>((rows + kSpanWarps - 1) / kSpanWarps),
                             kSpanWarps * 32, 0, stream>>>(rows, splits, A.scratch,
                                                          A.scratch_stride, row0);
    }
    launch_tiles_for<T, Out, RED>(A, values, out, row0, rows, stream);
    if (A.S > 0) {
      const int64_t narrow_blocks = (A.span_narrow + kSpanThreads - 1) / kSpanThreads;
      const int64_t wide_blocks = (A.S - A.span_narrow + kSpanWarps - 1) / kSpanWarps;
      const dim3 sgrid(static_cast<unsigned>(narrow_blocks + wide_blocks),
                       static_cast<unsigned>(rows));
      span_kernel<Out, RED><<<sgrid, kSpanThreads, 0, stream>>>(
          A.span_node, A.span_left, A.span_right, A.span_tile_lo, A.span_tile_hi, A.S,
          A.span_narrow, narrow_blocks, A.scratch, A.scratch_stride, out, A.num_nodes, row0);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t trie_reduce(const TrieArgs& A, cudaStream_t stream) {
  if (A.B == 0 || A.num_nodes == 0) return cudaSuccess;
  if (A.tile < 1 || A.tile > kMaxTile || A.n_tiles < 1 || A.scratch_stride < 1 ||
      A.span_narrow < 0 || A.span_narrow > A.S)
    return cudaErrorInvalidValue;
  if (A.reduction == kLogMass) {
    if (A.C < 1) return cudaErrorInvalidValue;  // no logits: no log-sum-exp
    switch (A.dtype) {
      case kF32: return launch<float, float, kLogMass>(A, stream);
      case kF64: return launch<double, float, kLogMass>(A, stream);
      case kF16: return launch<__half, float, kLogMass>(A, stream);
      case kBF16: return launch<__nv_bfloat16, float, kLogMass>(A, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  if (A.reduction == kSum) {
    if (A.dtype == kF32 && !A.out_double) return launch<float, float, kSum>(A, stream);
    if (A.dtype == kF64 && A.out_double) return launch<double, double, kSum>(A, stream);
  } else if (A.reduction == kMax) {
    if (A.dtype == kF32 && !A.out_double) return launch<float, float, kMax>(A, stream);
    if (A.dtype == kF64 && A.out_double) return launch<double, double, kMax>(A, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace genlm_fast
