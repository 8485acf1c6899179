// CUDA trie reduction kernels: the tile decomposition of genlm_fast/ops/layout.py (the
// same decomposition as the Triton backend). No torch headers: plain device pointers, sizes
// and a cudaStream_t (see trie_reduce_cuda.h); compiles standalone with `nvcc -c`.
//
// Layout recap. Leaves are sorted by node id ("leaf order"), so the leaves beneath any node
// are one contiguous range of leaf positions. The leaf order is cut into tiles of `tile`
// positions. A node whose range lies inside one tile is "local"; the others are "spanning"
// and are split into an optional left piece, whole tiles, and an optional right piece. The
// pieces and each tile's total are themselves local ranges that write to a per-row scratch
// buffer (tile totals at slots [0, n_tiles), pieces after them).
//
// Kernels, enqueued in order on one stream, each after the first launched dependent on the
// one before (programmatic dependent launch, sm_90+: it starts while that one ends, and
// waits for it before touching its results; see enqueue):
//  (a) log_mass only: lse = max + log(sum exp(x - max)) of each row over all C columns,
//      stored (double) in the row's last scratch column; NaN for a bad row (a NaN or +inf
//      logit, or none finite), the row check cuda_backend hands the dispatcher.
//      (a1) row_lse_partial: grid (splits, rows), each block reads one slice of a row once,
//      kLseUnroll loads in flight per thread, keeping a (max, sum-exp) pair per thread: per
//      round one max, fast exps summed pairwise in float, the sum in double; it writes the
//      slice's partial (max, sum) to two scratch slots the tile kernel only fills later.
//      (a2) row_lse_merge: one warp per row merges the partials. Splitting rows keeps the
//      device busy even at B = 1.
//  (b) tile: one block per (tile, block of ROWS rows, ROWS = 1..32), 256 threads, in three
//      phases with a barrier between each. The layout has turned the tile's local ranges
//      into *sources* (genlm_fast/ops/layout.py, _tile_sources): a node the tile owns (its
//      last leaf is here: one block of ids, tile_node_lo) takes its value from a leaf
//      position (a one-leaf node: ~80% on real vocabularies), from one of the tile's *runs*
//      (the distinct ranges of two leaves or more: nested, so fewer than `tile`; a chain of
//      single-child nodes shares one) or from nowhere (empty; spanning: (c) writes it).
//      1. gather: the rows' values of the tile's leaves, x[row, leaf_token[pos]], into
//         shared memory, [pos][row] with an odd row stride (lanes at consecutive rows: no
//         bank conflicts), each thread with all its loads in flight. log_mass keeps the
//         log-probability v = x - lse (float; lse as a float pair, exact to rounding) and
//         the tile's largest v per row (the shift), then exp(v - shift) per leaf, once.
//      2. runs: lanes = rows, the thread groups deal the runs round-robin (longest first):
//         sum a double sum, max the max (exact), log_mass shift + log(sum of the exps),
//         exact to float rounding when that sum is >= kFastMinMass (1e-24; see reduce_run);
//         a run under that is redone by its own max.
//      3. out: the node ids the tile owns, a warp per 32 consecutive ids, each lane copying
//         its id's source for every row: whole, coalesced lines of each output row, once.
//         The tile total and pieces (scratch slots for (c)) are copied the same way.
//  (c) span: a spanning node combines its left piece, the totals of its whole tiles and its
//      right piece, all in the row's scratch. Nodes are sorted by tile count and most have
//      a few whole tiles (Llama-3: 5,171 nodes, 5,591 tiles in all): the first
//      `span_narrow` nodes (genlm_fast/ops/layout.py: at most SPAN_NARROW_TILES tiles) get
//      one thread per (node, row), consecutive threads at consecutive nodes; the next ones
//      up to `span_warp` (at most SPAN_WARP_TILES tiles; Llama-3: 31 nodes of 17 to 95)
//      one warp per (node, row), its lanes striding over the tiles; the widest (the root
//      and a few more: 2 on Llama-3, the root's ~2,000 tiles took a warp ~5 us) one block
//      per (node, row). (A block for each of the 33 nodes above 16 tiles made 2,112 blocks
//      of mostly idle threads at B=64, twice the narrow part's.) One launch: narrow blocks
//      first, then blocks of kSpanWarps warp nodes, then the block nodes. Sums in double;
//      log_mass as the max, then a double sum of exp(v - max).
//  Memory: the output is written once and never read here, so it is stored evict-first
//  (__stcs); the logits are loaded with an L2 evict-last hint (load_keep): (a) reads each
//  row once, coalesced, and (b) gathers every column again, each 32-byte sector by ~8
//  different tile blocks, which then find it in L2 instead of behind ~100 MB of output.
// Empty nodes (no leaves; always local): 0 for sum and max, -inf for log_mass. Floats are
// enough where they are used: the design's bound on log-masses is 1e-4 absolute, these
// kernels stay within a few float ulps (times the magnitude, for the fast exp) of the float64
// reference (tests/ops/test_cuda_emulation.py runs this file on the CPU and checks it).
// Templates over the input type (float, double, __half, __nv_bfloat16), the output type
// (float, double), the reduction and the rows per tile block.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "trie_reduce_cuda.h"

