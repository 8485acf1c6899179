// CPU trie reduction kernel (C++17 + OpenMP; no torch headers, see bindings.cpp).
//
// One file past 500 lines: the sweeps below (several rows, one row, the runs' expansion) are
// templates over the reduction, the row count and the dtypes that share the scalar and vector
// passes, instantiated here for trie_reduce alone.
//
// Problem. A vocabulary trie has N nodes numbered in post-order (children before parents,
// so parent[n] > n, root = N-1 with parent -1; depth[n] = edges from the root). Leaf position
// pos (the layout's "leaf order", sorted by node) deposits column leaf_token[pos] of a value
// row at node node_of_leaf[pos]. A node's value is a reduction over all deposits in its subtree:
// "sum", "max", or "log_mass" (log of the softmax mass). Output [B, N].
//
// Several rows (the usual case): the depth-stack sweep. In post-order a node's subtree is the
// run of ids that ends at the node, so when the sweep reaches n, every child of n has just
// finished and nothing else has touched depth d+1 since n's first child wrote it (the
// children's own subtrees only touch deeper slots). One accumulator slot per depth therefore
// suffices:
//   v = slot[d+1] (the children of n, combined; the identity if n has none)
//   v (+= | max=) leaf value                  for the leaves of n (node_of_leaf[pos] == n)
//   out[n] = v;  slot[d] = v, or slot[d] (+= | max=) v if n is not its parent's first child
// The "identity if" and "= v if first" cases read a slot that is never written instead
// (run_child_slot and run_join_slot, trie_reduce_cpu.h), so slots are never reset: a store
// per slot and step saved, and no branch.
// The sweep steps over runs rather than nodes: a node with exactly one child and no leaf has
// its child's value, and in post-order that child is n - 1, so chains of such nodes are runs
// of consecutive ids sharing one value (55% of Llama-3's trie nodes are such links). A run
// takes its children from the slot below its first node (depth + 1), joins its siblings in
// the slot of its last node, and its value is then written to all its nodes (expand_runs).
// R <= 8 rows go through one sweep; their stack, (max_depth + 2) x R doubles, stays in L1,
// and each run is done for all R rows at once with vector ops (lanes = rows), so the run
// arrays are read once per R rows. Each row is first read in address order (so that it sits
// in L2) and its leaf values gathered into leaf order; per chunk of runs, those are
// interleaved [leaf][row], and the chunk's run values come back [run][row] and are split
// into one buffer per row for expand_runs. A run's first leaf is taken without a branch.
// Rows are spread over the OpenMP threads in blocks of R >= 2 (run_typed says how).
//
// One row (a lone row, or on a big trie the rows too few to give every thread a block): the
// node range is cut into 4 chunks [a_j, b_j) per thread, swept into one shared N-long
// accumulator (acc[parent[n]] op= acc[n], exact because parent[n] > n); a chunk writes acc[p]
// only for parents p inside itself and sends (p, value) to a short "carry" list otherwise.
// Each thread sweeps its 4 chunks in lockstep, a node of each in turn: one chunk's updates are
// a chain through memory, four independent ones overlap. The carries' p are ancestors of
// a_j - 1 (the chunk boundary), so a sequential fix-up walks each carry up its path through the
// next chunk (adding it to every node on the way, rewriting their outputs), and forwards it.
//
// Team sizes come from team_size() (cpu_threads.h: usable CPUs, contention, the work), unless
// the caller names one. How the work is split (rows into blocks, a row into shares), which
// decides the order of the additions, comes from the usable CPUs alone, so a result does not
// depend on the team that computed it.
//
// "max": empty nodes (no deposits beneath) are 0; they are fixed afterwards from the
// empty_nodes list the caller supplies. "sum" gives 0 and "log_mass" -inf for them anyway.
//
// "log_mass": per row m = max x and total = sum exp(x - m) over the whole row (vectorised
// passes, the second keeping exp(x - m) per column in double); the leaves gather those, and
// log(v / total) is taken by a vectorised pass over each chunk of runs (or of nodes, for one
// row).
// exp(d) underflows/loses precision below d ~ -708, so when a row holds a finite logit with
// d < -600, every node with v < exp(-599) (only a node all of whose leaves are that far
// down, or -inf, can be that small) is recomputed exactly in log space: a second sweep over
// those nodes only, combining (max, scaled sum) pairs. So a node whose leaves all sit at
// log-prob -800 gives -800, and -inf leaves never produce NaN.
//
// All accumulation is in double; each output is rounded once. The vector passes and the
// stacked sweep are compiled twice (x86-64-v3 = AVX2/FMA and baseline; log_mass's exp/log
// passes and sweep a third time, x86-64-v4 = AVX-512), as is expand_runs (AVX2 permutes and
// streaming stores, or a plain loop), and picked at load time, so the binary runs on any
// x86-64.

#include "trie_reduce_cpu.h"

#include <omp.h>

#include "cpu_threads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Function multiversioning (target_clones, target("avx2")) needs GCC and glibc's ifunc.
// -DGF_BASELINE_ONLY builds the baseline versions alone (tests/ops check that build too).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    defined(__GLIBC__) && !defined(GF_BASELINE_ONLY)
#define GF_FMV 1
#define GF_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
// log_mass's exp/log passes and sweep: also AVX-512 (see run_rows)
#define GF_MATH_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GF_FMV 0
#define GF_VECTOR_CLONES
#define GF_MATH_CLONES
#endif

namespace genlm_fast {
namespace cpu {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// log_mass: finite logits below row max + kLowLeaf make a row take the exact pass for
// the nodes with acc < exp(kLowNode).
constexpr double kLowLeaf = -600.0;
constexpr double kLowNode = -599.0;

// ----------------------------------------------------------------------------- scalars

template <class To, class From>
inline To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}

struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const float finite = bit_cast<float>(em << 13) * 0x1p112f;  // normals and subnormals
  const float special = bit_cast<float>((em << 13) | 0x7f800000u);  // inf / nan
  const float f = em >= 0x7c00u ? special : finite;
  return bit_cast<float>(bit_cast<uint32_t>(f) | sign);
}

