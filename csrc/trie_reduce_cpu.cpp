// CPU trie reduction kernel (C++17 + OpenMP; no torch headers, see bindings.cpp).
//
// Problem. A vocabulary trie has N nodes numbered in post-order (children before parents,
// so parent[n] > n, root = N-1 with parent -1). Leaf position pos (the layout's "leaf
// order", sorted by node) deposits column leaf_token[pos] of a value row at node
// leaf_node[pos]. A node's value is a reduction over all deposits in its subtree: "sum",
// "max", or "log_mass" (log of the softmax mass). Output [B, N].
//
// Algorithm: one bottom-up sweep over the post-order per row, into a double accumulator.
//   acc[0..N) = identity (0, or -inf for max)
//   acc[leaf_node[pos]] (+= | max=) f(x[row, leaf_token[pos]])        for every leaf pos
//   for n = 0 .. N-1 (increasing id): out[n] = acc[n]; acc[parent[n]] (+= | max=) acc[n]
// Because parent[n] > n, acc[n] is final when n is reached. The sweep has no unpredictable
// branch (acc[-1] is a dummy slot that receives the root), streams parent/out once, and touches
// acc mostly near the current node; it runs at ~1 ns per node. Rows are spread over the
// OpenMP threads, each with a thread-local acc; sum/max rows go two at a time through one
// sweep (acc interleaved per node) when there are at least two rows per thread.
//
// Fewer rows than threads (B = 1): the node range is cut into T chunks [a_j, b_j) swept in
// parallel into one shared acc; a chunk writes acc[p] only for parents p inside itself and
// sends (p, value) to a short "carry" list otherwise. Those p are ancestors of a_j - 1 (the
// chunk boundary), so a sequential fix-up walks each carry up its path through the next
// chunk (adding it to every node on the way, rewriting their outputs), and forwards it.
//
// "max": empty nodes (no deposits beneath) are 0; they are fixed afterwards from the
// empty_nodes list the caller supplies. "sum" gives 0 and "log_mass" -inf for them anyway.
//
// "log_mass": per row x -> e (double), m = max e, e = exp(e - m) (vectorised exp),
// total = sum e; the sweep sums e in double; out = log(acc / total) (vectorised log).
// exp(d) underflows/loses precision below d ~ -708, so when a row holds a finite logit with
// d < -600, every node with acc < exp(-599) (only a node all of whose leaves are that far
// down, or -inf, can be that small) is recomputed exactly in log space: a second sweep over
// those nodes only, combining (max, scaled sum) pairs. So a node whose leaves all sit at log-prob -800
// gives -800, and -inf leaves never produce NaN.
//
// All accumulation is in double; each output is rounded once. The exp/log passes are
// compiled twice (x86-64-v3 = AVX2/FMA and baseline) and picked at load time, so the
// binary runs on any x86-64.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    defined(__GLIBC__)  // target_clones needs ifunc
#define GF_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GF_VECTOR_CLONES
#endif

