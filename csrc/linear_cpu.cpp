// Small-batch float32 linear layer on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
//
// Why: a decoding step of an LM multiplies a few rows (one per sequence in the batch) by every
// weight matrix of the model. For M up to a few dozen rows that product is bound by reading W
// from memory once (SmolLM2: 540 MB per step), and BLAS's general kernels reach about half of
// the machine's read bandwidth on it. This kernel streams W once, front to back, at close to
// the bandwidth.
//
// Layout: W is packed once (pack_linear_weight) into panels of 16 output features: panel p is
// W[16p .. 16p + 16, k] for k = 0 .. K, each k's 16 values side by side ([P][K][16], rows past
// N zero), so a thread reads one panel as one sequential stream. The values are float32, or
// bfloat16 or float16 for a model loaded so (the fused decoder): half the bytes to stream,
// widened to float32 exactly as they are loaded, so the arithmetic is the float32 one. A
// bfloat16 panel holds k-steps in pairs, each feature's two values side by side ([P][K/2][16]
// [2], K even): one 64-byte load is two k-steps, widened by a shift (the first) and a mask
// (the second), where [K][16] would take two loads and a zero-extension each.
//
// Kernel: each thread takes whole panels, two at a time (panel_dot2; a last odd panel alone:
// panel_dot). A panel is walked in chunks of k; for each chunk, every group of up to R rows
// keeps its 16 output columns in registers (one 512-bit register per row and panel), and each
// 16-float load of W feeds one FMA per row with x[m, k] broadcast (a broadcast feeds both
// panels of a pair). The first group reads the chunk from memory (the next one prefetched);
// the other groups find it in L1, so W leaves memory once whatever M is. Partial sums cross
// chunks through a small per-thread buffer. Larger products (prompts) are cut into blocks of
// rows by the caller, so that a block of x stays in L2 (panel_layers.py).
//
// Numerics: float32 products summed in float32, in blocks of kSumBlock values of k; each
// block starts from zero and its sum is added to the buffer. One running sum over all of K
// gathers rounding error in proportion to K (SmolLM2's MLP: K = 1536): on contexts of its
// special tokens, whose activations are large and cancel, the log-probabilities were 2.4x
// further from float64 than with torch's own layers. Blocks bring that to K / kSumBlock +
// kSumBlock additions per output, at one load, add and store per row and block.
//
// ISAs: AVX-512F (R = 12 rows of two panels, or 8 of one: 24 or 8 accumulators beside W and
// a broadcast in 32 registers; more rows spill) and a plain loop
// (any CPU; the layout's reference, for tests: AVX2 versions of this kernel were no faster
// than oneDNN at 16 rows, so cpu_linear.py runs oneDNN on CPUs without AVX-512). Both give
// the same numbers up to float32 rounding of the FMA (fused or not).

#include "linear_cpu.h"

#include "cpu_features.h"
#include "cpu_threads.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define GF_X86_KERNELS 1
#else
#define GF_X86_KERNELS 0
#endif

namespace genlm_fast {
namespace cpu {

namespace {

constexpr int64_t kChunk = 256;  // values of k per chunk: 16 KB of a float32 panel, kept in L1
constexpr int64_t kPrefetch = 64;  // prefetch distance, in values of k of a float32 panel (4 KB)
constexpr int64_t kSumBlock = 64;  // values of k summed from zero before joining the buffer
static_assert(kChunk % kSumBlock == 0, "a chunk holds whole summation blocks");

// k-steps one load of a panel of W covers
template <class W>
constexpr int kSteps = 1;
template <>
constexpr int kSteps<BFloat16> = 2;


#if GF_X86_KERNELS
// the kSteps<W> k-steps at p (k even for bfloat16), as float32: w[s] is k-step s's 16 weights
__attribute__((target("avx512f"))) inline void load_weights(const float* p, __m512* w) {
  w[0] = _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline void load_weights(const BFloat16* p, __m512* w) {
  const __m512i pairs = _mm512_loadu_si512(p);
  // (the zero-masking shift: GCC 12 warns about the plain one's undefined source)
  w[0] = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(static_cast<__mmask16>(0xFFFF), pairs, 16));
  w[1] = _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
__attribute__((target("avx512f"))) inline void load_weights(const Float16* p, __m512* w) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w[0] = _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), halves);
}

// the prefetch distance in values of k of a panel of W: the same bytes whatever the type
template <class W>
constexpr int64_t kAhead = kPrefetch * static_cast<int64_t>(sizeof(float) / sizeof(W));

// acc[r][0..16) = (first ? 0 : acc[r]) + sum over the blocks of kSumBlock values of k in
// [k0, k1) of (sum_{k in block} x[r, k] * panel[k][0..16)), the blocks' sums added in order
template <class W, int R>
__attribute__((target("avx512f"))) void group_avx512(const float* x, int64_t ldx, const W* panel,
                                                     int64_t k0, int64_t k1, bool first,
                                                     float* acc) {
  __m512 a[R];
  for (int64_t b0 = k0; b0 < k1; b0 += kSumBlock) {
    const int64_t b1 = std::min(k1, b0 + kSumBlock);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = b0; k < b1; k += kSteps<W>) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead<W>)*kPanel), _MM_HINT_T0);
      __m512 w[kSteps<W>];
      load_weights(panel + k * kPanel, w);
      for (int s = 0; s < kSteps<W>; ++s)