namespace genlm_fast {
namespace cuda {
namespace {

constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
// as a launch bound: up to 64 registers a thread (it takes ~56; bounds of 5, 6 or 8 blocks an SM
// were no faster on the H200)
constexpr int kTileBlocksPerSM = 4;
constexpr float kFastMinMass = 1e-24f;
constexpr int kLseThreads = 256;
constexpr int kLseUnroll = 16;      // loads in flight per thread in (a1), a power of two
constexpr int64_t kLseMinChunk = 4096;  // columns per (a1) block, at least
constexpr int64_t kLseTargetBlocks = 1024;  // (a1) blocks per launch to aim for (B * splits)
constexpr int kSpanWarps = 8;        // (a2) and (c): warps per block
constexpr int kSpanThreads = kSpanWarps * 32;  // (c)'s blocks: a thread per narrow node
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridY = 65535;
constexpr long long kNaNBits = 0x7ff8000000000000LL;  // a quiet NaN (double)

__device__ __forceinline__ double neg_inf() { return -__longlong_as_double(0x7ff0000000000000LL); }

// logits as the arithmetic type of (a1): float, or double for double logits
__device__ __forceinline__ float to_arith(float v) { return v; }
__device__ __forceinline__ double to_arith(double v) { return v; }
__device__ __forceinline__ float to_arith(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_arith(__nv_bfloat16 v) { return __bfloat162float(v); }

// A load with an L2 evict-last hint (sm_80+; elsewhere, and in the CPU emulation of
// tests/ops/test_cuda_emulation.py, a plain load). Read-only data: ld.global.nc. The policy
// is made once per thread (keep_policy) and passed to each load.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ uint64_t keep_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
#define GF_KEEP_LOAD(PTX_TYPE, CONSTRAINT, BITS_T, FROM_BITS, T)                             \
  __device__ __forceinline__ T load_keep(const T* p, uint64_t policy) {                    \
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
__device__ __forceinline__ uint64_t keep_policy() { return 0; }
template <class T>
__device__ __forceinline__ T load_keep(const T* p, uint64_t) { return *p; }
#endif

// exp of a value <= 0 and log of a positive sum where a few float ulps (times the
// argument's magnitude, for exp) are far within the design's 1e-4 on log-masses: CUDA's fast
// intrinsics, ex2/lg2.approx (in the CPU emulation of tests/ops/test_cuda_emulation.py,
// libm's expf/logf)
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
__device__ __forceinline__ float fast_log(float x) { return __logf(x); }
#else
__device__ __forceinline__ float fast_exp(float x) { return expf(x); }
__device__ __forceinline__ float fast_log(float x) { return logf(x); }
#endif

// Programmatic dependent launch (sm_90+; enqueue below). A kernel launched
// dependent may start while the kernel before it on the stream is still running: it must
// call wait_for_previous_kernel() before it reads what that kernel writes or writes what
// that kernel reads (everything before that kernel is complete already). A kernel calls
// allow_next_kernel() to let its dependent start early (its blocks then take SMs the
// ending kernel's last wave leaves idle). Elsewhere, and in the CPU emulation, no-ops: the
// launch is then an ordinary one.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void allow_next_kernel() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
}
#else
__device__ __forceinline__ void wait_for_previous_kernel() {}
__device__ __forceinline__ void allow_next_kernel() {}
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

// (a1) grid (splits, rows): each block reads one contiguous slice of a row ONCE and writes
// the slice's partial (m, s), m its largest logit and s the sum of exp(x - m), to scratch
// slots [2 * split, 2 * split + 1] of its row. Those slots are free until the tile kernel,
// which runs after (a2), writes its totals there. A thread takes its columns kLseUnroll at a
// time, all loads in flight at once (the slice end predicated, not a serial tail); per round
// one max, at most one rescale of its double sum, and kLseUnroll fast exps (terms <= 1)
// summed pairwise in float: a few float ulps, against a double sum of every term. A NaN or
// +inf logit marks the row bad: the partial's sum is NaN, whatever the rest (masks of -inf
// around a NaN would otherwise leave the sum at 0 and the NaN unseen).
template <class T>
__global__ void __launch_bounds__(kLseThreads)
    row_lse_partial_kernel(const T* __restrict__ values, int64_t C, int64_t chunk,
                           double* __restrict__ scratch, int64_t stride, int64_t row0) {
  using A = decltype(to_arith(T()));
  __shared__ double red_m[kLseThreads / 32];
  __shared__ double red_s[kLseThreads / 32];
  allow_next_kernel();
  const int64_t row = row0 + blockIdx.y;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t hi = lo + chunk < C ? lo + chunk : C;
  const T* x = values + row * C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const A no_mass = static_cast<A>(neg_inf()), pos_inf = -no_mass;

  A m = no_mass;  // the largest logit so far (exact)
  double s = 0.0;  // sum of exp(x - m)
  bool bad = false;  // a NaN or +inf seen
  const uint64_t policy = keep_policy();
  for (int64_t c0 = lo + threadIdx.x; c0 < hi; c0 += kLseUnroll * kLseThreads) {
    A v[kLseUnroll];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) {
      const int64_t c = c0 + u * kLseThreads;
      v[u] = c < hi ? to_arith(load_keep(x + c, policy)) : no_mass;
    }
    A top = no_mass;
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) {
      bad |= !(v[u] < pos_inf);  // NaN compares false
      top = vmax(top, v[u]);
    }
    if (top == no_mass) continue;  // nothing but -inf (or NaN: flagged)
    if (top > m) {  // m = -inf: s is 0 and stays 0
      s *= static_cast<double>(expf(static_cast<float>(m - top)));
      m = top;
    }
    float term[kLseUnroll];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) term[u] = fast_exp(static_cast<float>(v[u] - m));
#pragma unroll
    for (int w = kLseUnroll / 2; w > 0; w >>= 1) {
#pragma unroll
      for (int u = 0; u < w; ++u) term[u] += term[u + w];
    }
    s += static_cast<double>(term[0]);
  }