inline double load(const float* p, int64_t i) { return static_cast<double>(p[i]); }
inline double load(const double* p, int64_t i) { return p[i]; }
inline double load(const F16* p, int64_t i) { return half_to_float(p[i].bits); }
inline double load(const BF16* p, int64_t i) {
  return bit_cast<float>(static_cast<uint32_t>(p[i].bits) << 16);
}

// exp(x) for x <= 0, branch-free (vectorises). x < -708 (and -inf) gives 0: such leaves
// are handled by the exact pass.
__attribute__((always_inline)) inline double exp_nonpos(double x) {
  const double xc = x < -708.0 ? -708.0 : x;
  const double shifter = 0x1.8p52;
  const double kd_s = xc * 1.4426950408889634 + shifter;
  const double kd = kd_s - shifter;
  const double r = (xc - kd * 0x1.62e42fefa39efp-1) - kd * 0x1.abc9e3b39803fp-56;
  // exp(r), |r| <= 0.347: Taylor to degree 13 (truncation ~1e-17 relative)
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const uint64_t scale_bits = (bit_cast<uint64_t>(kd_s) + 1023u) << 52;  // 2^k, k >= -1022
  const double y = p * bit_cast<double>(scale_bits);
  return x < -708.0 ? 0.0 : y;
}

// log(v) for v == 0 (-> -inf) or a normal positive double, branch-free (vectorises).
__attribute__((always_inline)) inline double log_pos(double v) {
  const uint64_t b = bit_cast<uint64_t>(v);
  double m = bit_cast<double>((b & 0x000fffffffffffffull) | 0x3ff0000000000000ull);
  double e = bit_cast<double>(0x4330000000000000ull | (b >> 52)) - (0x1p52 + 1023.0);
  const bool big = m > 1.4142135623730951;
  m = big ? m * 0.5 : m;
  e = big ? e + 1.0 : e;
  const double f = m - 1.0;
  const double s = f / (2.0 + f);
  const double z = s * s;
  // log(m) = 2 atanh(s) = 2s (1 + z/3 + z^2/5 + ...), |s| <= 0.1716, z <= 0.0295; the
  // truncation after z^7 is < 2e-12 relative, far below the float32 output's rounding.
  double p = 1.0 / 15.0;
  p = p * z + 1.0 / 13.0;
  p = p * z + 1.0 / 11.0;
  p = p * z + 1.0 / 9.0;
  p = p * z + 1.0 / 7.0;
  p = p * z + 1.0 / 5.0;
  p = p * z + 1.0 / 3.0;
  const double lm = 2.0 * s + 2.0 * s * z * p;
  const double r = e * 0x1.62e42fefa39efp-1 + (lm + e * 0x1.abc9e3b39803fp-56);
  return v == 0.0 ? -kInf : r;
}

// ----------------------------------------------------------------------------- vector passes

// o[i] = log(a[i] / total), computed as log(a[i] * inv_total) so that masses near 1 keep
// their relative precision (log(a) - log(total) would cancel).
GF_MATH_CLONES void log_ratio(const double* __restrict a, float* __restrict o, int64_t n,
                              double inv_total) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(log_pos(a[i] * inv_total));
}

// max over x[0, n), or NaN if an entry is NaN (read-only)
template <class In>
__attribute__((always_inline)) inline double row_max_t(const In* __restrict x, int64_t n) {
  double m = -kInf;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t c = 0; c < n; ++c) {
    const double v = load(x, c);
    nan |= v != v;
    m = v > m ? v : m;
  }
  return nan ? std::numeric_limits<double>::quiet_NaN() : m;
}
// whether x[0, n) holds a NaN (read-only; a full pass in address order, which also leaves the
// row in cache for the random gather that follows)
template <class In>
__attribute__((always_inline)) inline bool row_has_nan_t(const In* __restrict x, int64_t n) {
  int nan = 0;
#pragma omp simd reduction(| : nan)
  for (int64_t c = 0; c < n; ++c) nan |= x[c] != x[c];
  return nan != 0;
}
// e[c] = exp(x[c] - m) over x[0, n), returning their sum; *nlow = finite entries below
// m + kLowLeaf. (The leaves then gather e: one exp per column, not a second one per leaf.)
template <class In>
__attribute__((always_inline)) inline double row_exp_t(const In* __restrict x, int64_t n,
                                                       double m, double* __restrict e,
                                                       int64_t* nlow) {
  double s = 0.0;
  int64_t low = 0;
#pragma omp simd reduction(+ : s, low)
  for (int64_t c = 0; c < n; ++c) {
    const double d = load(x, c) - m;
    low += (d < kLowLeaf) & (d > -kInf);
    const double v = exp_nonpos(d);
    e[c] = v;
    s += v;
  }
  *nlow = low;
  return s;
}
#define GF_ROW_PASSES(In)                                                                    \
  GF_MATH_CLONES double row_max(const In* x, int64_t n) { return row_max_t(x, n); }          \
  GF_MATH_CLONES double row_exp(const In* x, int64_t n, double m, double* e, int64_t* nlow) { \
    return row_exp_t(x, n, m, e, nlow);                                                      \
  }
GF_ROW_PASSES(float)
GF_ROW_PASSES(double)
GF_ROW_PASSES(F16)
GF_ROW_PASSES(BF16)
#undef GF_ROW_PASSES
GF_VECTOR_CLONES bool row_has_nan(const float* x, int64_t n) { return row_has_nan_t(x, n); }
GF_VECTOR_CLONES bool row_has_nan(const double* x, int64_t n) { return row_has_nan_t(x, n); }

// lv[pos] = x[leaf_token[pos]]: one row's leaf values in leaf order (x: the row's values for
// sum/max, its exp(x - m) for log_mass), so the sweep reads them as a stream.
template <class T>
__attribute__((always_inline)) inline void gather_leaves_t(const T* __restrict x,
                                                           const int32_t* __restrict tok,
                                                           int64_t L, T* __restrict lv) {
  for (int64_t p = 0; p < L; ++p) lv[p] = x[tok[p]];
}
GF_VECTOR_CLONES void gather_leaves(const float* x, const int32_t* tok, int64_t L, float* lv) {
  gather_leaves_t(x, tok, L, lv);
}
GF_VECTOR_CLONES void gather_leaves(const double* x, const int32_t* tok, int64_t L, double* lv) {
  gather_leaves_t(x, tok, L, lv);
}

