// CUDA trie reduction kernels: the tile decomposition of genlm_fast/ops/layout.py (the
// same decomposition as the Triton backend). No torch headers: plain device pointers, sizes
// and a cudaStream_t (see trie_reduce_cuda.h); compiles standalone with `nvcc -c`.
//
// One file past 500 lines: the passes are one launch sequence (enqueue) over shared device
// helpers, built without relocatable device code, and the tests compile this one source with
// nvcc and run it on the CPU (tests/ops/test_cuda_emulation.py).
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
//  (a) the row pass, the row check and the row lse.
//      (a1) row_pass: grid (splits, blocks of R rows), one wave of blocks, each reading one
//      slice of its rows once, in rounds of kLseUnroll loads in flight per thread, a round's
//      loads issued before the round before is staged. It does the row check and one or
//      both of:
//      - lse (log_mass): a (max, sum-exp) pair per thread: per round one max, fast exps
//        summed pairwise in float, the sum in double; the slice's partial (max, sum) of
//        each row goes to two scratch slots the tile kernel only fills later. A NaN or +inf
//        logit makes the partial's sum NaN, and (a2) the row's lse: log_mass's row check.
//      - staging (B >= kStageMinRows, R = the tile kernel's ROWS): the values again, to a
//        workspace where a block's rows sit side by side and the columns in leaf order
//        (column_leaf), so that the tile kernel's gather reads one contiguous stretch per
//        tile, not one 32-byte sector per (row, leaf).
//      The row check of sum and max: a thread that reads a NaN writes NaN to the row's last
//      scratch column, which launch() zeroes first; unstaged, (a1) runs for that check
//      alone. The dispatcher then reads the rows' verdict from there, with no pass of its
//      own over the values.
//      (a2) row_lse_merge (log_mass): one warp per row merges the partials into the row's
//      max m and log(sum exp(x - m)) over all C columns, stored (double) in the row's last
//      two scratch columns, the pair, never their sum: lse = m + log(sum) in double would
//      round the log away at |m| ~ 1e12 and beyond. The last is NaN for a bad row (a NaN or
//      +inf logit, or none finite): the row check cuda_backend hands the dispatcher.
//      Splitting rows keeps the device busy at B = 1.
//  (b) tile: one block per (tile, block of ROWS rows, ROWS = 1..32), 256 threads, in three
//      phases with a barrier between each. The layout has turned the tile's local ranges
//      into *sources* (genlm_fast/ops/layout.py, _tile_sources): a node the tile owns (its
//      last leaf is here: one block of ids, tile_node_lo) takes its value from a leaf
//      position (a one-leaf node: ~80% on real vocabularies), from the whole tile (its
//      total), from one of the tile's *runs* (the other distinct ranges of two leaves or
//      more: nested, so at most tile - 2; a chain of single-child nodes shares one) or from
//      nowhere (empty; spanning: (c) writes it after).
//      0. the tile's slices of the index arrays (its runs, its leaves' columns, its node
//         ids' sources, its scratch values) are loaded first, all in one round trip, into
//         shared memory: no later phase waits on a global load of its own.
//      1. gather: the rows' values of the tile's leaves, x[row, leaf_token[pos]] (staged
//         by (a1), in leaf order, or from the input rows), into shared memory, [pos][row]
//         with an odd row stride (lanes at consecutive rows: no bank conflicts), each
//         thread with all its loads in flight. log_mass keeps the log-probability
//         v = x - lse (float; lse as a float pair, exact to rounding) and the tile's
//         largest v per row (the shift), then exp(v - shift) per leaf, once. Each thread
//         also reduces the values it holds: the tile's total is those partials combined
//         (over the lanes, then the warps), not a 64-leaf run for one thread group.
//      2. runs: lanes = rows, the thread groups deal the runs round-robin (longest first):
//         sum a double sum, max the max (exact), log_mass shift + log(sum of the exps),
//         exact to float rounding when that sum is >= kFastMinMass (1e-24; see reduce_run);
//         a run under that is redone by its own max. (The tile's total is always exact:
//         its sum of exps holds exp(shift - shift) = 1.)
//      3. out: the tile total and pieces to the row's scratch (double), for (c); then the
//         node ids the tile owns, a warp per 32 consecutive ids, each lane copying its id's
//         source for every row: coalesced, 128 bytes a store over two lines of the output
//         row, once.
//  (c) span: a spanning node combines its left piece, the totals of its whole tiles and its
//      right piece, all in the row's scratch. Nodes are sorted by tile count and most have
//      a few whole tiles (Llama-3: 5,138 of 5,171 have at most SPAN_NARROW_TILES = 16, ~1.3
//      tiles each): those, the first `span_narrow`, get one thread per (node, row),
//      consecutive threads at consecutive nodes; the wider ones up to `span_warp` (at most
//      SPAN_WARP_TILES tiles, Llama-3: 31 nodes of 17 to 95) one warp per (node, row), its
//      lanes striding over the tiles; the widest (the root and a few more: 2 on Llama-3, the
//      root's ~2,000 tiles too many for one warp) one block per (node, row). One launch: blocks
//      of a thread per narrow node, then blocks of kSpanWarps warp nodes, then the block
//      nodes. Each thread issues its elements' loads a chunk at a time (one round trip for
//      ~95% of the narrow nodes, the warp nodes and the root). Sums in double; log_mass as
//      (max, double sum of exp(v - max)) pairs, merged.
//  Memory: the output is written once and never read here, so it is stored evict-first
//  (__stcs). Unstaged, the logits are loaded with an L2 evict-last hint (load_hinted): (a)
//  reads each row once, coalesced, and (b) gathers every column again, each 32-byte sector
//  by ~8 different tile blocks, which then find it in L2 instead of behind ~100 MB of
//  output. Staged, (a1) reads them evict-first, and (b) reads each staged value exactly
//  once (load_once: from L2, not cached in L1).
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
#include <cstring>
#include <type_traits>

#include "trie_reduce_cuda.h"