  // block merge: every thread rescales its sum to the block max, then sums
  const double md = static_cast<double>(m);
  const double bm_w = warp_max(md);
  const double bad_w = warp_max(bad ? 1.0 : 0.0);
  if (lane == 0) red_m[warp] = bad_w > 0.0 ? __longlong_as_double(kNaNBits) : bm_w;
  __syncthreads();
  double bm = neg_inf();
  bool block_bad = false;
#pragma unroll
  for (int w = 0; w < kLseThreads / 32; ++w) {
    block_bad |= red_m[w] != red_m[w];
    bm = vmax(bm, red_m[w]);
  }
  const double sc = warp_sum(md == neg_inf() ? 0.0 : s * exp(md - bm));
  if (lane == 0) red_s[warp] = sc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
#pragma unroll
    for (int w = 0; w < kLseThreads / 32; ++w) tot += red_s[w];
    double* out = scratch + row * stride + 2 * static_cast<int64_t>(blockIdx.x);
    out[0] = bm;
    out[1] = block_bad ? __longlong_as_double(kNaNBits) : tot;
  }
}

// (a2) one warp per row merges the row's `splits` partials into lse = max + log(sum),
// stored in the row's last scratch column: NaN for a bad row, one with a NaN or +inf logit
// or no finite logit at all, and only then (cuda_backend reads this column as the row
// check). Launched dependent on (a1) (enqueue).
__global__ void __launch_bounds__(kSpanWarps * 32)
    row_lse_merge_kernel(int64_t rows, int64_t splits, double* __restrict__ scratch,
                         int64_t stride, int64_t row0) {
  allow_next_kernel();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSpanWarps + (threadIdx.x >> 5);
  if (r >= rows) return;  // uniform per warp
  wait_for_previous_kernel();
  double* sc = scratch + (row0 + r) * stride;
  double m = neg_inf(), z = 0.0;
  bool bad = false;
  for (int64_t k = lane; k < splits; k += 32) {
    bad |= sc[2 * k + 1] != sc[2 * k + 1];  // (a1) saw a NaN or +inf
    lse_merge(m, z, sc[2 * k], sc[2 * k + 1]);
  }
  warp_lse_merge(m, z);
  bad = warp_max(bad ? 1.0 : 0.0) > 0.0;
  if (lane == 0) sc[stride - 1] = bad || m == neg_inf() ? __longlong_as_double(kNaNBits)
                                                        : m + log(z);
}