// ----------------------------------------------------------------------------- the sweep

// for doubles and for Lanes (GCC vectors: `?:` selects per lane)
template <int RED, class T>
__attribute__((always_inline)) inline T combine(T a, T b) {
  if constexpr (RED == kMax) {
    return b > a ? b : a;
  } else {
    return a + b;
  }
}

template <int RED>
constexpr double identity() {
  return RED == kMax ? -kInf : 0.0;
}

// acc[node_of_leaf[pos]] op= src[leaf_token[pos]] for pos in [p0, p1), or op= src[pos] when
// leaf_token is null (values already gathered into leaf order)
template <int RED, class Src>
inline void deposit(double* __restrict acc, const Src* __restrict src, const int32_t* node_of_leaf,
                    const int32_t* leaf_token, int64_t p0, int64_t p1) {
  if (leaf_token == nullptr) {
    for (int64_t pos = p0; pos < p1; ++pos) {
      double& a = acc[node_of_leaf[pos]];
      a = combine<RED>(a, load(src, pos));
    }
    return;
  }
  for (int64_t pos = p0; pos < p1; ++pos) {
    double& a = acc[node_of_leaf[pos]];
    a = combine<RED>(a, load(src, leaf_token[pos]));
  }
}

// Nodes [n0, n1): out[n] = acc[n] (when WRITE) and acc[parent] op= acc[n]; a parent at or
// beyond `bound` (another chunk's node) goes to `carry` instead. acc[-1] must be valid.
template <int RED, bool WRITE, class Out>
inline void sweep(double* __restrict acc, const int32_t* __restrict parent, Out* __restrict out,
                  int32_t n0, int32_t n1, int32_t bound,
                  std::vector<std::pair<int32_t, double>>* carry) {
  for (int32_t n = n0; n < n1; ++n) {
    const double v = acc[n];
    if constexpr (WRITE) out[n] = static_cast<Out>(v);
    const int32_t p = parent[n];
    if (__builtin_expect(p < bound, 1)) {
      acc[p] = combine<RED>(acc[p], v);
    } else {
      carry->emplace_back(p, v);
    }
  }
}

constexpr int kLockstep = 4;  // chunks one thread sweeps at once (sweep_lockstep)
constexpr int64_t kMinLockstepNodes = 4096;  // per chunk, or the thread's share is one chunk

// sweep() over S chunks [nb[k], nb[k + 1]) at once, a node of each in turn. Within a chunk the
// acc[parent] updates form a chain through memory (a store, then the load of the next update
// of the same parent: siblings, single-child links), so one chunk keeps the core waiting;
// S independent chains overlap, so the core has other work while one waits.
template <int RED, bool WRITE, int S, class Out>
inline void sweep_lockstep(double* __restrict acc, const int32_t* __restrict parent,
                           Out* __restrict out, const int32_t* nb,
                           std::vector<std::pair<int32_t, double>>* carry) {
  int32_t lo[S], hi[S], len = nb[1] - nb[0];
#pragma GCC unroll 8
  for (int k = 0; k < S; ++k) {
    lo[k] = nb[k], hi[k] = nb[k + 1];
    len = std::min(len, hi[k] - lo[k]);
  }
  for (int32_t i = 0; i < len; ++i) {
#pragma GCC unroll 8
    for (int k = 0; k < S; ++k) {
      const int32_t n = lo[k] + i;
      const double v = acc[n];
      if constexpr (WRITE) out[n] = static_cast<Out>(v);
      const int32_t p = parent[n];
      if (__builtin_expect(p < hi[k], 1)) {
        acc[p] = combine<RED>(acc[p], v);
      } else {
        carry[k].emplace_back(p, v);
      }
    }
  }
  for (int k = 0; k < S; ++k)
    sweep<RED, WRITE>(acc, parent, out, lo[k] + len, hi[k], hi[k], &carry[k]);
}

// ----------------------------------------------------------------------------- workspace

struct Work {
  std::vector<double> acc;  // N + 1: acc[-1] is the root's dummy parent; or the depth stack
  std::vector<double> e;    // leaf values gathered into leaf order (R x L for R rows)
  std::vector<double> col_exp;  // log_mass: exp(x - m) of one row's columns
  std::vector<double> lanes;  // a chunk's leaf values interleaved [leaf][R], + an identity slot
  std::vector<double> runs;   // a chunk's run values interleaved [run][R]
  std::vector<double> ratio;  // log_mass: R rows of a chunk's run masses, before the log
  std::vector<double> red;    // R rows of a chunk's run values in the output type
  std::vector<double> pm, ps;  // N + 1: exact pass (max, scaled sum)
  double* accp(int64_t N) {
    if (static_cast<int64_t>(acc.size()) < N + 1) acc.resize(N + 1);
    return acc.data() + 1;
  }
  double* ep(size_t n) {  // room for n doubles
    if (e.size() < n) e.resize(n);
    return e.data();
  }
  double* col_exp_p(int64_t C) {
    if (static_cast<int64_t>(col_exp.size()) < C) col_exp.resize(C);
    return col_exp.data();
  }
};

Work& thread_work() {
  static thread_local Work w;
  return w;
}

