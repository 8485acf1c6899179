// CUDA trie reduction kernels: the tile decomposition of genlm_fast/ops/layout.py (the
// same algorithm as the Triton backend). No torch headers: plain device pointers, sizes
// and a cudaStream_t (see trie_reduce_cuda.h); compiles standalone with `nvcc -c`.
//
// Layout recap. Leaves are sorted by node id ("leaf order"), so the leaves beneath any node
// are one contiguous range of leaf positions. The leaf order is cut into tiles of TILE
// positions. A node whose range lies inside one tile is "local"; the others are "spanning"
// and are split into an optional left piece, whole tiles, and an optional right piece. The
// pieces and each tile's total are themselves local ranges that write to a per-row scratch
// buffer (tile totals at slots [0, n_tiles), pieces after them).
//
// Kernels, enqueued in order on one stream:
//  (a) log_mass only: lse = max + log(sum exp(x - max)) over all C columns of each row, in
//      double, stored in the row's last scratch column. (a1) row_lse_partial: grid (splits,
//      rows), each block reads one slice of a row once (several independent loads in flight
//      per thread; an online max/sum-exp, one exp per element) and writes a partial (max,
//      sum) to scratch slots the tile kernel only fills later; (a2) row_lse_merge: one warp
//      per row merges the partials. Splitting keeps the device busy even at B = 1.
//  (b) tile: one block per (tile, block of up to 8 rows). The tile's leaf values
//      x[row, leaf_token[pos]] of those rows are gathered into shared memory once (as double;
//      log_mass: x - lse = log-probs, then exp(v - the tile's max) per leaf), then the block's
//      threads each reduce some of the tile's local ranges [tile_range_ptr[t],
//      tile_range_ptr[t+1]) for all the block's rows at once: the index arrays are read once
//      per 8 rows, and a log_mass range only adds. A destination >= 0 is a node (written to
//      out), < 0 is scratch slot -1 - dest.
//  (c) span: one warp per (spanning node, row): the lanes stride over the node's whole-tile
//      totals in scratch, reduce across the warp with shuffles, and lane 0 adds the left and
//      right pieces. Spanning nodes are sorted by tile count, so a block's warps loop alike.
// Sums accumulate in double; log_mass ranges use max-shifted sums and the spanning
// reduction an online (max, scaled sum) log-sum-exp, so no node underflows: a node whose
// leaves all have log-prob -800 gives -800, all -inf leaves give -inf, never NaN.
// Empty nodes (no leaves; always local): 0 for sum and max, -inf for log_mass.
// Templates over the input type (float, double, __half, __nv_bfloat16), the output type
// (float, double) and the reduction.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "trie_reduce_cuda.h"