#pragma GCC unroll 24
        for (int r = 0; r < R; ++r)
          a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + s]), w[s], a[r]);
    }
    const bool fresh = first && b0 == k0;
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(acc + r * kPanel,
                       fresh ? a[r] : _mm512_add_ps(_mm512_loadu_ps(acc + r * kPanel), a[r]));
  }
}

// The same for two panels at once (`pa` into acc, `pb` into acc2): each broadcast of x feeds
// two FMAs, which keeps the FMA units busier than one panel does.
// Memory: while the G groups of rows walk a chunk, they fetch the next one (`next_a`,
// `next_b`: its start), group g the g-th of G slices of it, so that the fetch is spread over
// the whole chunk's arithmetic instead of stalling the first group. One row fetches too: the
// hardware prefetcher alone keeps too little of a 16-bit panel in flight for the memory's full
// bandwidth.
template <class W, int R>
__attribute__((target("avx512f"))) void pair_avx512(const float* x, int64_t ldx, const W* pa,
                                                    const W* pb, int64_t k0, int64_t k1,
                                                    bool first, float* acc, float* acc2,
                                                    const W* next_a, const W* next_b, int64_t g,
                                                    int64_t groups) {
  __m512 a[R], b[R];
  const int64_t len = k1 - k0;
  for (int64_t b0 = k0; b0 < k1; b0 += kSumBlock) {
    const int64_t b1 = std::min(k1, b0 + kSumBlock);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t k = b0; k < b1; k += kSteps<W>) {
      // the next chunk's g-th slice, spread over this chunk's steps
      const int64_t ahead = ((k - k0) + g * len) / groups;
      _mm_prefetch(reinterpret_cast<const char*>(next_a + ahead * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_b + ahead * kPanel), _MM_HINT_T0);
      __m512 wa[kSteps<W>], wb[kSteps<W>];
      load_weights(pa + k * kPanel, wa);
      load_weights(pb + k * kPanel, wb);
      for (int s = 0; s < kSteps<W>; ++s)
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * ldx + k + s]);
          a[r] = _mm512_fmadd_ps(xv, wa[s], a[r]);
          b[r] = _mm512_fmadd_ps(xv, wb[s], b[r]);
        }
    }
    const bool fresh = first && b0 == k0;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * kPanel,
                       fresh ? a[r] : _mm512_add_ps(_mm512_loadu_ps(acc + r * kPanel), a[r]));
      _mm512_storeu_ps(acc2 + r * kPanel,
                       fresh ? b[r] : _mm512_add_ps(_mm512_loadu_ps(acc2 + r * kPanel), b[r]));
    }
  }
}

#endif

template <class W>
void group_baseline(int rows, const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1,
                    bool first, float* acc) {
  if (first) std::fill(acc, acc + rows * kPanel, 0.0f);
  for (int r = 0; r < rows; ++r)
    for (int64_t b0 = k0; b0 < k1; b0 += kSumBlock) {
      const int64_t b1 = std::min(k1, b0 + kSumBlock);
      float block[kPanel] = {};
      for (int64_t k = b0; k < b1; ++k) {
        const float xv = x[r * ldx + k];
        for (int64_t j = 0; j < kPanel; ++j) block[j] += xv * panel_weight(panel, k, j);
      }
      for (int64_t j = 0; j < kPanel; ++j) acc[r * kPanel + j] += block[j];
    }
}