// Exact log-space recomputation of the low nodes of one log_mass row, after the fast pass
// wrote out[n] = log(v / total): the nodes with v < exp(kLowNode) relative to the row max m,
// i.e. out[n] < kLowNode - log_total, log_total = log(total) = lse - m. Their leaves are all
// far below the row max, or -inf; a low node's children are low too (masses, and their
// rounded logs, only grow towards the root), so pairs flow only between low nodes. out[n] is
// read before it is rewritten. Everything is taken relative to m, never through lse itself:
// at |m| ~ 1e19 a double lse = m + log_total would round log_total away.
template <class In>
void exact_low_pass(const Args& A, const In* x, double m, double log_total, float* out) {
  Work& w = thread_work();
  const int64_t N = A.N;
  if (static_cast<int64_t>(w.pm.size()) < N + 1) {
    w.pm.resize(N + 1);
    w.ps.resize(N + 1);
  }
  double* pm = w.pm.data() + 1;
  double* ps = w.ps.data() + 1;
  const double thr = kLowNode - log_total;
  auto low = [&](int32_t n) { return n >= 0 && out[n] < thr; };
  std::fill(w.pm.begin(), w.pm.begin() + N + 1, -kInf);
  std::fill(w.ps.begin(), w.ps.begin() + N + 1, 0.0);
  auto add = [&](int32_t n, double m2, double s2) {
    if (m2 == -kInf) return;
    double& m = pm[n];
    double& s = ps[n];
    if (m2 > m) {
      s = s * std::exp(m - m2) + s2;  // exp(-inf) = 0 when m is still -inf
      m = m2;
    } else {
      s += s2 * std::exp(m2 - m);
    }
  };
  for (int64_t pos = 0; pos < A.L; ++pos) {
    const int32_t n = A.node_of_leaf[pos];
    if (low(n)) add(n, load(x, A.leaf_token[pos]), 1.0);
  }
  for (int32_t n = 0; n < static_cast<int32_t>(N); ++n) {
    if (!low(n)) continue;
    out[n] = pm[n] == -kInf ? static_cast<float>(-kInf)
                            : static_cast<float>(((pm[n] - m) - log_total) + std::log(ps[n]));
    const int32_t p = A.parent[n];
    if (low(p)) add(p, pm[n], ps[n]);
  }
}

// ----------------------------------------------------------------------------- run expansion

// out[n] = red[run_of[n]] for n in [n0, n1): a chunk's run values written out to its nodes.
// `red` is indexed by absolute run id and readable up to 8 entries past the chunk's last run.
// AVX2: 8 nodes span at most 8 consecutive runs (run_of grows by 0 or 1 per node), so one
// unaligned load of red[run_of[n]..+8) and a lane permute by run_of[n + k] - run_of[n] gives
// the 8 outputs, stored with non-temporal stores (the result is not read again here, so
// its cache lines need not be fetched first). Doubles: 4 nodes at a time, each moved as its
// two 32-bit halves (lanes 2k, 2k + 1 from 2o, 2o + 1).
#if GF_FMV
__attribute__((target("avx2"))) void expand_runs(const float* red, const int32_t* run_of,
                                                 int32_t n0, int32_t n1, float* out) {
  int32_t n = n0;
  for (; n < n1 && (reinterpret_cast<uintptr_t>(out + n) & 31); ++n) out[n] = red[run_of[n]];
  for (; n + 8 <= n1; n += 8) {
    const int32_t base = run_of[n];
    const __m256i lane = _mm256_sub_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run_of + n)), _mm256_set1_epi32(base));
    _mm256_stream_ps(out + n, _mm256_permutevar8x32_ps(_mm256_loadu_ps(red + base), lane));
  }
  for (; n < n1; ++n) out[n] = red[run_of[n]];
  _mm_sfence();  // the streamed stores are visible before the caller (or another thread) reads
}
__attribute__((target("avx2"))) void expand_runs(const double* red, const int32_t* run_of,
                                                 int32_t n0, int32_t n1, double* out) {
  int32_t n = n0;
  for (; n < n1 && (reinterpret_cast<uintptr_t>(out + n) & 31); ++n) out[n] = red[run_of[n]];
  const __m256i one = _mm256_set1_epi64x(1);
  for (; n + 4 <= n1; n += 4) {
    const int32_t base = run_of[n];
    const __m256i o = _mm256_cvtepi32_epi64(_mm_sub_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(run_of + n)), _mm_set1_epi32(base)));
    const __m256i low = _mm256_add_epi64(o, o);  // 2o, in the low 32 bits of each lane
    const __m256i lane = _mm256_or_si256(low, _mm256_slli_epi64(_mm256_add_epi64(low, one), 32));
    const __m256 v = _mm256_castpd_ps(_mm256_loadu_pd(red + base));
    _mm256_stream_pd(out + n, _mm256_castps_pd(_mm256_permutevar8x32_ps(v, lane)));
  }
  for (; n < n1; ++n) out[n] = red[run_of[n]];
  _mm_sfence();
}
__attribute__((target("default")))
#endif
void expand_runs(const float* red, const int32_t* run_of, int32_t n0, int32_t n1, float* out) {
  for (int32_t n = n0; n < n1; ++n) out[n] = red[run_of[n]];
}
#if GF_FMV
__attribute__((target("default")))
#endif
void expand_runs(const double* red, const int32_t* run_of, int32_t n0, int32_t n1, double* out) {
  for (int32_t n = n0; n < n1; ++n) out[n] = red[run_of[n]];
}

// ----------------------------------------------------------------------------- R rows, one thread

constexpr int32_t kRunChunk = 1024;  // runs per chunk: their values are buffered per row

// W <= 4 rows' doubles side by side: one AVX2 register (two SSE2 ones in the baseline
// clone). aligned(8): loaded from and stored to plain double buffers. Wider GCC vectors
// are split badly on AVX2, so 8 rows are two of these.
template <int W>
struct LanesOf {
  typedef double type __attribute__((vector_size(8 * W), aligned(8)));
};
using V4 = LanesOf<4>::type;
typedef float F4 __attribute__((vector_size(16), aligned(4)));
typedef int64_t I4 __attribute__((vector_size(32)));

// 4 consecutive values as doubles, and back (rounded once to the output type)
inline V4 load4(const float* p) { return __builtin_convertvector(*reinterpret_cast<const F4*>(p), V4); }
inline V4 load4(const double* p) { return *reinterpret_cast<const V4*>(p); }
inline void store4(float* p, V4 v) { *reinterpret_cast<F4*>(p) = __builtin_convertvector(v, F4); }
inline void store4(double* p, V4 v) { *reinterpret_cast<V4*>(p) = v; }