// ---------------------------------------------------------------------------- (b) tiles

// What the tile kernel keeps per (position, row), and what it writes: log_mass the
// log-probability (float), sum and max the input itself (sums accumulate in double). The
// dispatch makes the output type the same (float, or double for double sum/max).
template <class T, int RED>
using TileValue = std::conditional_t<RED == kLogMass, float, T>;

// A node with no leaves: 0 under sum and max, -inf under log_mass.
template <int RED>
__device__ __forceinline__ double empty_node_value() {
  return RED == kLogMass ? neg_inf() : 0.0;
}

// Dynamic shared memory of a tile block: `val` [2 * tile][ROWS + 1] of V (rows [0, tile):
// the leaf values, [tile, 2 * tile - 1): the runs' results, row 2 * tile - 1: the empty-node
// value), then for log_mass `lin` [tile][ROWS + 1] floats, exp(v - shift).
template <class V, int RED, int ROWS>
__host__ __device__ constexpr size_t tile_shared_bytes(int tile) {
  return static_cast<size_t>(ROWS + 1) * tile *
         (2 * sizeof(V) + (RED == kLogMass ? sizeof(float) : 0));
}

// A run, positions [a, b) of the tile, for row j: sum (double), max, or log_mass: with the
// tile's largest log-probability as the shift, shift + log(sum of exp(v - shift)). That is
// exact to float rounding when the sum is >= kFastMinMass (1e-24): a term exp() flushed or
// made subnormal is < 2^-126, 64 of them < 1e-36, i.e. < 1e-12 of the run's mass. A run
// below that (every leaf over ~55 nats under the tile's max, or all -inf: masks of -1e30)
// is redone by its own max: exact whatever the spread; -inf only where every leaf is -inf.
template <class V, int RED, int ROWS>
__device__ __forceinline__ V reduce_run(const V* val, const float* lin, float shift, int a,
                                        int b, int j) {
  constexpr int kStride = ROWS + 1;
  if constexpr (RED == kSum) {
    double acc = 0.0;
    for (int p = a; p < b; ++p) acc += static_cast<double>(val[p * kStride + j]);
    return static_cast<V>(acc);
  } else if constexpr (RED == kMax) {
    V m = val[a * kStride + j];  // runs are never empty
    for (int p = a + 1; p < b; ++p) m = vmax(m, val[p * kStride + j]);
    return m;
  } else {
    float sum = 0.0f;  // at most 64 terms <= 1
    for (int p = a; p < b; ++p) sum += lin[p * kStride + j];
    if (sum >= kFastMinMass) return shift + fast_log(sum);
    float m = static_cast<float>(neg_inf());
    for (int p = a; p < b; ++p) m = vmax(m, val[p * kStride + j]);
    if (m == static_cast<float>(neg_inf())) return m;
    float z = 0.0f;
    for (int p = a; p < b; ++p) z += fast_exp(val[p * kStride + j] - m);
    return m + fast_log(z);
  }
}

// One value to the output, which nothing here reads again: evict-first (see the header).
template <class Out>
__device__ __forceinline__ void store_out(Out* p, Out v) { __stcs(p, v); }

