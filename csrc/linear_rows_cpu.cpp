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
// walked one tile of a few rows of W at a time, each tile along the whole of k in chunks, so
// that each thread reads a few rows of W front to back (streams the hardware prefetcher
// follows). For each chunk, every group of rows of x takes dot products against the tile, one
// FMA per (feature, row) per vector of k; the tile's chunk stays in L1 across the row groups, x
// in L2. W leaves memory once whatever M is. AVX2: 8-wide vectors, 3 rows of W x 4 of x (12
// accumulators). AVX-512: 16-wide vectors, 4 rows of W x 6 of x (24 accumulators), or 8 x 1-2
// when x has one or two rows (more streams of W in flight where memory is the bound).
//
// Numerics: the products are summed in float32 lanes (8, or 16 on AVX-512) over a chunk (256
// values of k, or 512), so each lane sums 32 products a chunk. AVX2 and the plain loop reduce
// the lanes at the end of each chunk and add the chunk's sum to the output (which started at
// the bias, or zero); AVX-512 adds each chunk's lanes into a per-thread buffer of lane sums and
// reduces them once, after the last chunk: either way K / chunk + 32 + 4 additions per output,
// not K. The AVX2 kernel (FMA) and the plain loop (any CPU, the reference the tests compare
// with) give the same sums up to the rounding of fused multiply-adds; AVX-512's lanes group
// the products differently, within the same bound.

#include "linear_rows_cpu.h"

#include "cpu_features.h"
#include "cpu_threads.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linear_cpu.h"  // BFloat16, Float16, widen

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GF_ROWS_X86 1
#define GF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define GF_AVX512 __attribute__((target("avx512f")))
#else
#define GF_ROWS_X86 0
#endif

namespace genlm_fast {
namespace cpu {
namespace {

// Per ISA: values of k per chunk (the numerics' unit: each lane sums chunk / lanes products),
// rows of W and of x summed together in a tile
constexpr int64_t kChunk = 256;      // plain and AVX2: 8 lanes
constexpr int64_t kTileFeatures = 3;  // AVX2 (and the plain loop)
constexpr int64_t kTileRows = 4;
constexpr int64_t kChunk512 = 512;  // AVX-512: 16 lanes
constexpr int64_t kTileFeatures512 = 8;  // with 1-2 rows of x; 4 with more
constexpr int64_t kTileRows512 = 6;
constexpr int64_t kBlockFeatures = 24;  // output features per thread work item
// an AVX2 (or plain) tile's dot products: sums[f][r] for W row f, x row r (AVX-512 keeps lane
// sums in a per-thread buffer instead)
using TileSums = float[kTileFeatures][kTileRows];

// sums[f][r] = dot(W row f, x row r) over the chunk, for f < features, r < rows
template <class W>
void dot_tile_plain(const float* x, int64_t ldx, int64_t rows, int64_t kc, const W* w,
                    int64_t ldw, int64_t features, TileSums& sums) {
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
                           TileSums& sums) {
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
                                const W* w, int64_t ldw, TileSums& sums) {
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
                               TileSums& sums) {
  static_assert(kTileFeatures == 3 && kTileRows == 4, "the dispatch below spells the tile out");
  switch (features) {
    case 1: return dot_tile_avx2_rows<1>(x, ldx, rows, kc, w, ldw, sums);
    case 2: return dot_tile_avx2_rows<2>(x, ldx, rows, kc, w, ldw, sums);
    default: return dot_tile_avx2_rows<3>(x, ldx, rows, kc, w, ldw, sums);
  }
}

// AVX-512: 16-wide vectors of k, tiles of up to 4 rows of W x 6 rows of x (24 accumulators,
// 4 weights and a row of x in 32 registers); 1 or 2 rows of x take 8 rows of W, more streams
// of W in flight for the memory-bound shapes
GF_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
GF_AVX512 inline __m512 load16(const BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
GF_AVX512 inline __m512 load16(const Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// the row's values from j to kc (fewer than 16), zeros after (never read past the row)
template <class W>
GF_AVX512 inline __m512 load16_tail(const W* p, int64_t j, int64_t kc) {
  alignas(64) float tail[16] = {};
  for (int64_t t = 0; j + t < kc; ++t) tail[t] = widen(p[j + t]);
  return _mm512_load_ps(tail);
}
GF_AVX512 inline __m512 load16_tail(const float* p, int64_t j, int64_t kc) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (kc - j)) - 1), p + j);
}

// the 16 lane sums at p added: halves, then as reduce8
GF_AVX2 inline float reduce16(const float* p) {
  return reduce8(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)));
}