// a, b, c, d (the rows of a 4x4 block) become its columns
__attribute__((always_inline)) inline void transpose4(V4& a, V4& b, V4& c, V4& d) {
  const V4 ab_even = __builtin_shuffle(a, b, I4{0, 4, 2, 6}), ab_odd = __builtin_shuffle(a, b, I4{1, 5, 3, 7});
  const V4 cd_even = __builtin_shuffle(c, d, I4{0, 4, 2, 6}), cd_odd = __builtin_shuffle(c, d, I4{1, 5, 3, 7});
  a = __builtin_shuffle(ab_even, cd_even, I4{0, 1, 4, 5});
  b = __builtin_shuffle(ab_odd, cd_odd, I4{0, 1, 4, 5});
  c = __builtin_shuffle(ab_even, cd_even, I4{2, 3, 6, 7});
  d = __builtin_shuffle(ab_odd, cd_odd, I4{2, 3, 6, 7});
}

// dst[k * R + r] = src[r * ld + k] as doubles, k in [0, n): R rows interleaved
template <int R, class T>
__attribute__((always_inline)) inline void interleave(const T* __restrict src, int64_t ld,
                                                      int32_t n, double* __restrict dst) {
  int32_t k = 0;
  if constexpr (R % 4 == 0) {
    for (; k + 4 <= n; k += 4)
      for (int g = 0; g < R; g += 4) {
        V4 a = load4(src + g * ld + k), b = load4(src + (g + 1) * ld + k);
        V4 c = load4(src + (g + 2) * ld + k), d = load4(src + (g + 3) * ld + k);
        transpose4(a, b, c, d);
        double* o = dst + k * R + g;
        *reinterpret_cast<V4*>(o) = a;
        *reinterpret_cast<V4*>(o + R) = b;
        *reinterpret_cast<V4*>(o + 2 * R) = c;
        *reinterpret_cast<V4*>(o + 3 * R) = d;
      }
  }
  for (; k < n; ++k)
    for (int r = 0; r < R; ++r) dst[k * R + r] = static_cast<double>(src[r * ld + k]);
}

// dst[r * ld + k] = src[k * R + r] rounded to T, k in [0, n): the inverse of interleave
template <int R, class T>
__attribute__((always_inline)) inline void deinterleave(const double* __restrict src, int32_t n,
                                                        T* __restrict dst, int64_t ld) {
  int32_t k = 0;
  if constexpr (R % 4 == 0) {
    for (; k + 4 <= n; k += 4)
      for (int g = 0; g < R; g += 4) {
        const double* s = src + k * R + g;
        V4 a = *reinterpret_cast<const V4*>(s), b = *reinterpret_cast<const V4*>(s + R);
        V4 c = *reinterpret_cast<const V4*>(s + 2 * R), d = *reinterpret_cast<const V4*>(s + 3 * R);
        transpose4(a, b, c, d);
        store4(dst + g * ld + k, a);
        store4(dst + (g + 1) * ld + k, b);
        store4(dst + (g + 2) * ld + k, c);
        store4(dst + (g + 3) * ld + k, d);
      }
  }
  for (; k < n; ++k)
    for (int r = 0; r < R; ++r) dst[r * ld + k] = static_cast<T>(src[k * R + r]);
}