template <class T, int RED, int ROWS>
__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSM)
    tile_kernel(const T* __restrict__ values, int64_t C, const int32_t* __restrict__ leaf_token,
                int64_t L, const int32_t* __restrict__ tile_run_ptr,
                const int32_t* __restrict__ run_bounds, const int32_t* __restrict__ tile_node_lo,
                const int32_t* __restrict__ node_src,
                const int32_t* __restrict__ tile_scratch_ptr,
                const int32_t* __restrict__ scratch_src, const int32_t* __restrict__ scratch_slot,
                double* __restrict__ scratch, int64_t stride,
                TileValue<T, RED>* __restrict__ out, int64_t num_nodes, int tile, int64_t row0,
                int64_t row_end) {
  using V = TileValue<T, RED>;
  constexpr int kStride = ROWS + 1;  // odd: lanes at consecutive rows hit different banks
  constexpr int kGroups = kTileThreads / ROWS;  // thread groups; a group's lanes = rows
  constexpr int kPerThread = (kMaxTile + kGroups - 1) / kGroups;  // gathered values each
  extern __shared__ double smem[];
  V* val = reinterpret_cast<V*>(smem);  // [2 * tile][kStride]
  float* lin = reinterpret_cast<float*>(val + 2 * tile * kStride);  // log_mass: [tile][kStride]
  __shared__ int32_t token[kMaxTile];
  __shared__ int32_t bounds[kMaxTile];  // the tile's runs (fewer than tile)
  __shared__ float lse_hi[ROWS], lse_lo[ROWS];  // log_mass: each row's lse as hi + lo
  __shared__ float part_max[kTileWarps][ROWS];  // log_mass: the warps' largest v per row
  const int t = blockIdx.x;
  const int64_t first_row = row0 + static_cast<int64_t>(blockIdx.y) * ROWS;
  const int rows = row_end - first_row < ROWS ? static_cast<int>(row_end - first_row) : ROWS;
  const int64_t base = static_cast<int64_t>(t) * tile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = static_cast<int>(threadIdx.x) % ROWS, g = static_cast<int>(threadIdx.x) / ROWS;
  allow_next_kernel();
  const int run0 = tile_run_ptr[t], n_runs = tile_run_ptr[t + 1] - run0;

  for (int p = threadIdx.x; p < tile; p += kTileThreads)
    token[p] = base + p < L ? leaf_token[base + p] : -1;
  for (int r = threadIdx.x; r < n_runs; r += kTileThreads) bounds[r] = run_bounds[run0 + r];
  if (threadIdx.x < kStride)
    val[(2 * tile - 1) * kStride + threadIdx.x] = static_cast<V>(empty_node_value<RED>());
  __syncthreads();

  // gather: thread (g, j) takes row j at positions g, g + kGroups, ...: all its loads in
  // flight at once, unconditionally (each is a 32-byte sector of its own: the columns are
  // scattered); a position past the tile's last leaf, or a row past the batch's, reads
  // column 0 of row first_row and is dropped. The values predate the lse kernels, so the
  // loads go out before the wait for them (log_mass: this kernel is launched dependent).
  const T* row_values = values + (first_row + (j < rows ? j : 0)) * C;
  const uint64_t policy = keep_policy();
  T x[kPerThread];
  bool valid[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int p = g + u * kGroups;
    const int32_t column = p < tile ? token[p] : -1;
    valid[u] = j < rows && column >= 0;
    x[u] = load_keep(row_values + (column >= 0 ? column : 0), policy);
  }
  wait_for_previous_kernel();  // from here on: the rows' lse read, scratch written
  if constexpr (RED == kLogMass) {
    if (threadIdx.x < ROWS) {
      const double lse = static_cast<int>(threadIdx.x) < rows
                             ? scratch[(first_row + threadIdx.x) * stride + stride - 1] : 0.0;
      const float hi = static_cast<float>(lse);
      lse_hi[threadIdx.x] = hi;
      lse_lo[threadIdx.x] = static_cast<float>(lse - static_cast<double>(hi));
    }
    __syncthreads();
  }
  V v[kPerThread];
  float m = static_cast<float>(neg_inf());  // log_mass: the largest v this thread saw
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int p = g + u * kGroups;
    v[u] = static_cast<V>(neg_inf());  // past the last leaf or row: never read
    if (valid[u]) {
      if constexpr (RED == kLogMass) {
        if constexpr (std::is_same_v<T, double>)
          v[u] = static_cast<float>(x[u] - (static_cast<double>(lse_hi[j]) + lse_lo[j]));
        else
          v[u] = (to_arith(x[u]) - lse_hi[j]) - lse_lo[j];  // -inf stays -inf
        m = vmax(m, v[u]);
      } else {
        v[u] = x[u];
      }
    }
    if (p < tile) val[p * kStride + j] = v[u];
  }
  float shift = 0.0f;
  if constexpr (RED == kLogMass) {
    // the tile's largest log-probability per row: over the warp's lanes of row j, then the
    // warps; rows with no finite value shift by 0
    for (int off = 16; off >= ROWS; off >>= 1) m = vmax(m, __shfl_xor_sync(kFullMask, m, off));
    if (lane < ROWS) part_max[warp][lane] = m;
    __syncthreads();
    shift = static_cast<float>(neg_inf());
#pragma unroll
    for (int w = 0; w < kTileWarps; ++w) shift = vmax(shift, part_max[w][j]);
    if (shift == static_cast<float>(neg_inf())) shift = 0.0f;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int p = g + u * kGroups;
      if (p < tile) lin[p * kStride + j] = fast_exp(v[u] - shift);  // -inf gives 0
    }
  }
  __syncthreads();

  // runs, longest first, dealt round-robin to the groups
  if (j < rows) {
    for (int r = g; r < n_runs; r += kGroups) {
      const int a = bounds[r] & 0xffff, b = bounds[r] >> 16;
      val[(tile + r) * kStride + j] = reduce_run<V, RED, ROWS>(val, lin, shift, a, b, j);
    }
  }
  __syncthreads();

  // the tile's total and pieces to scratch (double)
  const int q0 = tile_scratch_ptr[t], n_q = tile_scratch_ptr[t + 1] - q0;
  for (int i = threadIdx.x; i < n_q * ROWS; i += kTileThreads) {
    const int q = i / ROWS, jj = i % ROWS;
    if (jj < rows)
      scratch[(first_row + jj) * stride + scratch_slot[q0 + q]] =
          static_cast<double>(val[scratch_src[q0 + q] * kStride + jj]);
  }
  // the node ids the tile owns, each row's block whole: a warp per 32 consecutive ids, its
  // lanes at consecutive ids (coalesced lines), looping over the rows
  const int64_t node_lo = tile_node_lo[t];
  const int n_ids = tile_node_lo[t + 1] - static_cast<int>(node_lo);
  for (int k = warp * 32 + lane; k - lane < n_ids; k += kTileThreads) {
    if (k >= n_ids) continue;
    const V* src = val + node_src[node_lo + k] * kStride;
    V* dst = out + first_row * num_nodes + node_lo + k;
    if (rows == ROWS) {
#pragma unroll
      for (int jj = 0; jj < ROWS; ++jj) store_out(dst + jj * num_nodes, src[jj]);
    } else {
      for (int jj = 0; jj < rows; ++jj) store_out(dst + jj * num_nodes, src[jj]);
    }
  }
}