namespace genlm_fast {
namespace cpu {

enum Reduction : int { kSum = 0, kMax = 1, kLogMass = 2 };
enum InType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

struct Args {
  const void* values;  // [B, C] contiguous
  int in_type;
  int64_t B, C;
  const int32_t* parent;      // [N] parent id (> n), -1 for the root
  const int32_t* leaf_node;   // [L] node of each leaf position, non-decreasing
  const int32_t* leaf_token;  // [L] value column of each leaf position
  int64_t N, L;
  const int32_t* empty_nodes;  // [E] nodes with no leaves
  int64_t E;
  void* out;  // [B, N] float32, or float64 when out_double
  bool out_double;
  int reduction;
  int num_threads;
};

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

// e[c] = x[c] as double for c in [0, n); returns max.
template <class In>
__attribute__((always_inline)) inline double load_row_max_t(const In* __restrict x,
                                                            double* __restrict e, int64_t n) {
  double m = -kInf;
#pragma omp simd reduction(max : m)
  for (int64_t c = 0; c < n; ++c) {
    const double v = load(x, c);
    e[c] = v;
    m = v > m ? v : m;
  }
  return m;
}
GF_VECTOR_CLONES double load_row_max(const float* x, double* e, int64_t n) {
  return load_row_max_t(x, e, n);
}
GF_VECTOR_CLONES double load_row_max(const double* x, double* e, int64_t n) {
  return load_row_max_t(x, e, n);
}
GF_VECTOR_CLONES double load_row_max(const F16* x, double* e, int64_t n) {
  return load_row_max_t(x, e, n);
}
GF_VECTOR_CLONES double load_row_max(const BF16* x, double* e, int64_t n) {
  return load_row_max_t(x, e, n);
}

// e[c] = exp(e[c] - m) in place; returns sum; *nlow = finite entries below m + kLowLeaf.
GF_VECTOR_CLONES double exp_shift_sum(double* __restrict e, int64_t n, double m, int64_t* nlow) {
  double s = 0.0;
  int64_t low = 0;
#pragma omp simd reduction(+ : s, low)
  for (int64_t c = 0; c < n; ++c) {
    const double d = e[c] - m;
    low += (d < kLowLeaf) & (d > -kInf);
    const double v = exp_nonpos(d);
    e[c] = v;
    s += v;
  }
  *nlow = low;
  return s;
}

// o[i] = log(a[i] / total), computed as log(a[i] * inv_total) so that masses near 1 keep
// their relative precision (log(a) - log(total) would cancel).
GF_VECTOR_CLONES void log_ratio(const double* __restrict a, float* __restrict o, int64_t n,
                                double inv_total) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(log_pos(a[i] * inv_total));
}

// ----------------------------------------------------------------------------- the sweep

template <int RED>
__attribute__((always_inline)) inline double combine(double a, double b) {
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

// acc[leaf_node[pos]] op= value(leaf_token[pos]) for pos in [p0, p1)
template <int RED, class Src>
inline void deposit(double* __restrict acc, const Src* __restrict src, const int32_t* leaf_node,
                    const int32_t* leaf_token, int64_t p0, int64_t p1) {
  for (int64_t pos = p0; pos < p1; ++pos) {
    double& a = acc[leaf_node[pos]];
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

// ----------------------------------------------------------------------------- workspace

struct Work {
  std::vector<double> acc;  // N + 1: acc[-1] is the root's dummy parent
  std::vector<double> e;    // C: log_mass leaf masses
  std::vector<double> pm, ps;  // N + 1: exact pass (max, scaled sum)
  double* accp(int64_t N) {
    if (static_cast<int64_t>(acc.size()) < N + 1) acc.resize(N + 1);
    return acc.data() + 1;
  }
  double* ep(int64_t C) {
    if (static_cast<int64_t>(e.size()) < C) e.resize(C);
    return e.data();
  }
};

Work& thread_work() {
  static thread_local Work w;
  return w;
}

// Exact log-space recomputation of the low nodes of one log_mass row: nodes with
// acc < exp(kLowNode) (acc relative to the row max). Their leaves are all far below the row
// max, or -inf; a low node's children are low, so pairs flow only between low nodes.
template <class In>
void exact_low_pass(const Args& A, const In* x, double lse, const double* acc, float* out) {
  Work& w = thread_work();
  const int64_t N = A.N;
  if (static_cast<int64_t>(w.pm.size()) < N + 1) {
    w.pm.resize(N + 1);
    w.ps.resize(N + 1);
  }
  double* pm = w.pm.data() + 1;
  double* ps = w.ps.data() + 1;
  const double thr = std::exp(kLowNode);
  auto low = [&](int32_t n) { return n >= 0 && acc[n] < thr; };
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
    const int32_t n = A.leaf_node[pos];
    if (low(n)) add(n, load(x, A.leaf_token[pos]), 1.0);
  }
  for (int32_t n = 0; n < static_cast<int32_t>(N); ++n) {
    if (!low(n)) continue;
    out[n] = pm[n] == -kInf ? static_cast<float>(-kInf)
                            : static_cast<float>((pm[n] - lse) + std::log(ps[n]));
    const int32_t p = A.parent[n];
    if (low(p)) add(p, pm[n], ps[n]);
  }
}

// ----------------------------------------------------------------------------- one row, one thread

template <int RED, class In, class Out>
bool run_row(const Args& A, int64_t r) {
  const In* x = static_cast<const In*>(A.values) + r * A.C;
  Out* o = static_cast<Out*>(A.out) + r * A.N;
  const int32_t N = static_cast<int32_t>(A.N);
  Work& w = thread_work();
  double* acc = w.accp(N);
  std::fill(acc - 1, acc + N, identity<RED>());
  if constexpr (RED != kLogMass) {
    deposit<RED>(acc, x, A.leaf_node, A.leaf_token, 0, A.L);
    sweep<RED, true>(acc, A.parent, o, 0, N, N, nullptr);
    return true;
  } else {
    double* e = w.ep(A.C);
    const double m = load_row_max(x, e, A.C);
    if (!(m > -kInf && m < kInf)) return false;
    int64_t nlow = 0;
    const double total = exp_shift_sum(e, A.C, m, &nlow);
    deposit<kSum>(acc, e, A.leaf_node, A.leaf_token, 0, A.L);
    sweep<kSum, false>(acc, A.parent, static_cast<float*>(nullptr), 0, N, N, nullptr);
    log_ratio(acc, o, N, 1.0 / total);
    if (nlow) exact_low_pass(A, x, m + std::log(total), acc, o);
    return true;
  }
}

// Two rows of sum/max in one sweep (acc interleaved [node][2]): the per-node work and its
// dependency chains are shared, ~15% faster per row than two single-row sweeps.
template <int RED, class In, class Out>
void run_row_pair(const Args& A, int64_t r) {
  static_assert(RED != kLogMass, "pairs are for sum/max");
  const In* x0 = static_cast<const In*>(A.values) + r * A.C;
  const In* x1 = x0 + A.C;
  Out* o0 = static_cast<Out*>(A.out) + r * A.N;
  Out* o1 = o0 + A.N;
  const int32_t N = static_cast<int32_t>(A.N);
  Work& w = thread_work();
  if (static_cast<int64_t>(w.acc.size()) < 2 * (A.N + 1)) w.acc.resize(2 * (A.N + 1));
  double* __restrict acc = w.acc.data() + 2;  // acc[2n + k]; node -1 is the dummy
  std::fill(acc - 2, acc + 2 * static_cast<int64_t>(N), identity<RED>());
  const int32_t* __restrict leaf_node = A.leaf_node;
  const int32_t* __restrict leaf_token = A.leaf_token;
  for (int64_t pos = 0; pos < A.L; ++pos) {
    double* a = acc + 2 * static_cast<int64_t>(leaf_node[pos]);
    const int32_t c = leaf_token[pos];
    a[0] = combine<RED>(a[0], load(x0, c));
    a[1] = combine<RED>(a[1], load(x1, c));
  }
  const int32_t* __restrict parent = A.parent;
  for (int32_t n = 0; n < N; ++n) {
    const double v0 = acc[2 * static_cast<int64_t>(n)], v1 = acc[2 * static_cast<int64_t>(n) + 1];
    o0[n] = static_cast<Out>(v0);
    o1[n] = static_cast<Out>(v1);
    double* a = acc + 2 * static_cast<int64_t>(parent[n]);
    a[0] = combine<RED>(a[0], v0);
    a[1] = combine<RED>(a[1], v1);
  }
}

// ----------------------------------------------------------------------------- one row, T threads

template <int RED, class In, class Out>
bool run_row_chunked(const Args& A, int64_t r, int T) {
  const In* x = static_cast<const In*>(A.values) + r * A.C;
  Out* o = static_cast<Out*>(A.out) + r * A.N;
  const int32_t N = static_cast<int32_t>(A.N);
  Work& w = thread_work();  // the calling thread's buffers, shared by the team
  double* acc = w.accp(N);
  double* e = RED == kLogMass ? w.ep(A.C) : nullptr;
  acc[-1] = identity<RED>();

  std::vector<int32_t> nb(T + 1);
  std::vector<int64_t> pb(T + 1);
  for (int j = 0; j <= T; ++j) {
    nb[j] = static_cast<int32_t>((A.N * j) / T);
    pb[j] = std::lower_bound(A.leaf_node, A.leaf_node + A.L, nb[j]) - A.leaf_node;
  }
  std::vector<std::vector<std::pair<int32_t, double>>> carries(T);
  std::vector<double> part_max(T, -kInf), part_sum(T, 0.0);
  std::vector<int64_t> part_low(T, 0);
  double m = 0.0, total = 1.0;
  int64_t nlow = 0;
  bool ok = true;

#pragma omp parallel num_threads(T)
  {
    const int nt = omp_get_num_threads();
    const int t = omp_get_thread_num();
    if constexpr (RED == kLogMass) {
      const int64_t c0 = A.C * t / nt, c1 = A.C * (t + 1) / nt;
      part_max[t] = load_row_max(x + c0, e + c0, c1 - c0);
#pragma omp barrier
      double mm = -kInf;
      for (int i = 0; i < nt; ++i) mm = part_max[i] > mm ? part_max[i] : mm;
      const bool row_ok = mm > -kInf && mm < kInf;
      if (row_ok) part_sum[t] = exp_shift_sum(e + c0, c1 - c0, mm, &part_low[t]);
#pragma omp barrier
#pragma omp single
      {
        m = mm;
        ok = row_ok;
        total = 0.0;
        for (int i = 0; i < nt; ++i) {
          total += part_sum[i];
          nlow += part_low[i];
        }
      }  // implicit barrier
    }
    if (ok) {
      for (int j = t; j < T; j += nt) {  // normally one chunk per thread
        std::fill(acc + nb[j], acc + nb[j + 1], identity<RED>());
        if constexpr (RED == kLogMass) {
          deposit<kSum>(acc, e, A.leaf_node, A.leaf_token, pb[j], pb[j + 1]);
          sweep<kSum, false>(acc, A.parent, static_cast<float*>(nullptr), nb[j], nb[j + 1],
                             nb[j + 1], &carries[j]);
        } else {
          deposit<RED>(acc, x, A.leaf_node, A.leaf_token, pb[j], pb[j + 1]);
          sweep<RED, true>(acc, A.parent, o, nb[j], nb[j + 1], nb[j + 1], &carries[j]);
        }
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
#pragma omp parallel num_threads(T)
    {
      const int nt = omp_get_num_threads();
      const int t = omp_get_thread_num();
      const int64_t n0 = A.N * t / nt, n1 = A.N * (t + 1) / nt;
      log_ratio(acc + n0, reinterpret_cast<float*>(o) + n0, n1 - n0, 1.0 / total);
    }
    if (nlow) exact_low_pass(A, x, m + std::log(total), acc, reinterpret_cast<float*>(o));
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
  int T = A.num_threads > 0 ? A.num_threads : omp_get_max_threads();
  T = std::max(1, T);
  int64_t first_bad = -1;
  // few rows, big trie: all threads on one row at a time, >= 16384 nodes per chunk
  const int chunks = static_cast<int>(std::min<int64_t>(T, A.N / 16384));
  if (B < T && chunks >= 2 && !omp_in_parallel()) {
    for (int64_t r = 0; r < B && first_bad < 0; ++r)
      if (!run_row_chunked<RED, In, Out>(A, r, chunks)) first_bad = r;
  } else {
    std::vector<char> bad(B, 0);
    if constexpr (RED != kLogMass) {
      if (B >= 2 * T) {  // pairs of rows, a last single row when B is odd
        const int64_t jobs = (B + 1) / 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
        for (int64_t j = 0; j < jobs; ++j) {
          if (2 * j + 1 < B) {
            run_row_pair<RED, In, Out>(A, 2 * j);
          } else {
            run_row<RED, In, Out>(A, 2 * j);
          }
        }
        return finish<RED, Out>(A, -1);
      }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(T) if (B > 1 && T > 1)
    for (int64_t r = 0; r < B; ++r) bad[r] = !run_row<RED, In, Out>(A, r);
    for (int64_t r = 0; r < B; ++r)
      if (bad[r]) {
        first_bad = r;
        break;
      }
  }
  return finish<RED, Out>(A, first_bad);
}

}  // namespace

// Returns 0 on success, or 1 + the first log_mass row without a finite maximum.
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
  return A.reduction == kSum ? run_typed<kSum, float, float>(A) : run_typed<kMax, float, float>(A);
}

}  // namespace cpu
}  // namespace genlm_fast