// Rows [r0, r0 + R) in one depth-stack sweep over the runs (see the top of the file).
// Each row's leaf values are first gathered into leaf order (exp applied for log_mass).
// Per chunk of runs, the chunk's leaves are interleaved [leaf][R] as doubles, so the sweep
// does each run for all R rows with a few vector ops (G groups of W lanes); the chunk's run
// values come out interleaved [run][R] and are split back into one buffer per row, rounded
// (for log_mass, after one vectorised log pass per row), which expand_runs writes out to the
// chunk's nodes. Returns the number of leading rows that succeeded (< R: that row failed its
// check, see trie_reduce_cpu.h).
template <int RED, int R, class In, class Out>
__attribute__((always_inline)) inline int run_rows_stacked_t(const Args& A, int64_t r0) {
  constexpr int SRED = RED == kLogMass ? kSum : RED;
  constexpr double id = identity<SRED>();
  constexpr int W = R < 4 ? R : 4, G = R / W;
  using V = typename LanesOf<W>::type;
  const int64_t L = A.L;
  using Leaf = std::conditional_t<RED == kLogMass, double, In>;
  Work& w = thread_work();
  Leaf* lv_all = reinterpret_cast<Leaf*>(w.ep(static_cast<size_t>(R) * L));
  Out* o[R];
  double inv_total[R];
  double shift[R];
  int64_t nlow[R];
  for (int r = 0; r < R; ++r) {
    const In* x = static_cast<const In*>(A.values) + (r0 + r) * A.C;
    Leaf* dst = lv_all + r * L;
    o[r] = static_cast<Out*>(A.out) + (r0 + r) * A.N;
    // the row's checks read it in address order, which leaves it in cache for the random
    // reads of the gather
    if constexpr (RED == kLogMass) {
      const double m = row_max(x, A.C);
      if (!(m > -kInf && m < kInf)) return r;
      double* e = w.col_exp_p(A.C);
      const double total = row_exp(x, A.C, m, e, &nlow[r]);
      shift[r] = m;
      inv_total[r] = 1.0 / total;
      gather_leaves(e, A.leaf_token, L, dst);
    } else {
      if (row_has_nan(x, A.C)) return r;
      gather_leaves(x, A.leaf_token, L, dst);
    }
  }
  if (L == 0) {  // no leaves: every node is empty
    for (int r = 0; r < R; ++r)
      std::fill(o[r], o[r] + A.N, static_cast<Out>(RED == kLogMass ? -kInf : 0.0));
    return R;
  }
  // slots 0..max_depth are written before they are read; slot max_depth + 1 is the identity
  const size_t slots = (static_cast<size_t>(A.max_depth) + 2) * R;
  if (w.acc.size() < slots) w.acc.resize(slots);
  double* stack = w.acc.data();
  std::fill(stack + slots - R, stack + slots, id);
  constexpr size_t kRow = kRunChunk + 8;  // + 8: expand_runs may read 8 past a chunk's end
  if (w.runs.size() < R * kRow) w.runs.resize(R * kRow);
  if (RED == kLogMass && w.ratio.size() < R * kRow) w.ratio.resize(R * kRow);
  if (w.red.size() < R * kRow) w.red.resize(R * kRow);
  V* __restrict run_lanes = reinterpret_cast<V*>(w.runs.data());  // [kRunChunk][G]
  double* __restrict run_value = w.ratio.data();  // [R][kRow], log_mass: masses before the log
  Out* __restrict red = reinterpret_cast<Out*>(w.red.data());  // [R][kRow], the rounded values
  const int32_t* __restrict run_depth = A.run_depth;
  const int32_t* __restrict run_child_slot = A.run_child_slot;
  const int32_t* __restrict run_join_slot = A.run_join_slot;
  const int32_t* __restrict run_leaf = A.run_leaf;
  const int32_t num_runs = static_cast<int32_t>(A.num_runs);
  for (int32_t i0 = 0; i0 < num_runs; i0 += kRunChunk) {
    const int32_t i1 = std::min(num_runs, i0 + kRunChunk);
    // the chunk's leaves [l0, l1), interleaved; slot l1 - l0 holds the identity
    const int32_t l0 = run_leaf[i0], nl = run_leaf[i1] - l0;
    if (w.lanes.size() < static_cast<size_t>(nl + 1) * R) w.lanes.resize((nl + 1) * R);
    double* __restrict lanes = w.lanes.data();
    interleave<R>(lv_all + l0, L, nl, lanes);
    for (int r = 0; r < R; ++r) lanes[nl * R + r] = id;
    const V* __restrict leaf = reinterpret_cast<const V*>(lanes);
    for (int32_t i = i0; i < i1; ++i) {
      // (no __restrict: `join` is `here` unless the run is a first child)
      V* here = reinterpret_cast<V*>(stack + static_cast<size_t>(run_depth[i]) * R);
      const V* join = reinterpret_cast<const V*>(stack + static_cast<size_t>(run_join_slot[i]) * R);
      const V* __restrict below =
          reinterpret_cast<const V*>(stack + static_cast<size_t>(run_child_slot[i]) * R);
      // most runs have 0 or 1 leaves: the first is taken without a branch (from the identity
      // slot when there is none), further ones (duplicates) in a loop
      const int32_t lb = run_leaf[i] - l0, le = run_leaf[i + 1] - l0;
      const int32_t first = le > lb ? lb : nl;
      V v[G];
      for (int g = 0; g < G; ++g) {
        v[g] = combine<SRED>(below[g], leaf[first * G + g]);
      }
      for (int32_t p = lb + 1; p < le; ++p)
        for (int g = 0; g < G; ++g) v[g] = combine<SRED>(v[g], leaf[p * G + g]);
      for (int g = 0; g < G; ++g) {
        here[g] = combine<SRED>(join[g], v[g]);
        run_lanes[(i - i0) * G + g] = v[g];
      }
    }
    // split the interleaved run values into one buffer per row
    if constexpr (RED == kLogMass) {
      deinterleave<R>(w.runs.data(), i1 - i0, run_value, kRow);
    } else {
      deinterleave<R>(w.runs.data(), i1 - i0, red, kRow);
    }
    const int32_t n0 = i0 == 0 ? 0 : A.run_end[i0 - 1], n1 = A.run_end[i1 - 1];
    for (int r = 0; r < R; ++r) {
      Out* row_red = red + r * kRow;
      if constexpr (RED == kLogMass)
        log_ratio(run_value + r * kRow, row_red, i1 - i0, inv_total[r]);
      expand_runs(row_red - i0, A.run_of, n0, n1, o[r]);
    }
  }
  if constexpr (RED == kLogMass) {
    for (int r = 0; r < R; ++r) {
      if (!nlow[r]) continue;
      const In* x = static_cast<const In*>(A.values) + (r0 + r) * A.C;
      exact_low_pass(A, x, shift[r], -std::log(inv_total[r]), reinterpret_cast<float*>(o[r]));
    }
  }
  return R;
}

// The sweep's clones. log_mass (double lanes) also gets an x86-64-v4 (AVX-512) one, which
// gains on its double lanes; the same clone made sum/max (float lanes) slower, so they keep
// AVX2 (`python -m bench.kernels` on an AVX-512 CPU compares them).
template <int RED, int R, class In, class Out>
GF_VECTOR_CLONES int run_rows_stacked(const Args& A, int64_t r0) {
  return run_rows_stacked_t<RED, R, In, Out>(A, r0);
}
template <int R, class In>
GF_MATH_CLONES int run_rows_stacked_log_mass(const Args& A, int64_t r0) {
  return run_rows_stacked_t<kLogMass, R, In, float>(A, r0);
}
template <int RED, int R, class In, class Out>
int run_rows(const Args& A, int64_t r0) {
  if constexpr (RED == kLogMass) {
    return run_rows_stacked_log_mass<R, In>(A, r0);
  } else {
    return run_rows_stacked<RED, R, In, Out>(A, r0);
  }
}

template <int RED, class In, class Out>
bool run_row_chunked(const Args& A, int64_t r, int shares, int team);

// the stacked sweep's block sizes: the largest of 8 / 4 / 2 / 1 rows not above `rows` (>= 1)
inline int block_rows(int64_t rows) { return rows >= 8 ? 8 : rows >= 4 ? 4 : rows >= 2 ? 2 : 1; }