namespace genlm_fast {
namespace cuda {
namespace {

constexpr int kTileThreads = 128;
constexpr int kLseThreads = 256;
constexpr int kLseUnroll = 8;       // independent loads in flight per thread in (a1)
constexpr int64_t kLseMinChunk = 4096;  // columns per (a1) block, at least
constexpr int64_t kLseTargetBlocks = 1024;  // (a1) blocks per launch to aim for (B * splits)
constexpr int kSpanWarps = 8;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ double neg_inf() { return -__longlong_as_double(0x7ff0000000000000LL); }

__device__ __forceinline__ double to_double(float v) { return static_cast<double>(v); }
__device__ __forceinline__ double to_double(double v) { return v; }
__device__ __forceinline__ double to_double(__half v) {
  return static_cast<double>(__half2float(v));
}
__device__ __forceinline__ double to_double(__nv_bfloat16 v) {
  return static_cast<double>(__bfloat162float(v));
}

__device__ __forceinline__ double dmax(double a, double b) { return b > a ? b : a; }

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

__device__ __forceinline__ double lse_value(double m, double s) {
  return m == neg_inf() ? neg_inf() : m + log(s);
}

template <int RED>
__device__ __forceinline__ double identity() {
  return RED == kSum ? 0.0 : neg_inf();
}

// ---------------------------------------------------------------------------- (a) row lse

__device__ __forceinline__ double warp_max(double v) {
  for (int off = 16; off > 0; off >>= 1) v = dmax(v, __shfl_xor_sync(kFullMask, v, off));
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

// (a1) grid (splits, rows): each block reads one contiguous slice of a row ONCE, with
// kLseUnroll independent loads in flight per thread (a single dependent load per iteration
// left one 128-byte request per warp in flight: ~2 GB/s per SM), keeps an online (max,
// sum-exp) pair per thread, merges them across the block and writes the slice's partial
// (m, s) to scratch slots [2 * split, 2 * split + 1] of its row. Those slots are free until
// the tile kernel, which runs after (a2), writes its totals there.
template <class T>
__global__ void __launch_bounds__(kLseThreads)
    row_lse_partial_kernel(const T* __restrict__ values, int64_t C, int64_t chunk,
                           double* __restrict__ scratch, int64_t stride, int64_t row0) {
  __shared__ double red_m[kLseThreads / 32];
  __shared__ double red_s[kLseThreads / 32];
  const int64_t row = row0 + blockIdx.y;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t hi = lo + chunk < C ? lo + chunk : C;
  const T* x = values + row * C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  double m = neg_inf(), s = 0.0;
  int64_t c = lo + threadIdx.x;
  for (; c + (kLseUnroll - 1) * kLseThreads < hi; c += kLseUnroll * kLseThreads) {
    double v[kLseUnroll];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) v[u] = to_double(x[c + u * kLseThreads]);
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) lse_merge(m, s, v[u], 1.0);  // one exp each
  }
  for (; c < hi; c += kLseThreads) lse_merge(m, s, to_double(x[c]), 1.0);