template <class W>
using GroupFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, bool, float*);
template <class W>
using PairFn = void (*)(const float*, int64_t, const W*, const W*, int64_t, int64_t, bool, float*,
                        float*, const W*, const W*, int64_t, int64_t);

// kernel tables: entry rows - 1 handles a group of exactly `rows` rows (1 to 8 for one panel,
// 1 to 12 for two)
#if GF_X86_KERNELS
template <class W, size_t... R>
constexpr std::array<GroupFn<W>, sizeof...(R)> group_table(std::index_sequence<R...>) {
  return {group_avx512<W, R + 1>...};
}
template <class W, size_t... R>
constexpr std::array<PairFn<W>, sizeof...(R)> pair_table(std::index_sequence<R...>) {
  return {pair_avx512<W, R + 1>...};
}
template <class W>
constexpr auto kAvx512 = group_table<W>(std::make_index_sequence<8>());
template <class W>
constexpr auto kPairAvx512 = pair_table<W>(std::make_index_sequence<12>());
#endif

}  // namespace

template <class W>
void panel_dot(const float* x, int64_t ldx, int64_t m, int64_t k, const W* panel, float* acc,
               bool avx512) {
  constexpr int max_rows = 8;
  const GroupFn<W>* table = nullptr;
#if GF_X86_KERNELS
  if (avx512) table = kAvx512<W>.data();
#else
  (void)avx512;
#endif
  // groups of (nearly) equal size: 9 rows are 5 + 4, not 8 + 1
  const int64_t groups = (m + max_rows - 1) / max_rows;
  for (int64_t k0 = 0;; k0 += kChunk) {  // at least once: K = 0 gives zeros
    const int64_t k1 = std::min(k, k0 + kChunk);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = m * g / groups, rows = m * (g + 1) / groups - r0;
      float* a = acc + r0 * kPanel;
      if (table)
        table[rows - 1](x + r0 * ldx, ldx, panel, k0, k1, k0 == 0, a);
      else
        group_baseline<W>(static_cast<int>(rows), x + r0 * ldx, ldx, panel, k0, k1, k0 == 0, a);
    }
    if (k1 >= k) break;
  }
}

template <class W>
void panel_dot2(const float* x, int64_t ldx, int64_t m, int64_t k, const W* pa, const W* pb,
                float* acc, float* acc2, bool avx512, const W* next_a, const W* next_b) {
#if GF_X86_KERNELS
  if (avx512) {
    // chunks of 8 KB of two panels (64 values of k of float32 ones, 128 of 16-bit ones). Beside
    // the next chunk being fetched and the rows' slices of x that leaves most of L1 (48 KB)
    // free; 16 KB chunks, which crowd it, were slower at 1 to 32 rows. The next chunk is what
    // is prefetched, so a chunk's bytes, not its values of k, are what keep enough of W in
    // flight to cover the memory's latency (4 KB chunks of 16-bit panels left 4 rows short of
    // the read bandwidth)
    constexpr int64_t chunk = kChunk / 4 * static_cast<int64_t>(sizeof(float) / sizeof(W));
    const int64_t groups = (m + 11) / 12;
    if (!next_a) next_a = pa + k * kPanel, next_b = pb + k * kPanel;
    for (int64_t k0 = 0;; k0 += chunk) {
      const int64_t k1 = std::min(k, k0 + chunk);
      // what to fetch meanwhile: the next chunk, or the next panels' first one
      const W* na = k1 < k ? pa + k1 * kPanel : next_a;
      const W* nb = k1 < k ? pb + k1 * kPanel : next_b;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = m * g / groups, rows = m * (g + 1) / groups - r0;
        kPairAvx512<W>[rows - 1](x + r0 * ldx, ldx, pa, pb, k0, k1, k0 == 0, acc + r0 * kPanel,
                              acc2 + r0 * kPanel, na, nb, g, groups);
      }
      if (k1 >= k) break;
    }
    return;
  }
#endif
  (void)next_a, (void)next_b;
  panel_dot(x, ldx, m, k, pa, acc, avx512);
  panel_dot(x, ldx, m, k, pb, acc2, avx512);
}

template void panel_dot<float>(const float*, int64_t, int64_t, int64_t, const float*, float*, bool);
template void panel_dot<BFloat16>(const float*, int64_t, int64_t, int64_t, const BFloat16*, float*,
                                  bool);
template void panel_dot2<float>(const float*, int64_t, int64_t, int64_t, const float*, const float*,
                                float*, float*, bool, const float*, const float*);
