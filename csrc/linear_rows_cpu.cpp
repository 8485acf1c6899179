// A linear layer on the weight as the model stores it: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// in float32 arithmetic, W float32, bfloat16 or float16, read in place.
//
// Why: a 16-bit model whose forward is transformers' (no fused decoder on this CPU, or a prompt
// longer than the fused forward takes) would round every layer's output to 16 bits, so the
// same context would get other log-probabilities than the fused decoder's float32 ones; and
// torch's 16-bit CPU products are slow without AVX-512. Here each weight is widened to float32
// in registers as it is loaded (exact: bfloat16 is the high half of a float32, every float16 is
// a float32) and the sums are float32, so the model's stored weights stay its only copy and its
// answers are the float32 ones. A float32 model's decoding steps run here too, on the weights
// in place (no packed copy). Made for the few rows of decoding (AsyncTransformer's small
// forwards); larger products go to BLAS (widen.py).
//
// Kernel: threads split W's rows (output features) into blocks of kBlockFeatures. A block is
// walked one tile of kTileFeatures rows of W at a time, each tile along the whole of k in
// chunks of kChunk, so that each thread reads a few rows of W front to back (streams the
// hardware prefetcher follows). For each chunk, every group of up to kTileRows rows of x takes
// dot products against the tile: 8-wide vectors of k, 3 x 4 accumulators, one FMA per
// (feature, row) per vector; the tile's chunk stays in L1 across the row groups, x in L2. W
// leaves memory once whatever M is.
//
// Numerics: each chunk's dot products are summed in float32 over 8 lanes, the lanes reduced,
// and the chunk's sum added to the output (which started at the bias, or zero): K / kChunk +
// kChunk / 8 + 3 additions per output, not K. The AVX2 kernel (FMA) and the plain loop (any
// CPU, the reference the tests compare with) give the same sums up to the rounding of fused
// multiply-adds.

#include "linear_rows_cpu.h"

#include "cpu_features.h"
#include "cpu_threads.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "linear_cpu.h"  // BFloat16, Float16, widen

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GF_ROWS_X86 1
#define GF_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define GF_ROWS_X86 0
#endif

namespace genlm_fast {
namespace cpu {
namespace {

constexpr int64_t kChunk = 256;         // values of k per chunk (the numerics' unit)
constexpr int64_t kTileFeatures = 3;    // rows of W summed together
constexpr int64_t kTileRows = 4;        // rows of x summed together
constexpr int64_t kBlockFeatures = 24;  // output features per thread work item (8 tiles)

// sums[f][r] = dot(W row f, x row r) over the chunk, for f < features, r < rows
template <class W>
void dot_tile_plain(const float* x, int64_t ldx, int64_t rows, int64_t kc, const W* w,
                    int64_t ldw, int64_t features, float sums[kTileFeatures][kTileRows]) {
  for (int64_t f = 0; f < features; ++f)
    for (int64_t r = 0; r < rows; ++r) {
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const float* xr = x + r * ldx;
      const W* wf = w + f * ldw;
      for (int64_t j = 0; j < kc; ++j) lanes[j % 8] += xr[j] * widen(wf[j]);
      // lanes reduced as the AVX2 kernel does: (0+4, 1+5, 2+6, 3+7), then pairwise
      float a = lanes[0] + lanes[4], b = lanes[1] + lanes[5];
      float c = lanes[2] + lanes[6], d = lanes[3] + lanes[7];
      sums[f][r] = (a + b) + (c + d);
    }
}

#if GF_ROWS_X86
GF_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
GF_AVX2 inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
GF_AVX2 inline __m256 load8(const Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// a row's last partial vector of the chunk (K not a multiple of 8): its values, zeros past kc
// (never read past the row)
GF_AVX2 inline __m256 load_tail(const float* p, int64_t j, int64_t kc) {
  alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t t = 0; j + t < kc; ++t) tail[t] = p[j + t];
  return _mm256_load_ps(tail);
}
template <class W>
GF_AVX2 inline __m256 load_tail(const W* p, int64_t j, int64_t kc) {
  alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t t = 0; j + t < kc; ++t) tail[t] = widen(p[j + t]);
  return _mm256_load_ps(tail);
}

// the 8 lanes of v summed as dot_tile_plain does
GF_AVX2 inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 ab_cd = _mm_add_ps(s, _mm_movehdup_ps(s));  // (a+b, ., c+d, .)
  return _mm_cvtss_f32(_mm_add_ss(ab_cd, _mm_movehl_ps(ab_cd, ab_cd)));
}

// R rows of x against F rows of W (12 accumulators, 3 + 1 more registers: 16 in all)
template <int R, int F, class W>
GF_AVX2 void dot_tile_avx2(const float* x, int64_t ldx, int64_t kc, const W* w, int64_t ldw,
                           float sums[kTileFeatures][kTileRows]) {
  __m256 acc[F][R];
  for (int f = 0; f < F; ++f)
    for (int r = 0; r < R; ++r) acc[f][r] = _mm256_setzero_ps();
  const int64_t whole = kc & ~int64_t{7};
  for (int64_t j = 0; j < whole; j += 8) {
    __m256 wv[F];
    for (int f = 0; f < F; ++f) wv[f] = load8(w + f * ldw + j);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + j);
      for (int f = 0; f < F; ++f) acc[f][r] = _mm256_fmadd_ps(xv, wv[f], acc[f][r]);
    }
  }
  if (whole < kc) {
    __m256 wv[F];
    for (int f = 0; f < F; ++f) wv[f] = load_tail(w + f * ldw, whole, kc);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = load_tail(x + r * ldx, whole, kc);
      for (int f = 0; f < F; ++f) acc[f][r] = _mm256_fmadd_ps(xv, wv[f], acc[f][r]);
    }
  }
  for (int f = 0; f < F; ++f)
    for (int r = 0; r < R; ++r) sums[f][r] = reduce8(acc[f][r]);
}