// Kernels (a2), (c), and (b) after (a2), follow one of ours on the stream and are launched
// dependent on it (programmatic dependent launch, sm_90+): they start while it ends, load
// their index arrays, and wait for it (wait_for_previous_kernel) before touching its
// results. The first kernel of a call, (a1) or (b), is an ordinary launch: it runs after
// whatever came before it. Dependent launches need the waits compiled in (ptxVersion >= 90; below
// that wait_for_previous_kernel is empty) and are off with GENLM_FAST_CUDA_PDL=0, read at
// each call (bench/gpu.py times both ways).
#ifdef __CUDACC__
bool dependent_launches_on() {
  const char* env = std::getenv("GENLM_FAST_CUDA_PDL");
  if (env != nullptr && env[0] == '0') return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<signed char> compiled_for[kMaxDevices];  // 0 unknown, 1 sm_90+, -1 not
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  signed char state = compiled_for[device].load(std::memory_order_relaxed);
  if (state == 0) {
    cudaFuncAttributes attributes;
    state = cudaFuncGetAttributes(&attributes, row_lse_merge_kernel) == cudaSuccess &&
                    attributes.ptxVersion >= 90
                ? 1 : -1;
    compiled_for[device].store(state, std::memory_order_relaxed);
  }
  return state > 0;
}
#else
bool dependent_launches_on() { return false; }  // the CPU emulation runs kernels in order
#endif

template <class... Params, class... Args>
cudaError_t enqueue(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shmem,
                    cudaStream_t stream, bool dependent, Args... args) {
  if (!dependent || !dependent_launches_on()) {
    kernel<<<grid, block, shmem, stream>>>(args...);
    return cudaGetLastError();
  }
#ifdef __CUDACC__
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shmem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
#else
  return cudaErrorNotSupported;
#endif
}