// Rows [r0, r0 + count), count <= 8, as blocks of 8/4/2/1; returns the first failed row or -1.
// A last single row takes the one-row sweep on this thread unless `lone_stacked`: stacked,
// its run arrays are read for one row only, which costs more than sweeping the nodes. (A row gives
// the same bits in a block of any size, not in the one-row sweep.)
template <int RED, class In, class Out>
int64_t run_block(const Args& A, int64_t r0, int count, bool lone_stacked) {
  while (count > 0) {
    if (count == 1 && !lone_stacked) return run_row_chunked<RED, In, Out>(A, r0, 1, 1) ? -1 : r0;
    const int R = block_rows(count);
    const int done = R == 8   ? run_rows<RED, 8, In, Out>(A, r0)
                     : R == 4 ? run_rows<RED, 4, In, Out>(A, r0)
                     : R == 2 ? run_rows<RED, 2, In, Out>(A, r0)
                              : run_rows<RED, 1, In, Out>(A, r0);
    if (done < R) return r0 + done;
    r0 += R;
    count -= R;
  }
  return -1;
}

// ----------------------------------------------------------------------------- one row, all threads

// Row r, its nodes in `shares` shares of kLockstep chunks each, swept by a team of `team`
// threads (a thread takes every team-th share). The shares alone decide the order of the
// additions, so the result does not depend on the team.
template <int RED, class In, class Out>
bool run_row_chunked(const Args& A, int64_t r, int shares, int team) {
  const int T = shares * kLockstep;  // chunks
  const In* x = static_cast<const In*>(A.values) + r * A.C;
  Out* o = static_cast<Out*>(A.out) + r * A.N;
  const int32_t N = static_cast<int32_t>(A.N);
  Work& w = thread_work();  // the calling thread's buffers, shared by the team
  double* acc = w.accp(N);
  double* lv = RED == kLogMass ? w.ep(A.L) : nullptr;  // exp(x - m) in leaf order
  double* e = RED == kLogMass ? w.col_exp_p(A.C) : nullptr;  // exp(x - m) by column
  acc[-1] = identity<RED>();

  // share u of the nodes, [a, b), as chunks u * kLockstep .. + kLockstep - 1: equal
  // parts, or (a share too small to be worth it) all in the first, the others empty. A chunk
  // boundary changes the order of the additions (a carry joins its ancestors apart from its
  // siblings), so a small trie is summed in plain post-order, as on one thread.
  std::vector<int32_t> nb(T + 1);
  std::vector<int64_t> pb(T + 1);
  for (int u = 0; u < shares; ++u) {
    const int64_t a = A.N * u / shares, b = A.N * (u + 1) / shares;
    const bool split = b - a >= kLockstep * kMinLockstepNodes;
    for (int k = 0; k < kLockstep; ++k)
      nb[u * kLockstep + k] = static_cast<int32_t>(split ? a + (b - a) * k / kLockstep : k ? b : a);
  }
  nb[T] = static_cast<int32_t>(A.N);
  for (int j = 0; j <= T; ++j)
    pb[j] = std::lower_bound(A.node_of_leaf, A.node_of_leaf + A.L, nb[j]) - A.node_of_leaf;
  std::vector<std::vector<std::pair<int32_t, double>>> carries(T);
  std::vector<double> part_max(T, -kInf), part_sum(T, 0.0);
  std::vector<int64_t> part_low(T, 0);
  std::vector<char> part_nan(T, 0);
  double m = 0.0, total = 1.0;
  int64_t nlow = 0;
  bool ok = true;

  // the row's checks and (log_mass) its max and sum of exp, by share of the columns: share
  // u's columns [col(u), col(u + 1)), its parts added in share order whatever the team
  auto col = [&](int u) { return A.C * u / shares; };
#pragma omp parallel num_threads(team)
  {
    const int nt = omp_get_num_threads();
    const int t = omp_get_thread_num();
    if constexpr (RED == kLogMass) {
      for (int u = t; u < shares; u += nt)
        part_max[u] = row_max(x + col(u), col(u + 1) - col(u));  // NaN when it holds one
#pragma omp barrier
      double mm = -kInf;
      bool row_ok = true;
      for (int u = 0; u < shares; ++u) {
        mm = part_max[u] > mm ? part_max[u] : mm;
        row_ok = row_ok && part_max[u] == part_max[u];
      }
      row_ok = row_ok && mm > -kInf && mm < kInf;
      for (int u = t; row_ok && u < shares; u += nt)
        part_sum[u] = row_exp(x + col(u), col(u + 1) - col(u), mm, e + col(u), &part_low[u]);
#pragma omp barrier
#pragma omp single
      {
        m = mm;
        ok = row_ok;
        total = 0.0;
        for (int u = 0; u < shares; ++u) {
          total += part_sum[u];
          nlow += part_low[u];
        }
      }  // implicit barrier
    } else {
      for (int u = t; u < shares; u += nt)
        part_nan[u] = row_has_nan(x + col(u), col(u + 1) - col(u));
#pragma omp barrier
#pragma omp single
      for (int u = 0; u < shares; ++u) ok = ok && !part_nan[u];
      // implicit barrier
    }
    for (int u = t; ok && u < shares; u += nt) {  // its shares
      const int j = u * kLockstep;  // its chunks: j .. j + kLockstep - 1
      std::fill(acc + nb[j], acc + nb[j + kLockstep], identity<RED>());
      if constexpr (RED == kLogMass) {
        gather_leaves(e, A.leaf_token + pb[j], pb[j + kLockstep] - pb[j], lv + pb[j]);
        deposit<kSum>(acc, lv, A.node_of_leaf, static_cast<const int32_t*>(nullptr), pb[j],
                      pb[j + kLockstep]);
        sweep_lockstep<kSum, false, kLockstep>(acc, A.parent, static_cast<float*>(nullptr),
                                               nb.data() + j, &carries[j]);
      } else {
        deposit<RED>(acc, x, A.node_of_leaf, A.leaf_token, pb[j], pb[j + kLockstep]);
        sweep_lockstep<RED, true, kLockstep>(acc, A.parent, o, nb.data() + j, &carries[j]);
      }
    }
  }
  if (!ok) return false;

  // fix-up: walk every carry up through the following chunks
  std::vector<std::pair<int32_t, double>> carry = std::move(carries[0]), next;
  for (int j = 1; j < T; ++j) {
    const int32_t b = nb[j + 1];
    next.clear();
    for (const auto& c : carry) {
      int32_t q = c.first;
      if (q >= b) {
        next.push_back(c);
        continue;
      }
      while (q >= 0 && q < b) {
        acc[q] = combine<RED == kLogMass ? kSum : RED>(acc[q], c.second);
        if constexpr (RED != kLogMass) o[q] = static_cast<Out>(acc[q]);
        q = A.parent[q];
      }
      if (q >= b) next.emplace_back(q, c.second);
    }
    next.insert(next.end(), carries[j].begin(), carries[j].end());
    carry.swap(next);
  }

  if constexpr (RED == kLogMass) {
#pragma omp parallel num_threads(team)
    {
      const int nt = omp_get_num_threads();
      const int t = omp_get_thread_num();
      const int64_t n0 = A.N * t / nt, n1 = A.N * (t + 1) / nt;
      log_ratio(acc + n0, reinterpret_cast<float*>(o) + n0, n1 - n0, 1.0 / total);
    }
    if (nlow) exact_low_pass(A, x, m, std::log(total), reinterpret_cast<float*>(o));
  }
  return true;
}