template void panel_dot2<BFloat16>(const float*, int64_t, int64_t, int64_t, const BFloat16*,
                                   const BFloat16*, float*, float*, bool, const BFloat16*,
                                   const BFloat16*);
template void panel_dot<Float16>(const float*, int64_t, int64_t, int64_t, const Float16*, float*,
                                 bool);
template void panel_dot2<Float16>(const float*, int64_t, int64_t, int64_t, const Float16*,
                                  const Float16*, float*, float*, bool, const Float16*,
                                  const Float16*);

std::string linear_best_isa() {
  return cpu_has("avx512") ? "avx512" : "baseline";
}

namespace {

// The panel layout is a transpose: panel p is rows 16p .. 16p + 16 of W, [16][units] ->
// [units][16], where a unit is one value (float32, float16) or, bfloat16, a pair of consecutive
// k-steps read as one 32-bit unit. Units are moved 64 columns at a time, so that the block of
// the panel they land in stays in L1; rows past N give zeros.
using Unit32 = uint32_t __attribute__((may_alias, aligned(2)));  // two bfloat16 in a row
using Unit16 = uint16_t __attribute__((may_alias));

template <class U>
void pack_panels(const U* w, int64_t ldw, int64_t n, int64_t units, U* out, int64_t panel_stride,
                 int64_t panels) {
  const int64_t bytes = panels * kPanel * units * static_cast<int64_t>(sizeof(U)) * 2;
#pragma omp parallel for schedule(static) num_threads(team_size(bytes))
  for (int64_t p = 0; p < panels; ++p) {
    U* dst = out + p * panel_stride;
    for (int64_t j0 = 0; j0 < units; j0 += 64) {
      const int64_t j1 = std::min(units, j0 + 64);
      for (int64_t f = 0; f < kPanel; ++f) {
        const int64_t row = p * kPanel + f;
        if (row >= n) {
          for (int64_t j = j0; j < j1; ++j) dst[j * kPanel + f] = U{};
          continue;
        }
        const U* src = w + row * ldw;
        for (int64_t j = j0; j < j1; ++j) dst[j * kPanel + f] = src[j];
      }
    }
  }
}

}  // namespace

torch::Tensor pack_linear_weight(const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& out_arg) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: the weight must be 2-D [N, K], got ",
              weight.dim(), "-D");
  const c10::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "pack_linear_weight: the weight must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.device().is_cpu(), "pack_linear_weight: the weight must be on the CPU");
  const bool pairs = dtype == torch::kBFloat16;
  TORCH_CHECK(!pairs || weight.size(1) % 2 == 0,
              "pack_linear_weight: a bfloat16 weight needs an even number of input features, got ",
              weight.size(1));
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  torch::Tensor out;
  if (out_arg.has_value() && out_arg->defined()) {
    out = *out_arg;
    TORCH_CHECK(out.dim() == 3 && out.size(0) == panels && out.size(1) == k &&
                    out.size(2) == kPanel && out.scalar_type() == dtype && out.device().is_cpu(),
                "pack_linear_weight: out must be a [", panels, ", ", k, ", ", kPanel, "] ", dtype,
                " CPU tensor, got ", out.sizes(), " ", out.scalar_type());
    TORCH_CHECK((out.stride(2) == 1 && out.stride(1) == kPanel) || k <= 1,
                "pack_linear_weight: each panel of out must be contiguous [K, 16]");
  } else {
    out = torch::empty({panels, k, kPanel}, weight.options());
  }
  if (panels == 0 || k == 0) return out;
  // rows of units: contiguous values, and bfloat16 rows an even number of values apart
  const bool rows_ok = weight.stride(1) == 1 && (!pairs || weight.stride(0) % 2 == 0);
  const torch::Tensor w = rows_ok ? weight : weight.contiguous();
  const int64_t stride = out.stride(0);
  TORCH_CHECK(!pairs || stride % 2 == 0,
              "pack_linear_weight: a bfloat16 out's panels must lie an even number of values apart");
  if (dtype == torch::kFloat32)
    pack_panels(reinterpret_cast<const Unit32*>(w.data_ptr<float>()), w.stride(0), n, k,
                reinterpret_cast<Unit32*>(out.data_ptr<float>()), stride, panels);
  else if (pairs)
    pack_panels(reinterpret_cast<const Unit32*>(w.data_ptr<at::BFloat16>()), w.stride(0) / 2, n,
                k / 2, reinterpret_cast<Unit32*>(out.data_ptr<at::BFloat16>()), stride / 2,
                panels);
  else
    pack_panels(reinterpret_cast<const Unit16*>(w.data_ptr<at::Half>()), w.stride(0), n, k,
                reinterpret_cast<Unit16*>(out.data_ptr<at::Half>()), stride, panels);
  return out;
}