template <int F, class W>
GF_AVX2 void dot_tile_avx2_rows(const float* x, int64_t ldx, int64_t rows, int64_t kc,
                                const W* w, int64_t ldw, float sums[kTileFeatures][kTileRows]) {
  switch (rows) {
    case 1: return dot_tile_avx2<1, F>(x, ldx, kc, w, ldw, sums);
    case 2: return dot_tile_avx2<2, F>(x, ldx, kc, w, ldw, sums);
    case 3: return dot_tile_avx2<3, F>(x, ldx, kc, w, ldw, sums);
    default: return dot_tile_avx2<4, F>(x, ldx, kc, w, ldw, sums);
  }
}

template <class W>
GF_AVX2 void dot_tile_avx2_any(const float* x, int64_t ldx, int64_t rows, int64_t kc,
                               const W* w, int64_t ldw, int64_t features,
                               float sums[kTileFeatures][kTileRows]) {
  static_assert(kTileFeatures == 3 && kTileRows == 4, "the dispatch below spells the tile out");
  switch (features) {
    case 1: return dot_tile_avx2_rows<1>(x, ldx, rows, kc, w, ldw, sums);
    case 2: return dot_tile_avx2_rows<2>(x, ldx, rows, kc, w, ldw, sums);
    default: return dot_tile_avx2_rows<3>(x, ldx, rows, kc, w, ldw, sums);
  }
}
#endif

template <class W>
void run(const float* x, int64_t m, int64_t k, const W* w, int64_t ldw, int64_t n, float* y,
         bool avx2) {
  const int64_t blocks = (n + kBlockFeatures - 1) / kBlockFeatures;
  const int64_t bytes = n * k * static_cast<int64_t>(sizeof(W)) + (m * k + m * n) * 4;
  // x's rows in groups of at most kTileRows, as even as can be (9 rows: 3 + 3 + 3, not
  // 4 + 4 + 1, whose last group would load a tile of W for one row's products)
  const int64_t groups = (m + kTileRows - 1) / kTileRows;
  const auto group_rows = [&](int64_t g) { return m / groups + (g < m % groups ? 1 : 0); };
#pragma omp parallel num_threads(team_size(bytes))
  {
    float sums[kTileFeatures][kTileRows];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kBlockFeatures, n1 = std::min(n, n0 + kBlockFeatures);
      for (int64_t f = n0; f < n1; f += kTileFeatures) {
        const int64_t features = std::min(kTileFeatures, n1 - f);
        const W* wf = w + f * ldw;
        for (int64_t c = 0; c < k; c += kChunk) {
          const int64_t kc = std::min(kChunk, k - c);
          for (int64_t g = 0, r0 = 0; g < groups; r0 += group_rows(g), ++g) {
            const int64_t rows = group_rows(g);
            const float* xr = x + r0 * k + c;
#if GF_ROWS_X86
            if (avx2)
              dot_tile_avx2_any(xr, k, rows, kc, wf + c, ldw, features, sums);
            else
#endif
              dot_tile_plain(xr, k, rows, kc, wf + c, ldw, features, sums);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t i = 0; i < features; ++i) y[(r0 + r) * n + f + i] += sums[i][r];
          }
        }
      }
    }
  }
}

}  // namespace

std::string linear_rows_best_isa() { return cpu_has("avx2") ? "avx2" : "baseline"; }

torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, const std::string& isa_name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "linear_rows: x and the weight must be on the CPU, got ", x.device(), " and ",
              weight.device());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "linear_rows: x must be a 2-D float32 tensor, got ", x.dim(), "-D ",
              x.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "linear_rows: the weight must be 2-D [N, K], got ",
              weight.dim(), "-D");
  const c10::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "linear_rows: the weight must be float32, bfloat16 or float16, got ", dtype);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "linear_rows: x has ", k, " columns but the weight ",
              weight.size(1));
  TORCH_CHECK(weight.stride(1) == 1 || k <= 1, "linear_rows: the weight's rows must be contiguous");
  const std::string isa = isa_name == "auto" ? linear_rows_best_isa() : isa_name;
  TORCH_CHECK(isa == "avx2" || isa == "baseline", "linear_rows: unknown isa '", isa_name,
              "' (expected auto, avx2 or baseline)");
  TORCH_CHECK(cpu_has(isa), "linear_rows: this CPU cannot run the avx2 kernel");

  torch::Tensor y;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_rows: the bias must be [", n,
                "], got ", bias->sizes());
    y = torch::empty({m, n}, x.options());  // a tensor of its own: the sums go into it
    y.copy_(bias->reshape({1, n}).expand({m, n}));
  } else {
    y = torch::zeros({m, n}, x.options());
  }
  if (m == 0 || n == 0 || k == 0) return y;
  const torch::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t ldw = weight.stride(0);
  const bool avx2 = isa == "avx2";
  if (dtype == torch::kFloat32)
    run(xs, m, k, weight.data_ptr<float>(), ldw, n, ys, avx2);
  else if (dtype == torch::kBFloat16)
    run(xs, m, k, reinterpret_cast<const BFloat16*>(weight.data_ptr<at::BFloat16>()), ldw, n, ys,
        avx2);
  else
    run(xs, m, k, reinterpret_cast<const Float16*>(weight.data_ptr<at::Half>()), ldw, n, ys, avx2);
  return y;
}

}  // namespace cpu
}  // namespace genlm_fast