namespace genlm_fast {
namespace cuda {
namespace {

constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
// as a launch bound: up to 64 registers a thread (it takes ~56; bounds of 5, 6 or 8 blocks an SM
// gained nothing)
constexpr int kTileBlocksPerSM = 4;
// node ids a tile block keeps the sources of in shared memory (Llama-3: 201 a tile on
// average, 462 at most), a multiple of kTileThreads
constexpr int kSharedIds = 2 * kTileThreads;
constexpr float kFastMinMass = 1e-24f;
constexpr int kRowPassThreads = 256;
constexpr int kLseUnroll = 16;      // loads in flight per thread in (a1), a power of two
constexpr int64_t kRowPassMinValues = 4096;  // values per (a1) block, at least
// (a1) blocks per launch where the device cannot say how many it holds at once, and in
// the CPU emulation (whose tests set it)
constexpr int64_t kRowPassTargetBlocks = 1024;
constexpr int kSpanWarps = 8;        // (a2) and (c): warps per block
constexpr int kMergeChunk = 8;       // (a2): partials a lane loads at once
constexpr int kSpanThreads = kSpanWarps * 32;  // (c)'s blocks
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridY = 65535;
constexpr long long kNaNBits = 0x7ff8000000000000LL;  // a quiet NaN (double)

__device__ __forceinline__ double neg_inf() { return -__longlong_as_double(0x7ff0000000000000LL); }

// logits as the arithmetic type of (a1): float, or double for double logits
__device__ __forceinline__ float to_arith(float v) { return v; }
__device__ __forceinline__ double to_arith(double v) { return v; }
__device__ __forceinline__ float to_arith(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_arith(__nv_bfloat16 v) { return __bfloat162float(v); }

// Loads with a cache hint (in the CPU emulation of tests/ops/test_cuda_emulation.py, plain
// loads):
//  - load_hinted (sm_80+, elsewhere a plain load): the input values, which predate the call
//    (read-only: ld.global.nc), with an L2 policy made once per thread: keep_policy
//    (evict-last: read again by the tile kernel's gather) or stream_policy (evict-first:
//    read once, by the staging row pass);
//  - load_once: the staged values, written by the kernel before (coherent: ld.global) and
//    read exactly once (.cg: from L2, never allocated in L1, so no L1 line can predate
//    their writing).
// M(PTX type, register constraint, bits type, bits to value, value type) for each value type
#define GF_LOAD_TYPES(M)                                         \
  M("b32", "=r", unsigned int, __uint_as_float, float)           \
  M("b64", "=l", long long, __longlong_as_double, double)        \
  M("b16", "=h", unsigned short, __ushort_as_half, __half)       \
  M("b16", "=h", unsigned short, __ushort_as_bfloat16, __nv_bfloat16)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ uint64_t keep_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t stream_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
#define GF_LOAD_HINTED(PTX_TYPE, CONSTRAINT, BITS_T, FROM_BITS, T)                          \
  __device__ __forceinline__ T load_hinted(const T* p, uint64_t policy) {                  \
    BITS_T bits;                                                                           \
    asm("ld.global.nc.L2::cache_hint." PTX_TYPE " %0, [%1], %2;"                           \
        : CONSTRAINT(bits) : "l"(p), "l"(policy));                                         \
    return FROM_BITS(bits);                                                                \
  }
GF_LOAD_TYPES(GF_LOAD_HINTED)
#undef GF_LOAD_HINTED
#else
__device__ __forceinline__ uint64_t keep_policy() { return 0; }
__device__ __forceinline__ uint64_t stream_policy() { return 0; }
template <class T>
__device__ __forceinline__ T load_hinted(const T* p, uint64_t) { return *p; }
#endif
#if defined(__CUDA_ARCH__)
#define GF_LOAD_ONCE(PTX_TYPE, CONSTRAINT, BITS_T, FROM_BITS, T)                            \
  __device__ __forceinline__ T load_once(const T* p) {                                     \
    BITS_T bits;                                                                           \
    asm volatile("ld.global.cg." PTX_TYPE " %0, [%1];" : CONSTRAINT(bits) : "l"(p) : "memory"); \
    return FROM_BITS(bits);                                                                \
  }
GF_LOAD_TYPES(GF_LOAD_ONCE)
#undef GF_LOAD_ONCE
#else
template <class T>
__device__ __forceinline__ T load_once(const T* p) { return *p; }
#endif
#undef GF_LOAD_TYPES

// exp of a value <= 0 and log of a positive sum where a few float ulps (times the
// argument's magnitude, for exp) are far within the design's 1e-4 on log-masses: the
// hardware's ex2/lg2.approx with subnormals flushed (.ftz; 2 instructions an exp, where
// __expf's subnormal-safe form takes 5). An exp under 2^-126 is then 0: every caller sums
// terms <= 1 whose largest is 1, or tests the sum against kFastMinMass (see reduce_run), so
// a flushed term is under 1e-36 of its sum. No log here is of a subnormal: its sums are
// >= kFastMinMass or >= 1. In the CPU emulation of tests/ops/test_cuda_emulation.py,
// libm's expf (flushed the same way) and logf.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}
__device__ __forceinline__ float fast_log(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y * 0.693147180559945309f;
}
#else
__device__ __forceinline__ float fast_exp(float x) {
  const float y = expf(x);
  return y < 1.17549435e-38f ? 0.0f : y;  // FLT_MIN: subnormals flushed, as .ftz does
}
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

// Drops the 128-byte L2 line at p (aligned) without writing it back: its contents become
// undefined (sm_80+). The CPU emulation (no nvcc) makes them NaN (all bits set), so that a
// later read of a dropped line shows; older devices keep the line.
constexpr size_t kL2Line = 128;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void discard_l2_line(const void* p) {
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
}
#elif !defined(__CUDACC__)
__device__ __forceinline__ void discard_l2_line(const void* p) {
  std::memset(const_cast<void*>(p), 0xff, kL2Line);
}
#else
__device__ __forceinline__ void discard_l2_line(const void*) {}
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

// over aligned groups of kLanes lanes (a power of two, the whole warp by default): every
// lane ends with its group's max or sum; all 32 lanes take part
template <int kLanes = 32, class V>
__device__ __forceinline__ V warp_max(V v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v = vmax(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
template <int kLanes = 32>
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}
// over the lanes kStride apart (a power of two; lane % kStride alike, the tile kernel's
// lanes of one row): every lane ends with their max (kMax) or sum; all 32 lanes take part
template <int kStride, bool kMax, class V>
__device__ __forceinline__ V strided_lanes_reduce(V v) {
#pragma unroll
  for (int off = 16; off >= kStride; off >>= 1) {
    const V other = __shfl_xor_sync(kFullMask, v, off);
    v = kMax ? vmax(v, other) : v + other;
  }
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

// ---------------------------------------------------------------------------- (a) row pass

// (a1) grid (splits, row blocks): each block reads one slice [lo, hi) of R rows ONCE, in
// rounds of kUnroll loads in flight per thread (the slice end predicated, not a serial
// tail); the block's kRowPassThreads / R threads of a row take its columns in turn. The
// next round's loads are issued as soon as this round's values are in shared memory (and
// its lse terms summed), before this round is staged.
//  - lse (log_mass): per thread and round one max, at most one rescale of its double sum,
//    and kUnroll fast exps (terms <= 1) summed pairwise in float: a few float ulps,
//    against a double sum of every term. The row's threads then merge, and write the
//    slice's partial (m, s), m its largest logit and s the sum of exp(x - m), to scratch
//    slots [2 * split, 2 * split + 1] of the row; those are free until the tile kernel,
//    which runs after (a2), writes its totals there. A NaN or +inf logit marks the row bad:
//    the partial's sum is NaN, whatever the rest (masks of -inf around a NaN would
//    otherwise leave the sum at 0 and the NaN unseen).
//  - the row check (sum and max: !LSE): a NaN read marks the row bad: NaN to the row's last
//    scratch column (0 until then: launch() zeroes it), by every thread that reads one.
//  - staging (R > 1): the round's [R][window] values go through shared memory (two buffers,
//    one barrier a round) to `staged`,
//    where the block's nr rows (R, fewer in a batch's last block) are interleaved and the
//    columns put in leaf order: [L][nr] from staged + first_row * C, column c's nr values
//    at its leaf position column_leaf[c] (a column no leaf reads is dropped). The tile
//    kernel's gather then reads its tile's values for all its rows as one contiguous
//    stretch (tile * nr values), instead of one 32-byte sector per (row, column) scattered
//    over the rows: 8.2M sectors of L2 traffic at B=64 on Llama-3 become 1.0M, for one
//    more write and read of the logits, in L2. The values are then read only here: loaded
//    evict-first.
template <class T, int R, bool LSE>
__global__ void __launch_bounds__(kRowPassThreads)
    row_pass_kernel(const T* __restrict__ values, int64_t C, int64_t chunk,
                    const int32_t* __restrict__ column_leaf, int64_t n_column_leaf,
                    T* __restrict__ staged, double* __restrict__ scratch, int64_t stride,
                    int64_t row0, int64_t row_end) {
  static_assert(R == 1 || (R >= kStageMinRows && R <= 32), "staged blocks take 8 to 32 rows");
  using A = decltype(to_arith(T()));
  constexpr bool kCheck = !LSE;  // log_mass's row check is its lse
  constexpr bool kStage = R > 1;
  constexpr int kPerRow = kRowPassThreads / R;  // threads per row
  // loads in flight per thread: kLseUnroll, half as many 8-byte values staged (the two
  // round buffers then stay within the 48 KB of static shared memory)
  constexpr int kUnroll = kStage && sizeof(T) == 8 ? kLseUnroll / 2 : kLseUnroll;
  constexpr int kWindow = kPerRow * kUnroll;  // columns per round
  constexpr int kLeavesPerThread = (kWindow + kRowPassThreads - 1) / kRowPassThreads;
  // the round's values, [column][row] with a row stride of R + R / 8: conflict-free banks
  // (4-byte values) when a warp writes 32 / kPerRow rows of kPerRow columns each; two
  // rounds' worth, so that a round's stores to `staged` need no barrier after them
  constexpr int kTileStride = R + R / 8;
  __shared__ T round_values[2][kStage ? kWindow * kTileStride : 1];
  __shared__ int32_t round_leaf[2][kStage ? kWindow : 1];  // the columns' leaf positions
  __shared__ double red_m[kRowPassThreads / 32];
  __shared__ double red_s[kRowPassThreads / 32];
  allow_next_kernel();
  const int64_t first_row = row0 + static_cast<int64_t>(blockIdx.y) * R;
  const int nr = row_end - first_row < R ? static_cast<int>(row_end - first_row) : R;
  const int j = static_cast<int>(threadIdx.x) / kPerRow;  // the thread's row in the block
  const int sub = static_cast<int>(threadIdx.x) % kPerRow;
  const bool has_row = j < nr;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t hi = lo + chunk < C ? lo + chunk : C;
  const T* x = values + (first_row + (has_row ? j : 0)) * C;
  const A no_mass = static_cast<A>(neg_inf()), pos_inf = -no_mass;

  A m = no_mass;  // the largest logit so far (exact)
  double s = 0.0;  // sum of exp(x - m)
  bool bad = false;  // log_mass: a NaN or +inf seen; sum, max: a NaN
  const uint64_t policy = kStage ? stream_policy() : keep_policy();
  // whether the thread's value u of the round at c0 is in the block's slice (recomputed
  // where used: an array of these flags, live across the loop, took 16 more registers)
  const auto in_slice = [&](int64_t c0, int u) {
    return has_row && c0 + sub + u * kPerRow < hi;
  };
  // A round's loads, all in flight at once: the thread's kUnroll values of its row and,
  // staging, the leaf positions of up to kLeavesPerThread of the round's columns. Each
  // round's are issued before the round before is staged, so that the block's reads and
  // its scattered 128-byte writes overlap rather than take turns.
  T raw[kUnroll];
  int32_t raw_leaf[kLeavesPerThread];
  auto load_round = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      raw[u] = in_slice(c0, u) ? load_hinted(x + c0 + sub + u * kPerRow, policy) : T();
    if constexpr (kStage) {
#pragma unroll
      for (int k = 0; k < kLeavesPerThread; ++k) {
        const int col = static_cast<int>(threadIdx.x) + k * kRowPassThreads;
        const int64_t c = c0 + col;
        raw_leaf[k] = col < kWindow && c < hi && c < n_column_leaf ? column_leaf[c] : -1;
      }
    }
  };
  load_round(lo);
#pragma unroll 1
  for (int64_t c0 = lo, round = 0; c0 < hi; c0 += kWindow, ++round) {
    T* const buffer = round_values[round & 1];
    int32_t* const leaves = round_leaf[round & 1];
    if constexpr (kStage) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (in_slice(c0, u)) buffer[(sub + u * kPerRow) * kTileStride + j] = raw[u];
#pragma unroll
      for (int k = 0; k < kLeavesPerThread; ++k) {
        const int col = static_cast<int>(threadIdx.x) + k * kRowPassThreads;
        if (col < kWindow) leaves[col] = raw_leaf[k];
      }
    }
    if constexpr (LSE) {
      A v[kUnroll];
      A top = no_mass;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        v[u] = in_slice(c0, u) ? to_arith(raw[u]) : no_mass;
        bad |= !(v[u] < pos_inf);  // NaN compares false
        top = vmax(top, v[u]);
      }
      if (top != no_mass) {  // else nothing but -inf (or NaN: flagged)
        if (top > m) {  // m = -inf: s is 0 and stays 0
          s *= static_cast<double>(expf(static_cast<float>(m - top)));
          m = top;
        }
        float term[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) term[u] = fast_exp(static_cast<float>(v[u] - m));
#pragma unroll
        for (int w = kUnroll / 2; w > 0; w >>= 1) {
#pragma unroll
          for (int u = 0; u < w; ++u) term[u] += term[u + w];
        }
        s += static_cast<double>(term[0]);
      }
    }
    if constexpr (kCheck) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) bad |= to_arith(raw[u]) != to_arith(raw[u]);  // NaN
    }
    if (c0 + kWindow < hi) load_round(c0 + kWindow);  // in flight while this round is staged
    if constexpr (kStage) {
      __syncthreads();  // the round's values and leaf positions are in `buffer`, `leaves`
      // each column's values for the block's rows (nr * sizeof(T) contiguous bytes: a
      // 128-byte line for 32 float rows) to its leaf position. The next round fills the
      // other buffer; this one is refilled only past the next round's barrier, which every
      // thread reaches after its reads here.
      const int cols = hi - c0 < kWindow ? static_cast<int>(hi - c0) : kWindow;
      T* dst = staged + first_row * C;
      for (int e = threadIdx.x; e < cols * R; e += kRowPassThreads) {
        const int col = e / R, row = e % R;
        const int64_t leaf = leaves[col];
        if (row < nr && leaf >= 0) dst[leaf * nr + row] = buffer[col * kTileStride + row];
      }
    }
  }
  if constexpr (kCheck) {
    if (bad) scratch[(first_row + j) * stride + stride - 1] = __longlong_as_double(kNaNBits);
  }
  if constexpr (LSE) {
    // the row's threads merge: each rescales its sum to the row's max, then they sum. They
    // are kPerRow consecutive lanes of one warp (R >= 8: shuffles within the group), or
    // whole warps (R = 1: the block's, through shared memory).
    constexpr int kGroupLanes = kPerRow < 32 ? kPerRow : 32;
    double rm = warp_max<kGroupLanes>(static_cast<double>(m));
    double rbad = warp_max<kGroupLanes>(bad ? 1.0 : 0.0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (kPerRow > 32) {
      if (lane == 0) red_m[warp] = rbad > 0.0 ? __longlong_as_double(kNaNBits) : rm;
      __syncthreads();
      rm = neg_inf();
      rbad = 0.0;
#pragma unroll
      for (int w = 0; w < kRowPassThreads / 32; ++w) {
        rbad = red_m[w] != red_m[w] ? 1.0 : rbad;
        rm = vmax(rm, red_m[w]);
      }
    }
    const double md = static_cast<double>(m);
    double rs = warp_sum<kGroupLanes>(md == neg_inf() ? 0.0 : s * exp(md - rm));
    if constexpr (kPerRow > 32) {
      if (lane == 0) red_s[warp] = rs;
      __syncthreads();
      rs = 0.0;
#pragma unroll
      for (int w = 0; w < kRowPassThreads / 32; ++w) rs += red_s[w];
    }
    if (sub == 0 && has_row) {
      double* out = scratch + (first_row + j) * stride + 2 * static_cast<int64_t>(blockIdx.x);
      out[0] = rm;
      out[1] = rbad > 0.0 ? __longlong_as_double(kNaNBits) : rs;
    }
  }
}

// (a2) one warp per row merges the row's `splits` partials into its max m and log(sum),
// stored in the row's last two scratch columns (lse = m + log(sum)); the last is NaN for a
// bad row, one with a NaN or +inf logit or no finite logit at all, and only then
// (cuda_backend reads this column as the row check). Launched dependent on (a1) (enqueue).
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
  // kMergeChunk partials a lane at a time, their loads issued together (at most one round
  // trip a row at up to 32 * kMergeChunk splits)
  for (int64_t k0 = lane; k0 < splits; k0 += 32 * kMergeChunk) {
    double part_m[kMergeChunk], part_s[kMergeChunk];
#pragma unroll
    for (int u = 0; u < kMergeChunk; ++u) {
      const int64_t k = k0 + 32 * u;
      part_m[u] = k < splits ? sc[2 * k] : neg_inf();
      part_s[u] = k < splits ? sc[2 * k + 1] : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kMergeChunk; ++u) {
      bad |= part_s[u] != part_s[u];  // (a1) saw a NaN or +inf
      lse_merge(m, z, part_m[u], part_s[u]);
    }
  }
  warp_lse_merge(m, z);
  bad = warp_max(bad ? 1.0 : 0.0) > 0.0;
  if (lane == 0) {
    sc[stride - 2] = m;
    sc[stride - 1] = bad || m == neg_inf() ? __longlong_as_double(kNaNBits) : log(z);
  }
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

// Dynamic shared memory of a tile block, sized for kMaxTile whatever the layout's tile (so
// that every address in it is a constant offset from the thread's own): `val`
// [2 * kMaxTile][ROWS + 1] of V (rows [0, kMaxTile): the leaf values, [kMaxTile,
// 2 * kMaxTile - 2): the runs' results, row kTotalRow: the tile's total, row kEmptyRow: the
// empty-node value), then for log_mass `lin` [kMaxTile][ROWS + 1] floats, exp(v - shift).
constexpr int kTotalRow = 2 * kMaxTile - 2;
constexpr int kEmptyRow = 2 * kMaxTile - 1;
template <class V, int RED, int ROWS>
__host__ __device__ constexpr size_t tile_shared_bytes() {
  return static_cast<size_t>(ROWS + 1) * kMaxTile *
         (2 * sizeof(V) + (RED == kLogMass ? sizeof(float) : 0));
}

// The row of `val` that holds a source code of the layout (a position < tile, tile + run,
// 2 * tile - 2 the total, 2 * tile - 1 none: genlm_fast/ops/layout.py, _tile_sources).
__device__ __forceinline__ int source_row(int code, int tile) {
  if (code < tile) return code;
  if (code < 2 * tile - 2) return code - tile + kMaxTile;
  return code - (2 * tile - 2) + kTotalRow;
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
    tile_kernel(const T* __restrict__ values, const T* __restrict__ staged, int64_t C,
                const int32_t* __restrict__ leaf_token,
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
  constexpr bool kFitsTile = kPerThread * kGroups == kMaxTile;  // no position past kMaxTile
  extern __shared__ double smem[];
  V* val = reinterpret_cast<V*>(smem);  // [2 * kMaxTile][kStride]
  float* lin = reinterpret_cast<float*>(val + 2 * kMaxTile * kStride);  // [kMaxTile][kStride]
  __shared__ int32_t token[kMaxTile];
  __shared__ int32_t bounds[kMaxTile];  // the tile's runs (at most tile - 2)
  __shared__ int32_t id_src[kSharedIds];  // node_src of the tile's first kSharedIds node ids
  __shared__ int32_t q_src[kTileThreads];  // its first scratch values: source code,
  __shared__ int32_t q_slot[kTileThreads];  // and slot
  // log_mass: each row's lse as hi + lo (float rows: floats; float64 rows: m and log(sum))
  using LsePart = std::conditional_t<std::is_same_v<T, double>, double, float>;
  __shared__ LsePart lse_hi[ROWS];
  __shared__ LsePart lse_lo[ROWS];
  __shared__ float part_max[kTileWarps][ROWS];  // log_mass: the warps' largest v per row
  // the warps' partial totals per row: sum, max, log_mass the sum of exp(v - shift)
  __shared__ double part_total[kTileWarps][ROWS];
  const int t = blockIdx.x;
  const int64_t first_row = row0 + static_cast<int64_t>(blockIdx.y) * ROWS;
  const int rows = row_end - first_row < ROWS ? static_cast<int>(row_end - first_row) : ROWS;
  const int64_t base = static_cast<int64_t>(t) * tile;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j = tid % ROWS, g = tid / ROWS;
  allow_next_kernel();
  // The tile's slices of the index arrays, all loaded now, in one round trip (their
  // pointers in the one before), and kept in shared memory: the later phases make no
  // global load but (rarely) for ids and scratch values past the shared arrays. Unstaged,
  // they are stored at once (the gather needs the token columns); staged, only once the
  // gather is issued, so that its loads go out while these are in flight.
  const int run0 = tile_run_ptr[t], n_runs = tile_run_ptr[t + 1] - run0;
  const int q0 = tile_scratch_ptr[t], n_q = tile_scratch_ptr[t + 1] - q0;
  const int node_lo = tile_node_lo[t], n_ids = tile_node_lo[t + 1] - node_lo;
  const int32_t my_token =
      staged == nullptr && tid < tile && base + tid < L ? leaf_token[base + tid] : -1;
  const int32_t my_bounds = tid < n_runs ? run_bounds[run0 + tid] : 0;
  const int32_t my_q_src = tid < n_q ? scratch_src[q0 + tid] : 0;
  const int32_t my_q_slot = tid < n_q ? scratch_slot[q0 + tid] : 0;
  int32_t my_id_src[kSharedIds / kTileThreads];
#pragma unroll
  for (int u = 0; u < kSharedIds / kTileThreads; ++u) {
    const int k = tid + u * kTileThreads;
    my_id_src[u] = k < n_ids ? node_src[node_lo + k] : 0;
  }
  const auto store_slices = [&] {
    if (tid < tile) token[tid] = my_token;
    if (tid < n_runs) bounds[tid] = my_bounds;
    if (tid < n_q) q_src[tid] = my_q_src, q_slot[tid] = my_q_slot;
#pragma unroll
    for (int u = 0; u < kSharedIds / kTileThreads; ++u) {
      if (tid + u * kTileThreads < n_ids) id_src[tid + u * kTileThreads] = my_id_src[u];
    }
  };
  if (tid < kStride)
    val[kEmptyRow * kStride + tid] = static_cast<V>(empty_node_value<RED>());
  if (staged == nullptr) {
    store_slices();
    __syncthreads();
  }

  // gather: thread (g, j) takes row j at positions g, g + kGroups, ...: all its loads in
  // flight at once, unconditionally; a position past the tile's last leaf, or a row past
  // the batch's, reads the block's first value and is dropped. In the input rows the
  // columns are scattered: each load is a 32-byte sector of its own. Staged by (a1), the
  // tile's values for the block's rows are one contiguous stretch ([L][rows] from
  // first_row * C, in leaf order): a warp's loads are one 128-byte line. The input
  // predates the kernels before this one (log_mass: this kernel is launched dependent),
  // so its loads go out before the wait for them; staged values only after it.
  const int jr = j < rows ? j : 0;
  const int n_leaves = L - base < tile ? static_cast<int>(L - base) : tile;
  T x[kPerThread];
  bool valid[kPerThread];
  if (staged != nullptr) {
    const T* src = staged + first_row * C + base * rows + jr;
    wait_for_previous_kernel();
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int p = g + u * kGroups;
      valid[u] = j < rows && p < n_leaves;
      x[u] = load_once(src + (p < n_leaves ? p : 0) * rows);
    }
    store_slices();  // read after the barrier below
  } else {
    const T* src = values + (first_row + jr) * C;
    const uint64_t policy = keep_policy();
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int p = g + u * kGroups;
      const int32_t column = p < tile ? token[p] : -1;
      valid[u] = j < rows && column >= 0;
      x[u] = load_hinted(src + (column >= 0 ? column : 0), policy);
    }
  }
  wait_for_previous_kernel();  // from here on: the rows' lse read, scratch written
  if constexpr (RED == kLogMass) {
    if (threadIdx.x < ROWS) {
      const double* sc = scratch + (first_row + threadIdx.x) * stride;
      const bool row_ok = static_cast<int>(threadIdx.x) < rows;
      const double m = row_ok ? sc[stride - 2] : 0.0, log_sum = row_ok ? sc[stride - 1] : 0.0;
      if constexpr (std::is_same_v<T, double>) {
        lse_hi[threadIdx.x] = m, lse_lo[threadIdx.x] = log_sum;
      } else {  // m is a float: hi = m + log_sum rounded, lo the rest, formed from the pair
        const float hi = static_cast<float>(m + log_sum);
        lse_hi[threadIdx.x] = hi;
        lse_lo[threadIdx.x] = static_cast<float>((m - hi) + log_sum);
      }
    }
    __syncthreads();
  }
  // the values, branch-free (a select per value): past the last leaf or row, -inf, never
  // read but by the max and the total, where -inf (max) or 0 (sum) changes nothing
  V v[kPerThread];
  float m = static_cast<float>(neg_inf());  // log_mass: the largest v this thread saw
  // this thread's part of the tile's total: sum, max (log_mass: summed below, from lin)
  double total = identity<RED == kLogMass ? kSum : RED>();
  LsePart hi = 0, lo = 0;  // log_mass: the row's lse
  if constexpr (RED == kLogMass) hi = lse_hi[j], lo = lse_lo[j];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int p = g + u * kGroups;
    if constexpr (RED == kLogMass) {
      float lp;  // the log-probability; -inf stays -inf
      if constexpr (std::is_same_v<T, double>)
        lp = static_cast<float>((x[u] - hi) - lo);
      else
        lp = (to_arith(x[u]) - hi) - lo;
      v[u] = valid[u] ? lp : static_cast<float>(neg_inf());
      m = vmax(m, v[u]);
    } else {
      v[u] = valid[u] ? x[u] : static_cast<V>(neg_inf());
      total = RED == kSum ? total + (valid[u] ? static_cast<double>(x[u]) : 0.0)
                          : vmax(total, static_cast<double>(v[u]));
    }
    if (kFitsTile || p < kMaxTile) val[p * kStride + j] = v[u];
  }
  float shift = 0.0f;
  if constexpr (RED == kLogMass) {
    // the tile's largest log-probability per row: over the warp's lanes of row j, then the
    // warps; rows with no finite value shift by 0
    m = strided_lanes_reduce<ROWS, true>(m);
    if (lane < ROWS) part_max[warp][lane] = m;
    __syncthreads();
    shift = static_cast<float>(neg_inf());
#pragma unroll
    for (int w = 0; w < kTileWarps; ++w) shift = vmax(shift, part_max[w][j]);
    if (shift == static_cast<float>(neg_inf())) shift = 0.0f;
    float lin_total = 0.0f;  // at most 64 terms <= 1
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int p = g + u * kGroups;
      const float e = fast_exp(v[u] - shift);  // -inf (and invalid) gives 0
      lin_total += e;
      if (kFitsTile || p < kMaxTile) lin[p * kStride + j] = e;
    }
    total = lin_total;
  }
  // the partial totals: over the warp's lanes of row j, then to part_total for the runs phase
  total = strided_lanes_reduce<ROWS, RED == kMax>(total);
  if (lane < ROWS) part_total[warp][lane] = total;
  __syncthreads();

  // Staged lines this block read whole (ROWS values of 4 or 8 bytes, 128 bytes: a leaf's
  // values for every row of a full block) are read by no one else (a leaf position is in
  // one tile), and all its loads are done (their values are in shared memory): dropped
  // from L2 unwritten, they cost no write-back to memory.
  if constexpr (ROWS * sizeof(T) == kL2Line) {
    if (staged != nullptr && rows == ROWS) {
      for (int p = threadIdx.x; p < n_leaves; p += kTileThreads)
        discard_l2_line(staged + first_row * C + (base + p) * int64_t{ROWS});
    }
  }

  // runs, longest first, dealt round-robin to the groups; the last group (the fewest
  // runs) also combines the warps' partial totals (a tile of 2 leaves or more)
  if (j < rows) {
    for (int r = g; r < n_runs; r += kGroups) {
      const int a = bounds[r] & 0xffff, b = bounds[r] >> 16;
      val[(kMaxTile + r) * kStride + j] = reduce_run<V, RED, ROWS>(val, lin, shift, a, b, j);
    }
    if (g == kGroups - 1 && n_leaves >= 2) {
      double acc = part_total[0][j];
#pragma unroll
      for (int w = 1; w < kTileWarps; ++w)
        acc = RED == kMax ? vmax(acc, part_total[w][j]) : acc + part_total[w][j];
      V tile_total;
      if constexpr (RED == kLogMass)  // acc >= 1 unless every leaf is -inf
        tile_total = acc > 0.0 ? shift + fast_log(static_cast<float>(acc)) : neg_inf();
      else
        tile_total = static_cast<V>(acc);
      val[kTotalRow * kStride + j] = tile_total;
    }
  }
  __syncthreads();

  // the tile's total and pieces to scratch (double)
  for (int e = threadIdx.x; e < n_q * ROWS; e += kTileThreads) {
    const int q = e / ROWS, jj = e % ROWS;
    const int src = q < kTileThreads ? q_src[q] : scratch_src[q0 + q];
    const int slot = q < kTileThreads ? q_slot[q] : scratch_slot[q0 + q];
    if (jj < rows)
      scratch[(first_row + jj) * stride + slot] =
          static_cast<double>(val[source_row(src, tile) * kStride + jj]);
  }
  // the node ids the tile owns, each row's block whole: a warp per 32 consecutive ids, its
  // lanes at consecutive ids (128 bytes, over two lines but where the row's block starts on
  // one), looping over the rows
  for (int k = warp * 32 + lane; k - lane < n_ids; k += kTileThreads) {
    if (k >= n_ids) continue;
    const int code = k < kSharedIds ? id_src[k] : node_src[node_lo + k];
    const V* src = val + source_row(code, tile) * kStride;
    V* dst = out + first_row * num_nodes + node_lo + k;
    if (rows == ROWS) {
#pragma unroll
      for (int jj = 0; jj < ROWS; ++jj) store_out(dst + jj * num_nodes, src[jj]);
    } else {
      for (int jj = 0; jj < rows; ++jj) store_out(dst + jj * num_nodes, src[jj]);
    }
  }
}