  // block merge: every thread rescales its sum to the block max, then sums
  const double bm_w = warp_max(m);
  if (lane == 0) red_m[warp] = bm_w;
  __syncthreads();
  double bm = neg_inf();
#pragma unroll
  for (int w = 0; w < kLseThreads / 32; ++w) bm = dmax(bm, red_m[w]);
  const double sc = warp_sum(m == neg_inf() ? 0.0 : s * exp(m - bm));
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

// (b) one block per (tile, block of ROWS rows). The index arrays of the tile (leaf_token and
// its local ranges) are read once for ROWS rows, and every range is reduced for the ROWS rows
// at once from shared memory laid out [position][row] (row stride ROWS + 1, an odd number of
// doubles: threads at consecutive positions hit different banks).
// log_mass: the values are log-probabilities v = x - lse. Per row, the block takes the tile's
// largest v as a shift and stores terms = exp(v - shift) in double, ONE exp per leaf and row
// (the ranges then only add). A range whose term sum is >= kMinTermSum is exact to double
// rounding: its own largest term is >= kMinTermSum / tile, so it is normal, and every term
// exp() flushed to zero is below e^-745, over 1e-29 below it. A range under that (every leaf
// more than ~670 nats under the tile's max, or all -inf: masks of -1e30) is rare and redone
// on its own: max, then sum of exp(v - max).
constexpr double kMinTermSum = 1e-290;

template <int RED, int ROWS>
__device__ __forceinline__ void reduce_range(const double* __restrict__ src, int a, int b,
                                             double (&acc)[ROWS]) {
#pragma unroll
  for (int j = 0; j < ROWS; ++j) acc[j] = RED == kMax ? neg_inf() : 0.0;
  for (int i = a; i < b; ++i) {
    const double* e = src + i * (ROWS + 1);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) acc[j] = RED == kMax ? dmax(acc[j], e[j]) : acc[j] + e[j];
  }
}

// log of sum exp(v) over positions [a, b) of row j, by its own max (-inf when none is finite)
template <int ROWS>
__device__ double range_lse(const double* __restrict__ vals, int a, int b, int j) {
  double m = neg_inf();
  for (int i = a; i < b; ++i) m = dmax(m, vals[i * (ROWS + 1) + j]);
  if (m == neg_inf()) return m;
  double s = 0.0;
  for (int i = a; i < b; ++i) s += exp(vals[i * (ROWS + 1) + j] - m);
  return m + log(s);
}

template <class T, class Out, int RED, int ROWS>
__global__ void __launch_bounds__(kTileThreads)
    tile_kernel(const T* __restrict__ values, int64_t C, const int32_t* __restrict__ leaf_token,
                int64_t L, const int32_t* __restrict__ tile_range_ptr,
                const int32_t* __restrict__ range_start, const int32_t* __restrict__ range_end,
                const int32_t* __restrict__ range_dest, double* __restrict__ scratch,
                int64_t stride, Out* __restrict__ out, int64_t num_nodes, int tile,
                int64_t row0, int64_t row_end) {
  constexpr int kStride = ROWS + 1;
  extern __shared__ double smem[];
  double* vals = smem;                   // [tile][kStride] values / log-probabilities
  double* terms = smem + tile * kStride;  // log_mass: exp(v - shift) [tile][kStride]
  __shared__ double shift[ROWS];          // log_mass: per row, the tile's largest v (0 if none)
  const int t = blockIdx.x;
  const int64_t first_row = row0 + static_cast<int64_t>(blockIdx.y) * ROWS;
  const int rows = row_end - first_row < ROWS ? static_cast<int>(row_end - first_row) : ROWS;
  const int64_t base = static_cast<int64_t>(t) * tile;

  // consecutive threads: consecutive positions of one row (leaf_token reads coalesce)
  for (int i = threadIdx.x; i < tile * ROWS; i += blockDim.x) {
    const int p = i % tile, j = i / tile;
    double v = identity<RED == kLogMass ? kMax : RED>();
    if (j < rows && base + p < L) {
      const int64_t row = first_row + j;
      v = to_double(values[row * C + leaf_token[base + p]]);
      if (RED == kLogMass) v -= scratch[row * stride + stride - 1];  // -inf stays -inf
    }
    vals[p * kStride + j] = v;
  }
  __syncthreads();
  if (RED == kLogMass) {
    const int lane = threadIdx.x & 31;
    for (int j = threadIdx.x >> 5; j < ROWS; j += kTileThreads / 32) {  // a warp per row
      double m = neg_inf();
      for (int p = lane; p < tile; p += 32) m = dmax(m, vals[p * kStride + j]);
      m = warp_max(m);
      if (lane == 0) shift[j] = m == neg_inf() ? 0.0 : m;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tile * ROWS; i += blockDim.x) {
      const int p = i % tile, j = i / tile;
      terms[p * kStride + j] = exp(vals[p * kStride + j] - shift[j]);  // -inf -> 0
    }
    __syncthreads();
  }

  const int r0 = tile_range_ptr[t], r1 = tile_range_ptr[t + 1];
  for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
    const int a = static_cast<int>(range_start[r] - base), b = static_cast<int>(range_end[r] - base);
    double acc[ROWS];
    reduce_range<RED == kLogMass ? kSum : RED, ROWS>(RED == kLogMass ? terms : vals, a, b, acc);
    const int32_t d = range_dest[r];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      if (j >= rows) break;
      double res = acc[j];
      if (RED == kMax && b <= a) res = 0.0;  // an empty node is 0 under max
      if (RED == kLogMass)
        res = acc[j] >= kMinTermSum ? shift[j] + log(acc[j]) : range_lse<ROWS>(vals, a, b, j);
      const int64_t row = first_row + j;
      if (d >= 0) {
        out[row * num_nodes + d] = static_cast<Out>(res);
      } else {
        scratch[row * stride - 1 - static_cast<int64_t>(d)] = res;
      }
    }
  }
}