// partial[f][r][0..16) (first: =, else +=) the lane sums of W row f times x row r over the
// chunk, for f < F, r < R: the lanes are summed once, after the last chunk (run)
template <int R, int F, class W>
GF_AVX512 void dot_tile_avx512(const float* x, int64_t ldx, int64_t kc, const W* w, int64_t ldw,
                               bool first, float* partial) {
  __m512 acc[F][R];
  for (int f = 0; f < F; ++f)
    for (int r = 0; r < R; ++r) acc[f][r] = _mm512_setzero_ps();
  const int64_t whole = kc & ~int64_t{15};
  for (int64_t j = 0; j < whole; j += 16) {
    __m512 wv[F];
    for (int f = 0; f < F; ++f) wv[f] = load16(w + f * ldw + j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + j);
      for (int f = 0; f < F; ++f) acc[f][r] = _mm512_fmadd_ps(xv, wv[f], acc[f][r]);
    }
  }
  if (whole < kc) {
    __m512 wv[F];
    for (int f = 0; f < F; ++f) wv[f] = load16_tail(w + f * ldw, whole, kc);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = load16_tail(x + r * ldx, whole, kc);
      for (int f = 0; f < F; ++f) acc[f][r] = _mm512_fmadd_ps(xv, wv[f], acc[f][r]);
    }
  }
  for (int f = 0; f < F; ++f)
    for (int r = 0; r < R; ++r) {
      float* p = partial + (f * kTileRows512 + r) * 16;
      _mm512_storeu_ps(p, first ? acc[f][r] : _mm512_add_ps(_mm512_loadu_ps(p), acc[f][r]));
    }
}

template <int F, class W>
GF_AVX512 void dot_tile_avx512_rows(const float* x, int64_t ldx, int64_t rows, int64_t kc,
                                    const W* w, int64_t ldw, bool first, float* partial) {
  switch (rows) {
    case 1: return dot_tile_avx512<1, F>(x, ldx, kc, w, ldw, first, partial);
    case 2: return dot_tile_avx512<2, F>(x, ldx, kc, w, ldw, first, partial);
    case 3: return dot_tile_avx512<3, F>(x, ldx, kc, w, ldw, first, partial);
    case 4: return dot_tile_avx512<4, F>(x, ldx, kc, w, ldw, first, partial);
    case 5: return dot_tile_avx512<5, F>(x, ldx, kc, w, ldw, first, partial);
    default: return dot_tile_avx512<6, F>(x, ldx, kc, w, ldw, first, partial);
  }
}

template <int F, class W>
GF_AVX512 void dot_tile_avx512_narrow(const float* x, int64_t ldx, int64_t rows, int64_t kc,
                                      const W* w, int64_t ldw, bool first, float* partial) {
  if (rows == 1) return dot_tile_avx512<1, F>(x, ldx, kc, w, ldw, first, partial);
  return dot_tile_avx512<2, F>(x, ldx, kc, w, ldw, first, partial);
}

template <class W>
GF_AVX512 void dot_tile_avx512_any(const float* x, int64_t ldx, int64_t rows, int64_t kc,
                                   const W* w, int64_t ldw, int64_t features, bool first,
                                   float* partial) {
  static_assert(kTileFeatures512 == 8 && kTileRows512 == 6, "the dispatch spells the tile out");
  if (rows <= 2) {  // up to 8 rows of W: 8 x 2 accumulators
    switch (features) {
      case 1: return dot_tile_avx512_narrow<1>(x, ldx, rows, kc, w, ldw, first, partial);
      case 2: return dot_tile_avx512_narrow<2>(x, ldx, rows, kc, w, ldw, first, partial);
      case 3: return dot_tile_avx512_narrow<3>(x, ldx, rows, kc, w, ldw, first, partial);
      case 4: return dot_tile_avx512_narrow<4>(x, ldx, rows, kc, w, ldw, first, partial);
      case 5: return dot_tile_avx512_narrow<5>(x, ldx, rows, kc, w, ldw, first, partial);
      case 6: return dot_tile_avx512_narrow<6>(x, ldx, rows, kc, w, ldw, first, partial);
      case 7: return dot_tile_avx512_narrow<7>(x, ldx, rows, kc, w, ldw, first, partial);
      default: return dot_tile_avx512_narrow<8>(x, ldx, rows, kc, w, ldw, first, partial);
    }
  }
  switch (features) {  // 4 rows of W at a time
    case 1: return dot_tile_avx512_rows<1>(x, ldx, rows, kc, w, ldw, first, partial);
    case 2: return dot_tile_avx512_rows<2>(x, ldx, rows, kc, w, ldw, first, partial);
    case 3: return dot_tile_avx512_rows<3>(x, ldx, rows, kc, w, ldw, first, partial);
    default: return dot_tile_avx512_rows<4>(x, ldx, rows, kc, w, ldw, first, partial);
  }
}
#endif