// Kernels (a2), (b) and (c) follow one of ours on the stream and are launched dependent on
// it (programmatic dependent launch, sm_90+): they start while it ends, load their index
// arrays, and wait for it (wait_for_previous_kernel) before touching its results. The first
// kernel of a call, (a1), is an ordinary launch: it runs after whatever came before it (the
// memsets of launch() included). Dependent launches need the waits compiled in (ptxVersion
// >= 90; below that wait_for_previous_kernel is empty); the kernels are then launched the
// ordinary way. Overlapping a kernel's start with its predecessor's end hides part of the
// launch latency, which matters at these kernels' sizes.

#ifdef __CUDACC__
constexpr int kMaxDevices = 64;

// A fixed fact about the current device, nonzero: ask(device) the first time, then what
// `known` remembers for it (0: not asked yet). `fallback` where there is no current device
// (or one past kMaxDevices), or where ask has no answer (0; asked again next time).
template <class Ask>
int per_device(std::atomic<int> (&known)[kMaxDevices], int fallback, Ask ask) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices)
    return fallback;
  int value = known[device].load(std::memory_order_relaxed);
  if (value == 0) {
    value = ask(device);
    if (value == 0) return fallback;
    known[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

bool dependent_launches_on() {
  static std::atomic<int> compiled_for[kMaxDevices];  // 1 sm_90+, -1 not
  return per_device(compiled_for, -1, [](int) {
           cudaFuncAttributes attributes;
           return cudaFuncGetAttributes(&attributes, row_lse_merge_kernel) == cudaSuccess &&
                          attributes.ptxVersion >= 90
                      ? 1 : -1;
         }) > 0;
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

// ---------------------------------------------------------------------------- (c) spanning nodes

// Element k of spanning node s in a row's scratch: whole tile t0 + k for k < n, then its
// left and right pieces; none (slot -1, or k past them) is the reduction's identity.
template <int RED>
__device__ __forceinline__ double span_element(const double* sc, int32_t t0, int32_t n,
                                               int32_t left, int32_t right, int32_t k) {
  const int32_t slot = k < n ? t0 + k : k == n ? left : k == n + 1 ? right : -1;
  return slot >= 0 ? sc[slot] : identity<RED>();
}

// Who reduces one spanning node: a thread (narrow nodes), a warp (wider ones,
// at most SPAN_WARP_TILES + 2 elements) or a block (the widest: the root's ~2,000 tiles). Each
// member takes elements rank(), rank() + kSize, ..., kChunk of them at a time, their loads
// issued together (kChunk * kSize covers a narrow node of up to 2 whole tiles, ~95% of
// them on Llama-3, a warp node and the root: one round trip each); sum and max combine the
// members' values, every member getting the result.
struct ThreadGroup {
  static constexpr int kSize = 1, kChunk = 4;
  __device__ static int rank() { return 0; }
  __device__ static double sum(double v) { return v; }
  __device__ static double max(double v) { return v; }
};
struct WarpGroup {
  static constexpr int kSize = 32, kChunk = 4;
  __device__ static int rank() { return threadIdx.x & 31; }
  __device__ static double sum(double v) { return warp_sum(v); }
  __device__ static double max(double v) { return warp_max(v); }
};
struct BlockGroup {
  static constexpr int kSize = kSpanThreads, kChunk = 8;
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

// A spanning node's value, by one Group: sum or max of its elements; log_mass m + log(z),
// m their max and z the sum of exp(element - m): each member keeps its own (m, z), a chunk
// at a time (its max, then its float exps summed in double, merged by lse_merge), and the
// group sums the members' z scaled to the group's m. Every member returns the value.
template <int RED, class Group>
__device__ __forceinline__ double span_reduce(const double* sc, int32_t t0, int32_t n,
                                              int32_t left, int32_t right) {
  constexpr int kChunk = Group::kChunk;
  double acc = identity<RED>();  // log_mass: m, the member's largest element so far
  double z = 0.0;                // log_mass: the sum of exp(element - m)
  for (int32_t k0 = Group::rank(); k0 < n + 2; k0 += kChunk * Group::kSize) {
    double v[kChunk];
#pragma unroll
    for (int u = 0; u < kChunk; ++u)
      v[u] = span_element<RED>(sc, t0, n, left, right, k0 + u * Group::kSize);
    if constexpr (RED == kLogMass) {
      double chunk_max = v[0];
#pragma unroll
      for (int u = 1; u < kChunk; ++u) chunk_max = vmax(chunk_max, v[u]);
      if (chunk_max != neg_inf()) {  // else nothing here has mass
        double chunk_z = 0.0;  // terms <= 1, at least one of them 1
#pragma unroll
        for (int u = 0; u < kChunk; ++u)
          chunk_z += fast_exp(static_cast<float>(v[u] - chunk_max));
        lse_merge(acc, z, chunk_max, chunk_z);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kChunk; ++u) acc = RED == kSum ? acc + v[u] : vmax(acc, v[u]);
    }
  }
  if constexpr (RED == kSum) {
    return Group::sum(acc);
  } else if constexpr (RED == kMax) {
    return Group::max(acc);
  } else {
    const double m = Group::max(acc);
    if (m == neg_inf()) return m;  // no mass beneath the node (the whole group agrees)
    const double total = Group::sum(acc == neg_inf() ? 0.0 : z * exp(acc - m));  // >= 1
    return m + static_cast<double>(fast_log(static_cast<float>(total)));
  }
}

// The spanning nodes: a thread each up to `narrow` (in narrow_blocks blocks), then a warp
// each up to warp_end, then a block each.
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

// How many (a1) blocks the device holds at once (asked once per device and kernel): the
// launch aims at one wave of them, so that each block reads several rounds, each round's
// loads in flight while the round before is staged, and no second wave starts late.
template <class T, int R, bool LSE>
int64_t row_pass_target_blocks() {
#ifdef __CUDACC__
  static std::atomic<int> resident[kMaxDevices];
  return per_device(resident, static_cast<int>(kRowPassTargetBlocks), [](int device) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, row_pass_kernel<T, R, LSE>,
                                                      kRowPassThreads, 0) != cudaSuccess) {
      cudaGetLastError();  // not sticky: the launch below reports its own
      return 0;
    }
    return sms > 0 && per_sm > 0 ? sms * per_sm : 0;
  });
#else
  return kRowPassTargetBlocks;
#endif
}

// (a1) over rows [row0, row0 + rows), R rows a block (1: no staging): slices of each row's
// columns, one wave of blocks (row_pass_target_blocks) to fill the device even at B = 1,
// but at least kRowPassMinValues values each, whole 32-column stretches, and (lse) two
// scratch slots per slice's partial. The slice count goes to *splits for (a2).
template <class T, int R, bool LSE>
cudaError_t launch_row_pass(const TrieArgs& A, const T* values, T* staged, int64_t row0,
                            int64_t rows, int64_t* splits, cudaStream_t stream) {
  const int64_t row_blocks = (rows + R - 1) / R;
  int64_t n = (row_pass_target_blocks<T, R, LSE>() + row_blocks - 1) / row_blocks;
  const int64_t by_width = (A.C * R + kRowPassMinValues - 1) / kRowPassMinValues;
  const int64_t by_room = (A.scratch_stride - 2) / 2;  // below the lse pair's columns
  if (n > by_width) n = by_width;
  if (n > by_room) n = by_room;
  if (n < 1) n = 1;
  const int64_t chunk = ((A.C + n - 1) / n + 31) / 32 * 32;
  *splits = (A.C + chunk - 1) / chunk;  // no empty slice (C >= 1)
  const dim3 grid(static_cast<unsigned>(*splits), static_cast<unsigned>(row_blocks));
  return enqueue(row_pass_kernel<T, R, LSE>, grid, kRowPassThreads, 0, stream,
                 /*dependent=*/false, values, A.C, chunk, A.column_leaf, A.n_column_leaf,
                 staged, A.scratch, A.scratch_stride, row0, row0 + rows);
}

// The kernels for rows [row0, row0 + rows), ROWS rows per tile block, `staged` null or the
// workspace (ROWS >= kStageMinRows): (a1), staged or not, and for log_mass (a2); then (b)
// and (c).
template <class T, class Out, int RED, int ROWS>
cudaError_t launch_rows(const TrieArgs& A, const T* values, T* staged, Out* out, int64_t row0,
                        int64_t rows, cudaStream_t stream) {
  constexpr bool kLse = RED == kLogMass;
  int64_t splits = 0;
  cudaError_t err = cudaSuccess;
  if constexpr (ROWS >= kStageMinRows) {
    if (staged != nullptr)
      err = launch_row_pass<T, ROWS, kLse>(A, values, staged, row0, rows, &splits, stream);
  }
  if (staged == nullptr)
    err = launch_row_pass<T, 1, kLse>(A, values, nullptr, row0, rows, &splits, stream);
  if constexpr (kLse) {
    if (err == cudaSuccess)
      err = enqueue(row_lse_merge_kernel,
                    static_cast<unsigned>((rows + kSpanWarps - 1) / kSpanWarps),
                    kSpanWarps * 32, 0, stream, true, rows, splits, A.scratch,
                    A.scratch_stride, row0);
  }
  if (err != cudaSuccess) return err;
  const dim3 tgrid(static_cast<unsigned>(A.n_tiles),
                   static_cast<unsigned>((rows + ROWS - 1) / ROWS));
  // after (a1) and, for log_mass, (a2)
  err = enqueue(tile_kernel<T, RED, ROWS>, tgrid, kTileThreads,
                tile_shared_bytes<Out, RED, ROWS>(), stream, /*dependent=*/true, values,
                static_cast<const T*>(staged), A.C, A.leaf_token, A.L, A.tile_run_ptr,
                A.run_bounds, A.tile_node_lo, A.node_src, A.tile_scratch_ptr, A.scratch_src,
                A.scratch_slot, A.scratch, A.scratch_stride, out, A.num_nodes, A.tile, row0,
                row0 + rows);
  if (err != cudaSuccess || A.S == 0) return err;
  const int64_t narrow_blocks = (A.span_narrow + kSpanThreads - 1) / kSpanThreads;
  const int64_t warp_blocks = (A.span_warp - A.span_narrow + kSpanWarps - 1) / kSpanWarps;
  const int64_t block_nodes = A.S - A.span_warp;
  const dim3 sgrid(static_cast<unsigned>(narrow_blocks + warp_blocks + block_nodes),
                   static_cast<unsigned>(rows));
  return enqueue(span_kernel<Out, RED>, sgrid, kSpanThreads, 0, stream, true, A.span_node,
                 A.span_left, A.span_right, A.span_tile_lo, A.span_tile_hi, A.S, A.span_narrow,
                 narrow_blocks, A.span_warp, warp_blocks, A.scratch, A.scratch_stride, out,
                 A.num_nodes, row0);
}

// Rows per tile block for a launch of `rows` rows: the largest of 32, 16, ..., 1 it fills.
int rows_per_block(int64_t rows) {
  return rows >= 32 ? 32 : rows >= 16 ? 16 : rows >= 8 ? 8 : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;
}

template <class T, class Out, int RED>
cudaError_t launch(const TrieArgs& A, cudaStream_t stream) {
  static_assert(std::is_same_v<Out, TileValue<T, RED>>, "the tile kernel writes its values");
  const T* values = static_cast<const T*>(A.values);
  Out* out = static_cast<Out*>(A.out);
  // sum and max: the row check's column, 0 until (a1) reads a NaN in the row
  if (RED != kLogMass) {
    const cudaError_t err =
        cudaMemset2DAsync(A.scratch + A.scratch_stride - 1, sizeof(double) * A.scratch_stride,
                          0, sizeof(double), A.B, stream);
    if (err != cudaSuccess) return err;
  }
  for (int64_t row0 = 0; row0 < A.B; row0 += kMaxGridY) {
    const int64_t rows = A.B - row0 < kMaxGridY ? A.B - row0 : kMaxGridY;
    T* staged = rows >= kStageMinRows ? static_cast<T*>(A.staged) : nullptr;
    const auto with_rows = [&](auto per_block) {  // a std::integral_constant
      return launch_rows<T, Out, RED, decltype(per_block)::value>(A, values, staged, out, row0,
                                                                  rows, stream);
    };
    cudaError_t err;
    switch (rows_per_block(rows)) {  // staged is null below kStageMinRows rows
      case 32: err = with_rows(std::integral_constant<int, 32>()); break;
      case 16: err = with_rows(std::integral_constant<int, 16>()); break;
      case 8: err = with_rows(std::integral_constant<int, 8>()); break;
      case 4: err = with_rows(std::integral_constant<int, 4>()); break;
      case 2: err = with_rows(std::integral_constant<int, 2>()); break;
      default: err = with_rows(std::integral_constant<int, 1>());
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t trie_reduce(const TrieArgs& A, cudaStream_t stream) {
  if (A.B == 0 || A.num_nodes == 0) return cudaSuccess;
  if (A.tile < 1 || A.tile > kMaxTile || A.n_tiles < 1 || A.scratch_stride < 2 ||
      A.span_narrow < 0 || A.span_narrow > A.span_warp || A.span_warp > A.S)
    return cudaErrorInvalidValue;
  if (A.staged != nullptr &&
      (A.column_leaf == nullptr || A.n_column_leaf > A.C || A.L > A.C))
    return cudaErrorInvalidValue;  // (a1) would stage past a row block's C * rows values
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