// ----------------------------------------------------------------------------- driver

// Empty nodes are 0 under max; returns the driver's status.
template <int RED, class Out>
int64_t finish(const Args& A, int64_t first_bad) {
  if (first_bad >= 0) return first_bad + 1;
  if constexpr (RED == kMax) {
    Out* o = static_cast<Out*>(A.out);
    for (int64_t r = 0; r < A.B; ++r)
      for (int64_t i = 0; i < A.E; ++i) o[r * A.N + A.empty_nodes[i]] = Out(0);
  }
  return 0;
}

template <int RED, class In, class Out>
int64_t run_typed(const Args& A) {
  const int64_t B = A.B;
  // memory traffic: every row read and its output written, the layout's arrays read
  const int64_t bytes = B * (A.C * static_cast<int64_t>(sizeof(In)) +
                             A.N * static_cast<int64_t>(sizeof(Out))) +
                        (A.L + A.N) * static_cast<int64_t>(2 * sizeof(int32_t));
  int T = A.num_threads > 0 ? A.num_threads : team_size(bytes);
  T = std::max(1, T);
  // Rows go in blocks of up to 8 rows stacked in one sweep (the cheapest per row), a block per
  // thread at a time. Where a row can have all threads (a big trie: >= 16384 nodes per
  // thread), the rows too few to give each thread a block of two go one by one with all
  // threads on each, rather than as a last round of blocks that leaves threads idle; a single
  // row in a block takes the one-row sweep too (run_block).
  // A row's bits depend on which of the two sweeps it takes and, in the one-row sweep, on
  // how its nodes are shared, not on the size of its block: so which rows are swept alone,
  // and in how many shares, is decided for the usable CPUs P (fixed for the process), and
  // only the blocks follow the team T that runs them (other processes' load): the results
  // depend on the rows alone.
  const int P = A.num_threads > 0 ? A.num_threads : usable_cpus();
  const int shares = static_cast<int>(std::min<int64_t>(P, A.N / 16384));
  const bool rows_apart = shares >= 2 && !omp_in_parallel();  // a row can use every thread
  std::vector<std::pair<int64_t, int>> jobs;  // blocks: (first row, rows)
  int64_t stacked = B;  // rows [0, stacked) in blocks, the rest one by one
  if (rows_apart) {
    // the rows P threads would take in rounds of blocks of at least two
    stacked = 0;
    while (B - stacked >= 2 * P) {
      const int64_t share = (B - stacked) / P;
      stacked += P * block_rows(share);  // share >= 2
    }
    // and the team's rounds over them: each round's blocks as large as the rows left allow
    for (int64_t done = 0; done < stacked;) {
      const int64_t share = (stacked - done) / T;
      const int block = block_rows(share);
      for (int t = 0; t < T && done < stacked; ++t, done += block)
        jobs.emplace_back(done, block);
    }
  } else if (B > 1 || omp_in_parallel()) {
    const int block = block_rows((B + P - 1) / P);
    for (int64_t r = 0; r < B; r += block)
      jobs.emplace_back(r, static_cast<int>(std::min<int64_t>(block, B - r)));
  } else {
    stacked = 0;  // one row
  }
  const int64_t count = static_cast<int64_t>(jobs.size());
  std::vector<int64_t> failed(count, -1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(T) if (count > 1 && T > 1)
  for (int64_t j = 0; j < count; ++j)
    failed[j] = run_block<RED, In, Out>(A, jobs[j].first, jobs[j].second, rows_apart);
  for (int64_t j = 0; j < count; ++j)
    if (failed[j] >= 0) return finish<RED, Out>(A, failed[j]);
  const int row_shares = std::max(1, shares);
  for (int64_t r = stacked; r < B; ++r)
    if (!run_row_chunked<RED, In, Out>(A, r, row_shares, std::min(T, row_shares)))
      return finish<RED, Out>(A, r);
  return finish<RED, Out>(A, -1);
}

}  // namespace

int64_t trie_reduce(const Args& A) {
  if (A.B == 0 || A.N == 0) return 0;
  if (A.reduction == kLogMass) {
    switch (A.in_type) {
      case kF32: return run_typed<kLogMass, float, float>(A);
      case kF64: return run_typed<kLogMass, double, float>(A);
      case kF16: return run_typed<kLogMass, F16, float>(A);
      default: return run_typed<kLogMass, BF16, float>(A);
    }
  }
  if (A.in_type == kF64) {
    return A.reduction == kSum ? run_typed<kSum, double, double>(A)
                               : run_typed<kMax, double, double>(A);
  }
  if (A.out_double) {  // float32 values, float64 result (genlm's float64 tries)
    return A.reduction == kSum ? run_typed<kSum, float, double>(A)
                               : run_typed<kMax, float, double>(A);
  }
  return A.reduction == kSum ? run_typed<kSum, float, float>(A) : run_typed<kMax, float, float>(A);
}

}  // namespace cpu
}  // namespace genlm_fast