template <class T, int RED, int ROWS>
cudaError_t launch_tiles(const TrieArgs& A, const T* values, TileValue<T, RED>* out,
                         int64_t row0, int64_t rows, cudaStream_t stream) {
  const size_t shmem = tile_shared_bytes<TileValue<T, RED>, RED, ROWS>(A.tile);
  const dim3 grid(static_cast<unsigned>(A.n_tiles), static_cast<unsigned>((rows + ROWS - 1) / ROWS));
  return enqueue(tile_kernel<T, RED, ROWS>, grid, kTileThreads, shmem, stream,
                 /*dependent=*/RED == kLogMass, values, A.C, A.leaf_token, A.L, A.tile_run_ptr,
                 A.run_bounds, A.tile_node_lo, A.node_src, A.tile_scratch_ptr, A.scratch_src,
                 A.scratch_slot, A.scratch, A.scratch_stride, out, A.num_nodes, A.tile, row0,
                 row0 + rows);
}

// ROWS rows per tile block: the largest of 32, 16, ..., 1 the batch fills
template <class T, int RED>
cudaError_t launch_tiles_for(const TrieArgs& A, const T* values, TileValue<T, RED>* out,
                             int64_t row0, int64_t rows, cudaStream_t stream) {
  if (rows >= 32) {
    return launch_tiles<T, RED, 32>(A, values, out, row0, rows, stream);
  } else if (rows >= 16) {
    return launch_tiles<T, RED, 16>(A, values, out, row0, rows, stream);
  } else if (rows >= 8) {
    return launch_tiles<T, RED, 8>(A, values, out, row0, rows, stream);
  } else if (rows >= 4) {
    return launch_tiles<T, RED, 4>(A, values, out, row0, rows, stream);
  } else if (rows >= 2) {
    return launch_tiles<T, RED, 2>(A, values, out, row0, rows, stream);
  } else {
    return launch_tiles<T, RED, 1>(A, values, out, row0, rows, stream);
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

// Who reduces one spanning node: a thread (narrow nodes), a warp (wider ones, at most
// SPAN_WARP_TILES + 2 elements: ~8 loads a lane) or a block (the widest: the root's ~2,000
// tiles, ~8 loads a thread). Each member takes elements rank(), rank() + kSize, ...; sum
// and max combine the members' values, every member getting the result.
struct ThreadGroup {
  static constexpr int kSize = 1;
  __device__ static int rank() { return 0; }
  __device__ static double sum(double v) { return v; }
  __device__ static double max(double v) { return v; }
};
struct WarpGroup {
  static constexpr int kSize = 32;
  __device__ static int rank() { return threadIdx.x & 31; }
  __device__ static double sum(double v) { return warp_sum(v); }
  __device__ static double max(double v) { return warp_max(v); }
};
struct BlockGroup {
  static constexpr int kSize = kSpanThreads;
  __device__ static int rank() { return threadIdx.x; }
  // warps, then the warps' results in order; the leading barrier lets a second combine
  // reuse `part` once every thread has read the first's
  template <bool kSum>
  __device__ static double combine(double v) {
    __shared__ double part[kSpanWarps];
    v = kSum ? warp_sum(v) : warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
#pragma unroll
    for (int w = 1; w < kSpanWarps; ++w) v = kSum ? v + part[w] : vmax(v, part[w]);
    return v;
  }
  __device__ static double sum(double v) { return combine<true>(v); }
  __device__ static double max(double v) { return combine<false>(v); }
};

// A spanning node's value, by one Group: sum or max of its elements; log_mass their max,
// then the double sum of exp(v - max) (float exp). Every member returns the value.
template <int RED, class Group>
__device__ __forceinline__ double span_reduce(const double* sc, int32_t t0, int32_t n,
                                              int32_t left, int32_t right) {
  double acc = identity<RED>();  // log_mass: the max
  for (int32_t k = Group::rank(); k < n + 2; k += Group::kSize) {
    const double v = span_element<RED>(sc, t0, n, left, right, k);
    acc = RED == kSum ? acc + v : vmax(acc, v);
  }
  acc = RED == kSum ? Group::sum(acc) : Group::max(acc);
  if constexpr (RED != kLogMass) {
    return acc;
  } else {
    if (acc == neg_inf()) return acc;  // no mass beneath the node (the whole group agrees)
    double z = 0.0;  // terms <= 1
    for (int32_t k = Group::rank(); k < n + 2; k += Group::kSize)
      z += fast_exp(static_cast<float>(span_element<RED>(sc, t0, n, left, right, k) - acc));
    return acc + static_cast<double>(fast_log(static_cast<float>(Group::sum(z))));  // z >= 1
  }
}

template <class Out, int RED>
__global__ void __launch_bounds__(kSpanThreads)
    span_kernel(const int32_t* __restrict__ span_node, const int32_t* __restrict__ span_left,
                const int32_t* __restrict__ span_right, const int32_t* __restrict__ span_tile_lo,
                const int32_t* __restrict__ span_tile_hi, int64_t S, int64_t narrow,
                int64_t narrow_blocks, int64_t warp_end, int64_t warp_blocks,
                const double* __restrict__ scratch, int64_t stride, Out* __restrict__ out,
                int64_t num_nodes, int64_t row0) {
  const int64_t row = row0 + blockIdx.y;
  const double* sc = scratch + row * stride;
  const int64_t bx = blockIdx.x;
  // the node: a thread per narrow one, a warp per wider one, a block per widest one
  const int kind = bx < narrow_blocks ? 0 : bx < narrow_blocks + warp_blocks ? 1 : 2;
  const int64_t s =
      kind == 0 ? bx * kSpanThreads + threadIdx.x
      : kind == 1 ? narrow + (bx - narrow_blocks) * kSpanWarps + (threadIdx.x >> 5)
                  : warp_end + bx - narrow_blocks - warp_blocks;
  if ((kind == 0 && s >= narrow) || (kind == 1 && s >= warp_end)) return;  // whole warps in 1
  const int32_t t0 = span_tile_lo[s], n = span_tile_hi[s] - t0;
  const int32_t left = span_left[s], right = span_right[s], node = span_node[s];
  // launched dependent on the tile kernel: its scratch values read, and its write of this
  // node's id (the empty value) overwritten, only once it is done
  wait_for_previous_kernel();
  Out* dst = out + row * num_nodes + node;
  if (kind == 0) {
    store_out(dst, static_cast<Out>(span_reduce<RED, ThreadGroup>(sc, t0, n, left, right)));
  } else if (kind == 1) {
    const double res = span_reduce<RED, WarpGroup>(sc, t0, n, left, right);
    if ((threadIdx.x & 31) == 0) store_out(dst, static_cast<Out>(res));
  } else {
    const double res = span_reduce<RED, BlockGroup>(sc, t0, n, left, right);
    if (threadIdx.x == 0) store_out(dst, static_cast<Out>(res));
  }
}

// ---------------------------------------------------------------------------- launch

template <class T, class Out, int RED>
cudaError_t launch(const TrieArgs& A, cudaStream_t stream) {
  static_assert(std::is_same_v<Out, TileValue<T, RED>>, "the tile kernel writes its values");
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
      if (const cudaError_t err =
              enqueue(row_lse_partial_kernel<T>, pgrid, kLseThreads, 0, stream, false, values,
                      A.C, chunk, A.scratch, A.scratch_stride, row0);
          err != cudaSuccess)
        return err;
      if (const cudaError_t err =
              enqueue(row_lse_merge_kernel,
                      static_cast<unsigned>((rows + kSpanWarps - 1) / kSpanWarps),
                      kSpanWarps * 32, 0, stream, true, rows, splits, A.scratch,
                      A.scratch_stride, row0);
          err != cudaSuccess)
        return err;
    }
    if (const cudaError_t err = launch_tiles_for<T, RED>(A, values, out, row0, rows, stream);
        err != cudaSuccess)
      return err;
    if (A.S > 0) {
      const int64_t narrow_blocks = (A.span_narrow + kSpanThreads - 1) / kSpanThreads;
      const int64_t warp_blocks = (A.span_warp - A.span_narrow + kSpanWarps - 1) / kSpanWarps;
      const int64_t block_nodes = A.S - A.span_warp;
      const dim3 sgrid(static_cast<unsigned>(narrow_blocks + warp_blocks + block_nodes),
                       static_cast<unsigned>(rows));
      if (const cudaError_t err =
              enqueue(span_kernel<Out, RED>, sgrid, kSpanThreads, 0, stream, true, A.span_node,
                      A.span_left, A.span_right, A.span_tile_lo, A.span_tile_hi, A.S,
                      A.span_narrow, narrow_blocks, A.span_warp, warp_blocks, A.scratch,
                      A.scratch_stride, out, A.num_nodes, row0);
          err != cudaSuccess)
        return err;
    }
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t trie_reduce(const TrieArgs& A, cudaStream_t stream) {
  if (A.B == 0 || A.num_nodes == 0) return cudaSuccess;
  if (A.tile < 1 || A.tile > kMaxTile || A.n_tiles < 1 || A.scratch_stride < 1 ||
      A.span_narrow < 0 || A.span_narrow > A.span_warp || A.span_warp > A.S)
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