enum class Isa { baseline, avx2, avx512 };

template <class W>
void run(const float* x, int64_t m, int64_t k, const W* w, int64_t ldw, int64_t n, float* y,
         Isa isa) {
  const int64_t chunk = isa == Isa::avx512 ? kChunk512 : kChunk;
  const int64_t tile_rows = isa == Isa::avx512 ? kTileRows512 : kTileRows;
  const int64_t tile_features =
      isa == Isa::avx512 ? (m <= 2 ? kTileFeatures512 : kTileFeatures512 / 2) : kTileFeatures;
  const int64_t blocks = (n + kBlockFeatures - 1) / kBlockFeatures;
  const int64_t bytes = n * k * static_cast<int64_t>(sizeof(W)) + (m * k + m * n) * 4;
  // x's rows in groups of at most tile_rows, as even as can be (9 rows on AVX2: 3 + 3 + 3,
  // not 4 + 4 + 1, whose last group would load a tile of W for one row's products)
  const int64_t groups = (m + tile_rows - 1) / tile_rows;
  const auto group_rows = [&](int64_t g) { return m / groups + (g < m % groups ? 1 : 0); };
  constexpr int64_t kPartial = kTileFeatures512 * kTileRows512 * 16;  // floats per group
#pragma omp parallel num_threads(team_size(bytes))
  {
    TileSums sums;
    // AVX-512: each group's lane sums of the tile, carried across the chunks
    std::vector<float> partials(isa == Isa::avx512 ? groups * kPartial : 0);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kBlockFeatures, n1 = std::min(n, n0 + kBlockFeatures);
      for (int64_t f = n0; f < n1; f += tile_features) {
        const int64_t features = std::min(tile_features, n1 - f);
        const W* wf = w + f * ldw;
        for (int64_t c = 0; c < k; c += chunk) {
          const int64_t kc = std::min(chunk, k - c);
          for (int64_t g = 0, r0 = 0; g < groups; r0 += group_rows(g), ++g) {
            const int64_t rows = group_rows(g);
            const float* xr = x + r0 * k + c;
#if GF_ROWS_X86
            if (isa == Isa::avx512) {
              dot_tile_avx512_any(xr, k, rows, kc, wf + c, ldw, features, c == 0,
                                  partials.data() + g * kPartial);
              continue;
            }
            if (isa == Isa::avx2)
              dot_tile_avx2_any(xr, k, rows, kc, wf + c, ldw, features, sums);
            else
#endif
              dot_tile_plain(xr, k, rows, kc, wf + c, ldw, features, sums);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t i = 0; i < features; ++i) y[(r0 + r) * n + f + i] += sums[i][r];
          }
        }
#if GF_ROWS_X86
        if (isa == Isa::avx512)
          for (int64_t g = 0, r0 = 0; g < groups; r0 += group_rows(g), ++g)
            for (int64_t r = 0; r < group_rows(g); ++r)
              for (int64_t i = 0; i < features; ++i)
                y[(r0 + r) * n + f + i] +=
                    reduce16(partials.data() + g * kPartial + (i * kTileRows512 + r) * 16);
#endif
      }
    }
  }
}

}  // namespace

std::string linear_rows_best_isa() {
  return cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "baseline";
}

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
  TORCH_CHECK(isa == "avx512" || isa == "avx2" || isa == "baseline", "linear_rows: unknown isa '",
              isa_name, "' (expected auto, avx512, avx2 or baseline)");
  TORCH_CHECK(cpu_has(isa), "linear_rows: this CPU cannot run the ", isa, " kernel");

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
  const Isa kernel = isa == "avx512" ? Isa::avx512 : isa == "avx2" ? Isa::avx2 : Isa::baseline;
  if (dtype == torch::kFloat32)
    run(xs, m, k, weight.data_ptr<float>(), ldw, n, ys, kernel);
  else if (dtype == torch::kBFloat16)
    run(xs, m, k, reinterpret_cast<const BFloat16*>(weight.data_ptr<at::BFloat16>()), ldw, n, ys,
        kernel);
  else
    run(xs, m, k, reinterpret_cast<const Float16*>(weight.data_ptr<at::Half>()), ldw, n, ys, kernel);
  return y;
}

}  // namespace cpu
}  // namespace genlm_fast