namespace {

// y[:, p*16 ...] for every panel p: what linear_small_batch computes, for one weight type
template <class W>
void small_batch_panels(const float* xs, int64_t m, int64_t k, const W* ws, int64_t panel_stride,
                        int64_t count, const float* bs, int64_t n, float* ys, bool avx512) {
  const int64_t bytes = (count * k * kPanel * static_cast<int64_t>(sizeof(W))) + m * (k + n) * 4;
  // panel p's sums (acc) into columns p * 16 .. of y, plus the bias
  auto store = [&](int64_t p, const float* acc) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t r = 0; r < m; ++r) {
      float* out = ys + r * n + p * kPanel;
      const float* a = acc + r * kPanel;
      if (bs)
        for (int64_t j = 0; j < cols; ++j) out[j] = a[j] + bs[p * kPanel + j];
      else
        std::memcpy(out, a, static_cast<size_t>(cols) * sizeof(float));
    }
  };
#pragma omp parallel num_threads(team_size(bytes))
  {
    std::vector<float> acc(static_cast<size_t>(2 * m * kPanel));
    product_panels(xs, k, m, k, ws, panel_stride, count, false, avx512, acc.data(), store);
  }
}

}  // namespace

torch::Tensor linear_small_batch(const torch::Tensor& x, const torch::Tensor& panels,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features,
                                 const std::string& isa_name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() &&
                  x.is_contiguous(),
              "linear_small_batch: x must be a contiguous 2-D float32 CPU tensor");
  const c10::ScalarType dtype = panels.scalar_type();
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel &&
                  (dtype == torch::kFloat32 || dtype == torch::kBFloat16 ||
                   dtype == torch::kHalf) &&
                  panels.device().is_cpu(),
              "linear_small_batch: panels must come from pack_linear_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out_features, count = panels.size(0);
  TORCH_CHECK(panels.size(1) == k, "linear_small_batch: x has ", k,
              " features, the packed weight ", panels.size(1));
  // each panel one contiguous [K, 16] block (the panels themselves any distance apart: every
  // other panel of an interleaved store), a bfloat16 one starting on a pair
  TORCH_CHECK((panels.stride(2) == 1 && panels.stride(1) == kPanel) || k <= 1,
              "linear_small_batch: each panel must be a contiguous [K, 16] block");
  TORCH_CHECK(dtype != torch::kBFloat16 ||
                  (k % 2 == 0 && panels.stride(0) % 2 == 0 && panels.storage_offset() % 2 == 0),
              "linear_small_batch: bfloat16 panels need an even K and pair-aligned panels");
  TORCH_CHECK(n > (count - 1) * kPanel && n <= count * kPanel, "linear_small_batch: ",
              out_features, " output features do not match ", count, " panels of ", kPanel);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kFloat32 &&
                    bias->device().is_cpu() && bias->is_contiguous(),
                "linear_small_batch: bias must be a contiguous float32 CPU vector of ", n);
  }
  const std::string isa = isa_name == "auto" ? linear_best_isa() : isa_name;
  TORCH_CHECK(isa == "avx512" || isa == "baseline", "linear_small_batch: unknown isa '",
              isa_name, "' (expected auto, avx512 or baseline)");
  TORCH_CHECK(cpu_has(isa), "linear_small_batch: this CPU cannot run the ", isa, " kernel");

  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xs = x.data_ptr<float>();
  const float* bs = bias ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const bool avx512 = isa == "avx512";
  const int64_t stride = panels.stride(0);
  if (dtype == torch::kFloat32)
    small_batch_panels(xs, m, k, panels.data_ptr<float>(), stride, count, bs, n, ys, avx512);
  else if (dtype == torch::kBFloat16)
    small_batch_panels(xs, m, k, reinterpret_cast<const BFloat16*>(panels.data_ptr<at::BFloat16>()),
                       stride, count, bs, n, ys, avx512);
  else
    small_batch_panels(xs, m, k, reinterpret_cast<const Float16*>(panels.data_ptr<at::Half>()),
                       stride, count, bs, n, ys, avx512);
  return y;
}

}  // namespace cpu
}  // namespace genlm_fast