// ROWS rows per tile block: 8 once there are that many, fewer for a small batch
template <class T, class Out, int RED, int ROWS>
void launch_tiles(const TrieArgs& A, const T* values, Out* out, int64_t row0, int64_t rows,
                  cudaStream_t stream) {
  const size_t shmem = static_cast<size_t>(A.tile) * (ROWS + 1) * sizeof(double) *
                       (RED == kLogMass ? 2 : 1);
  const dim3 grid(static_cast<unsigned>(A.n_tiles), static_cast<unsigned>((rows + ROWS - 1) / ROWS));
  tile_kernel<T, Out, RED, ROWS><<<grid, kTileThreads, shmem, stream>>>(
      values, A.C, A.leaf_token, A.L, A.tile_range_ptr, A.range_start, A.range_end,
      A.range_dest, A.scratch, A.scratch_stride, out, A.num_nodes, A.tile, row0, row0 + rows);
}

// ---------------------------------------------------------------------------- (c) spanning nodes

template <class Out, int RED>
__global__ void __launch_bounds__(kSpanWarps * 32)
    span_kernel(const int32_t* __restrict__ span_node, const int32_t* __restrict__ span_left,
                const int32_t* __restrict__ span_right, const int32_t* __restrict__ span_tile_lo,
                const int32_t* __restrict__ span_tile_hi, int64_t S,
                const double* __restrict__ scratch, int64_t stride, Out* __restrict__ out,
                int64_t num_nodes, int64_t row0) {
  const int lane = threadIdx.x & 31;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kSpanWarps + (threadIdx.x >> 5);
  if (s >= S) return;  // uniform per warp
  const int64_t row = row0 + blockIdx.y;
  const double* sc = scratch + row * stride;
  const int32_t t0 = span_tile_lo[s], t1 = span_tile_hi[s];
  double res;
  if (RED == kLogMass) {
    double m = neg_inf(), z = 0.0;
    for (int32_t t = t0 + lane; t < t1; t += 32) lse_merge(m, z, sc[t], 1.0);
    warp_lse_merge(m, z);
    if (lane != 0) return;
    const int32_t l = span_left[s], r = span_right[s];
    if (l >= 0) lse_merge(m, z, sc[l], 1.0);
    if (r >= 0) lse_merge(m, z, sc[r], 1.0);
    res = lse_value(m, z);
  } else {
    double acc = identity<RED>();
    for (int32_t t = t0 + lane; t < t1; t += 32)
      acc = RED == kSum ? acc + sc[t] : dmax(acc, sc[t]);
    for (int off = 16; off > 0; off >>= 1) {
      const double o = __shfl_xor_sync(kFullMask, acc, off);
      acc = RED == kSum ? acc + o : dmax(acc, o);
    }
    if (lane != 0) return;
    const int32_t l = span_left[s], r = span_right[s];
    if (l >= 0) acc = RED == kSum ? acc + sc[l] : dmax(acc, sc[l]);
    if (r >= 0) acc = RED == kSum ? acc + sc[r] : dmax(acc, sc[r]);
    res = acc;
  }
  out[row * num_nodes + span_node[s]] = static_cast<Out>(res);
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
    if (rows >= 8) {
      launch_tiles<T, Out, RED, 8>(A, values, out, row0, rows, stream);
    } else if (rows >= 4) {
      launch_tiles<T, Out, RED, 4>(A, values, out, row0, rows, stream);
    } else if (rows >= 2) {
      launch_tiles<T, Out, RED, 2>(A, values, out, row0, rows, stream);
    } else {
      launch_tiles<T, Out, RED, 1>(A, values, out, row0, rows, stream);
    }
    if (A.S > 0) {
      const dim3 sgrid(static_cast<unsigned>((A.S + kSpanWarps - 1) / kSpanWarps),
                       static_cast<unsigned>(rows));
      span_kernel<Out, RED><<<sgrid, kSpanWarps * 32, 0, stream>>>(
          A.span_node, A.span_left, A.span_right, A.span_tile_lo, A.span_tile_hi, A.S,
          A.scratch, A.scratch_stride, out, A.num_nodes, row0);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t trie_reduce(const TrieArgs& A, cudaStream_t stream) {
  if (A.B == 0 || A.num_nodes == 0) return cudaSuccess;
  if (A.tile < 1 || A.tile > kMaxTile || A.n_tiles < 1 || A.scratch_stride < 1)
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
