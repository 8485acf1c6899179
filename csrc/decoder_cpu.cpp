// A decoder-only transformer's forward pass over a few new tokens per row, on the CPU, in one
// call: what AsyncTransformer runs for its decoding steps (genlm_fast/backend/llm/decoder.py
// reads the architecture and packs the weights).
//
// One file past 500 lines: the whole forward is one OpenMP region (run_forward), and the vector
// math, norms and attention it runs are inline helpers of that region's translation unit.
//
// Why: a decoding step multiplies a few rows by every weight of the model, so its floor is
// reading the weights once from memory; run as transformers' forward it also pays a few hundred
// small torch ops per step (norms, rotations, attention over short pasts, reshapes, the KV
// cache's copies), each cheap but together as costly as the weights. Here the whole forward is
// one OpenMP region: the threads take each projection's packed panels in runs, each the next
// run when done (dynamic: a thread slowed by other work does not hold the others at the
// barrier), and meet at one barrier after each of the five steps of a layer; everything between two products
// (norms, residual adds) is done by every thread on its own copy of the few rows it needs,
// which costs less than a barrier.
//
// Per layer (the HF modules' order; the variants are the DecoderSpec flags):
//   xn = norm1(x);  qkv = xn @ [Wq; Wk; Wv]^T (+ bias)           | barrier
//   per (row, KV head): q/k head norms, rotation, the new keys and values written into the
//   row's new KV segment, attention of the row's queries of that group over its past and
//   its new positions (causal, optional sliding window and soft cap)      | barrier
//   o = attn @ Wo^T (+ bias)                                              | barrier
//   x += post1(o);  xn = norm2(x);  h = act(xn @ Wgate^T) * (xn @ Wup^T)  | barrier
//   d = h @ Wdown^T (+ bias)                                              | barrier
//   x += post2(d)
// then final_norm and the LM head on each row's last token only.
//
// Products: linear_cpu.h's product_panels (the panel kernels of linear_cpu.cpp) on weights
// packed once into panels of 16 output features; gate and up are packed as alternating
// panels, so that the thread computing a gate panel also has its up panel and applies the
// activation at once.
//
// Past keys and values are read where the KV trie keeps them: `runs` lists, per row, the
// segments (float32 [layers, 2, kv_heads, positions, head_dim], each (layer, k/v, head) block
// `stride` positions apart: a segment of its own, or one slot of the trie's pool) and position
// ranges of its past in order, then the row's new segment, which this forward fills. Every row
// is computed the same way whatever else is in the batch, so results are batch-invariant.
// Attention per query: scores over all visible positions (16 at a time, summed across lanes
// with one transpose), softmax in float32 with the maximum subtracted, then the weighted sum
// of values. The G queries sharing a KV head take the keys 64 positions at a time (in L1 for
// all of them) and the values in one pass; the first of them prefetches both, since a past
// read once per forward comes from memory, not cache.
//
// Weights: the embeddings and the packed projections in the model's dtype, float32, bfloat16 or
// float16 (half the bytes to stream, widened exactly as they are loaded), the norms and biases
// in float32: a 16-bit model gives the same numbers as its float32 copy would.
//
// Numerics: float32 throughout; the products sum in blocks as linear_cpu.cpp does; exp, tanh
// and erf are polynomial approximations within a few float32 ulps (tanh and erf within 1e-7
// absolute). A NaN or infinity in the weights or activations propagates to the logits, where
// the caller checks for it.

#include "decoder_cpu.h"

#include "cpu_features.h"
#include "cpu_threads.h"
#include "linear_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define GF_DECODER 1
#define GF_AVX512 __attribute__((target("avx512f")))
#else
#define GF_DECODER 0
#define GF_AVX512
#endif

namespace genlm_fast {
namespace cpu {

bool decoder_supported() { return cpu_has("avx512"); }

namespace {

// Everything one forward reads and writes, as raw pointers (the threads' code uses no torch).
struct Fwd {
  const DecoderSpec* spec;
  int64_t T, B;
  const int64_t *tokens, *positions, *row_start, *runs, *run_start;
  const float *cos, *sin;
  int64_t rot;  // rotated dimensions (head_dim), 0: none
  float* qkv;   // [T, Nqkv]
  float* attn;  // [T, Nq]
  float* o;     // [T, H]
  float* h;     // [T, I]
  float* d;     // [T, H]
  float* logits;  // [B, V]
  int64_t weight_bytes;
  const void *embed, *pos_embed, *head;  // of the weights' type
  const float *final_norm, *final_norm_b, *head_b;
  const void* layers;  // const LayerPtrs*, cast back below
};

#if GF_DECODER

inline __mmask16 tail_mask(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
}

GF_AVX512 inline __m512 load(const float* p, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(tail_mask(n), p);
}

GF_AVX512 inline void store(float* p, __m512 v, int64_t n) {
  if (n >= 16)
    _mm512_storeu_ps(p, v);
  else
    _mm512_mask_storeu_ps(p, tail_mask(n), v);
}

// e^x, within 2 ulps for x in [-87, 88]; NaN stays NaN (max/min return their second operand
// when one is NaN)
GF_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// tanh(x) = 1 - 2 / (e^(2x) + 1): within 1e-7 absolute
GF_AVX512 inline __m512 tanh512(__m512 x) {
  const __m512 e = exp512(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.0f),
                       _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

// erf(x), Abramowitz and Stegun 7.1.26: within 1.5e-7 absolute
GF_AVX512 inline __m512 erf512(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f), one));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  p = _mm512_mul_ps(p, t);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(ax, ax)));
  const __m512 y = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.0f));  // erf(|x|)
  // the sign of x onto y
  return _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(y),
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
}

enum Act { kSilu, kGeluTanh, kGeluErf, kRelu };

GF_AVX512 inline __m512 activate(__m512 x, int act) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  switch (act) {
    case kSilu:
      return _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    case kGeluTanh: {
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                         _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
      return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh512(inner)));
    }
    case kGeluErf: {
      const __m512 e = erf512(_mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865476f)));
      return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, e));
    }
    default:  // relu; max(0, NaN) would drop the NaN, max(NaN, 0) keeps it
      return _mm512_max_ps(_mm512_setzero_ps(), x);
  }
}

GF_AVX512 inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// 16 vectors -> one vector of their 16 horizontal sums (lane i: the sum of v[i])
GF_AVX512 inline __m512 hsum16x16(const __m512* v) {
  __m512 t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves summed; 8-15: v[2i + 1]'s
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    t8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: one of the four vectors
    const __m512 a = t8[2 * i], b = t8[2 * i + 1];
    t4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 a = t4[2 * i], b = t4[2 * i + 1];
    t2[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t2[0], t2[1], 0x88),
                                 _mm512_shuffle_ps(t2[0], t2[1], 0xDD));
  // lane 4k + m of r holds the sum of v[k + 4m]: put the sum of v[i] in lane i
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// out = norm(x) over n values: RMSNorm (x * rsqrt(mean(x^2) + eps) * w) or LayerNorm
// ((x - mean) * rsqrt(var + eps) * w + b)
GF_AVX512 void norm_row(const float* x, int64_t n, const float* w, const float* b, bool layer_norm,
                        float eps, float* out) {
  float mean = 0.0f;
  if (layer_norm) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) s = _mm512_add_ps(s, load(x + i, n - i));
    mean = hsum(s) / static_cast<float>(n);
  }
  const __m512 mv = _mm512_set1_ps(mean);
  __m512 s = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 c = _mm512_maskz_sub_ps(tail_mask(n - i), load(x + i, n - i), mv);
    s = _mm512_fmadd_ps(c, c, s);
  }
  const float r = 1.0f / std::sqrt(hsum(s) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(load(x + i, n - i), mv), rv);
    v = _mm512_mul_ps(v, load(w + i, n - i));
    if (b) v = _mm512_add_ps(v, load(b + i, n - i));
    store(out + i, v, n - i);
  }
}

// x[i] += y[i]
GF_AVX512 void add_row(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    store(x + i, _mm512_add_ps(load(x + i, n - i), load(y + i, n - i)), n - i);
}

// x += y, or x += post(y) when the layer normalises its branch's output (Gemma2's post norms)
GF_AVX512 void add_residual(float* x, const float* y, const float* post, int64_t n, float eps,
                            float* tmp) {
  if (post) {
    norm_row(y, n, post, nullptr, false, eps, tmp);
    add_row(x, tmp, n);
  } else {
    add_row(x, y, n);
  }
}

// A product's epilogue for panel p of `rows` rows: + bias (if any), into out [rows, n]
GF_AVX512 void store_biased(const float* a, int64_t rows, int64_t p, const float* bias,
                            float* out, int64_t n) {
  const int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
  for (int64_t t = 0; t < rows; ++t) {
    __m512 v = _mm512_loadu_ps(a + t * kPanel);
    if (bias) v = _mm512_add_ps(v, load(bias + c0, cols));
    store(out + t * n + c0, v, cols);
  }
}

// the rotation of one head in place: x1 * cos - x2 * sin, x2 * cos + x1 * sin (rotate_half)
GF_AVX512 void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t n = half - i;
    const __m512 x1 = load(x + i, n), x2 = load(x + half + i, n);
    const __m512 a = _mm512_fnmadd_ps(x2, load(sin + i, n), _mm512_mul_ps(x1, load(cos + i, n)));
    const __m512 b = _mm512_fmadd_ps(x1, load(sin + half + i, n),
                                     _mm512_mul_ps(x2, load(cos + half + i, n)));
    store(x + i, a, n);
    store(x + half + i, b, n);
  }
}

// One product of the forward: product_panels (linear_cpu.h) over panels stored back to back
template <class W, class Epilogue>
GF_AVX512 void product(const float* x, int64_t ldx, int64_t m, int64_t k, const W* panels,
                       int64_t count, bool pairs, float* acc, Epilogue epilogue) {
  product_panels(x, ldx, m, k, panels, k * kPanel, count, pairs, true, acc, epilogue);
}

struct LayerPtrs {
  const float *norm1, *norm1_b, *post1, *norm2, *norm2_b, *post2, *q_norm, *k_norm;
  const float *qkv_b, *o_b, *up_b, *down_b;
  const void *qkv, *o, *up, *down;  // the packed projections, of the weights' type
};

// Attention's two passes over the past, for D = ceil(hd / 16) registers per head vector
// (the last one masked). Keys and values are read from wherever the KV trie keeps them
// (`keys[pos]`, `values[pos]`: one head vector each).

// register c of a head vector held in D registers: 16 floats, the last register masked to
// the head's tail (`last`)
template <int D>
GF_AVX512 inline __m512 head_part(const float* v, int c, __mmask16 last) {
  return c + 1 < D ? _mm512_loadu_ps(v + 16 * c) : _mm512_maskz_loadu_ps(last, v + 16 * c);
}

// prefetch the head vectors at[lo .. hi) into L1
inline void fetch_heads(const float* const* at, int64_t lo, int64_t hi, int64_t hd) {
  for (int64_t i = lo; i < hi; ++i)
    for (int64_t c = 0; c < hd; c += 16)
      _mm_prefetch(reinterpret_cast<const char*>(at[i] + c), _MM_HINT_T0);
}

// sc[pos] = scale * (q . keys[pos]) for pos in [lo, hi], soft-capped if cap > 0: q held in
// registers, 16 keys at a time, each key's lane-wise products summed across lanes by one
// transpose. `fetch`: also prefetch the next 16 keys and this block's values (the first query
// reading this past; the others find them in cache).
template <int D>
GF_AVX512 void query_scores(const float* q, const float* const* keys, const float* const* values,
                            int64_t lo, int64_t hi, int64_t hd, float scale, float cap,
                            bool fetch, float* sc) {
  const __mmask16 last = tail_mask(hd - 16 * (D - 1));
  __m512 qv[D];
#pragma GCC unroll 16
  for (int c = 0; c < D; ++c) qv[c] = head_part<D>(q, c, last);
  if (fetch) fetch_heads(keys, lo, std::min(lo + 16, hi + 1), hd);
  for (int64_t p0 = lo; p0 <= hi; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, hi + 1 - p0);
    if (fetch) {
      fetch_heads(keys, p0 + 16, std::min(p0 + 32, hi + 1), hd);
      fetch_heads(values, p0, p0 + cnt, hd);
    }
    __m512 parts[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i >= cnt) {
        parts[i] = _mm512_setzero_ps();
        continue;
      }
      const float* k = keys[p0 + i];
      __m512 a = _mm512_mul_ps(qv[0], head_part<D>(k, 0, last));
#pragma GCC unroll 16
      for (int c = 1; c < D; ++c) a = _mm512_fmadd_ps(qv[c], head_part<D>(k, c, last), a);
      parts[i] = a;
    }
    __m512 v = _mm512_mul_ps(hsum16x16(parts), _mm512_set1_ps(scale));
    if (cap > 0.0f)
      v = _mm512_mul_ps(tanh512(_mm512_div_ps(v, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
    store(sc + p0, v, cnt);
  }
}

// out[g][:hd] = sum over [lo, hi) of w[g][pos] * values[pos][:hd] for the `queries` (<= Q)
// queries of one KV head (w rows `ldw` apart, out rows `ldo` apart): each value is read once
// for all of them, and each query's sum runs over positions in order.
template <int D>
GF_AVX512 void weighted_values(const float* w, int64_t ldw, int64_t queries,
                               const float* const* values, int64_t lo, int64_t hi, int64_t hd,
                               float* out, int64_t ldo) {
  constexpr int Q = D >= 24 ? 1 : 24 / D;  // accumulators: Q x D registers
  const __mmask16 last = tail_mask(hd - 16 * (D - 1));
  for (int64_t g0 = 0; g0 < queries; g0 += Q) {
    const int64_t nq = std::min<int64_t>(Q, queries - g0);
    const float* wg = w + g0 * ldw;
    __m512 acc[Q][D];
#pragma GCC unroll 24
    for (int g = 0; g < Q; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < D; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t pos = lo; pos < hi; ++pos) {
      const float* v = values[pos];
      __m512 vv[D];
#pragma GCC unroll 16
      for (int c = 0; c < D; ++c) vv[c] = head_part<D>(v, c, last);
#pragma GCC unroll 24
      for (int g = 0; g < Q; ++g) {
        if (g >= nq) break;
        const __m512 wv = _mm512_set1_ps(wg[g * ldw + pos]);
#pragma GCC unroll 16
        for (int c = 0; c < D; ++c) acc[g][c] = _mm512_fmadd_ps(wv, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < nq; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < D; ++c) store(out + (g0 + g) * ldo + 16 * c, acc[g][c], hd - 16 * c);
  }
}

using QueryScoresFn = void (*)(const float*, const float* const*, const float* const*, int64_t,
                               int64_t, int64_t, float, float, bool, float*);
using WeightedValuesFn = void (*)(const float*, int64_t, int64_t, const float* const*, int64_t,
                                  int64_t, int64_t, float*, int64_t);
template <int... D>
struct AttnKernels {
  static constexpr QueryScoresFn scores[] = {query_scores<D>...};
  static constexpr WeightedValuesFn values[] = {weighted_values<D>...};
};
using HeadKernels = AttnKernels<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16>;

// Attention of row b's queries of KV head `kh` in layer l (see the header comment).
struct AttnScratch {
  std::vector<const float*> keys, values;
  std::vector<float> scores;
};

GF_AVX512 void attend(const Fwd& f, const LayerPtrs& L, int64_t l, int64_t b, int64_t kh,
                      AttnScratch& s) {
  const DecoderSpec& sp = *f.spec;
  const int64_t hd = sp.head_dim, nh = sp.heads, nkv = sp.kv_heads, G = nh / nkv;
  const int64_t Nq = nh * hd, Nkv = nkv * hd, Nqkv = Nq + 2 * Nkv;
  const int64_t t0 = f.row_start[b], n = f.row_start[b + 1] - t0;
  const int64_t r0 = f.run_start[b], r1 = f.run_start[b + 1];
  const int64_t past = f.positions[t0];
  const int64_t P = past + n;
  const int64_t window = sp.window[l];

  // where each position's key and value are (the last run: the row's new segment)
  s.keys.resize(P);
  s.values.resize(P);
  int64_t p = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t* run = f.runs + 4 * r;
    const float* base = reinterpret_cast<const float*>(run[0]);
    const int64_t stride = run[1], stop = run[3];  // positions from one head's block to the next
    const float* kb = base + ((l * 2 + 0) * nkv + kh) * stride * hd;
    const float* vb = base + ((l * 2 + 1) * nkv + kh) * stride * hd;
    for (int64_t pos = run[2]; pos < stop; ++pos, ++p) {
      s.keys[p] = kb + pos * hd;
      s.values[p] = vb + pos * hd;
    }
  }

  // the row's new keys and values: head norm, rotation, then into the new segment
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j;
    float* row = f.qkv + t * Nqkv;
    float* k = row + Nq + kh * hd;
    const float* v = row + Nq + Nkv + kh * hd;
    if (L.k_norm) norm_row(k, hd, L.k_norm, nullptr, false, static_cast<float>(sp.eps), k);
    if (f.rot) rotate(k, f.cos + t * f.rot, f.sin + t * f.rot, f.rot);
    std::memcpy(const_cast<float*>(s.keys[past + j]), k, hd * sizeof(float));
    std::memcpy(const_cast<float*>(s.values[past + j]), v, hd * sizeof(float));
    for (int64_t g = 0; g < G; ++g) {
      float* q = row + (kh * G + g) * hd;
      if (L.q_norm) norm_row(q, hd, L.q_norm, nullptr, false, static_cast<float>(sp.eps), q);
      if (f.rot) rotate(q, f.cos + t * f.rot, f.sin + t * f.rot, f.rot);
    }
  }

  // per query (j, g), at position past + j, seeing [lo, past + j]: scores, softmax, values
  const float scale = static_cast<float>(sp.scaling[l]);
  const float cap = static_cast<float>(sp.attn_softcap);
  s.scores.resize(G * P);
  const QueryScoresFn query_scores = HeadKernels::scores[(hd + 15) / 16 - 1];
  const WeightedValuesFn weighted = HeadKernels::values[(hd + 15) / 16 - 1];
  // per new token j: its G queries (at position past + j, seeing [lo, past + j]) scored 64
  // keys at a time (which stay in L1 while the G queries read them), softmaxed one by one,
  // then their weighted sums of values in one pass
  for (int64_t j = 0; j < n; ++j) {
    const int64_t hi = past + j;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
    for (int64_t c0 = lo; c0 <= hi; c0 += 64)
      for (int64_t g = 0; g < G; ++g)
        query_scores(f.qkv + (t0 + j) * Nqkv + (kh * G + g) * hd, s.keys.data(),
                     s.values.data(), c0, std::min(c0 + 63, hi), hd, scale, cap,
                     j == 0 && g == 0, s.scores.data() + g * P);
    for (int64_t g = 0; g < G; ++g) {
      float* sc = s.scores.data() + g * P;
      // softmax over [lo, hi]; a NaN score makes the maximum NaN
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = lo; i <= hi; ++i)
        if (!(sc[i] <= mx)) mx = sc[i];
      __m512 sum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(mx);
      for (int64_t i = lo; i <= hi; i += 16) {
        const int64_t cnt = hi + 1 - i;
        const __m512 e =
            _mm512_maskz_mov_ps(tail_mask(cnt), exp512(_mm512_sub_ps(load(sc + i, cnt), mv)));
        store(sc + i, e, cnt);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / hsum(sum));
      for (int64_t i = lo; i <= hi; i += 16)
        store(sc + i, _mm512_mul_ps(load(sc + i, hi + 1 - i), inv), hi + 1 - i);
    }
    weighted(s.scores.data(), P, G, s.values.data(), lo, hi + 1, hd,
             f.attn + (t0 + j) * Nq + kh * G * hd, hd);
  }
}

// W: the type of the embeddings and packed projections (float, BFloat16 or Float16)
template <class W>
GF_AVX512 void run_forward(const Fwd& f) {
  const DecoderSpec& sp = *f.spec;
  const LayerPtrs* layers = static_cast<const LayerPtrs*>(f.layers);
  const int64_t T = f.T, B = f.B, H = sp.hidden, I = sp.inter, V = sp.vocab;
  const int64_t hd = sp.head_dim, Nq = sp.heads * hd, Nqkv = Nq + 2 * sp.kv_heads * hd;
  const float eps = static_cast<float>(sp.eps);
  const int act = sp.act == "silu" ? kSilu
                  : sp.act == "gelu_tanh" ? kGeluTanh
                  : sp.act == "gelu_erf" ? kGeluErf
                  : kRelu;
  const float final_cap = static_cast<float>(sp.final_softcap);

#pragma omp parallel num_threads(team_size(f.weight_bytes))
  {
    // this thread's copy of the residual stream and of the normalized rows
    std::vector<float> x(T * H), xn(std::max(T, B) * H), tmp(H), acc(2 * std::max(T, B) * kPanel);
    AttnScratch scratch;

    const float scale = static_cast<float>(sp.embed_scale);
    const W* embed = static_cast<const W*>(f.embed);
    const W* pos_embed = static_cast<const W*>(f.pos_embed);
    for (int64_t t = 0; t < T; ++t) {
      float* xr = x.data() + t * H;
      if (embed) {
        const W* e = embed + f.tokens[t] * H;
        for (int64_t i = 0; i < H; ++i) xr[i] = widen(e[i]);
      } else {  // a tied embedding: the token's row of the head is column tok % 16 of a panel
        const W* panel = static_cast<const W*>(f.head) + (f.tokens[t] / kPanel) * H * kPanel;
        for (int64_t i = 0; i < H; ++i) xr[i] = panel_weight(panel, i, f.tokens[t] % kPanel);
      }
      if (scale != 1.0f)
        for (int64_t i = 0; i < H; ++i) xr[i] *= scale;
      if (pos_embed) {
        const W* pe = pos_embed + f.positions[t] * H;
        for (int64_t i = 0; i < H; ++i) xr[i] += widen(pe[i]);
      }
    }

    for (int64_t l = 0; l < sp.layers; ++l) {
      const LayerPtrs& L = layers[l];
      for (int64_t t = 0; t < T; ++t)
        norm_row(x.data() + t * H, H, L.norm1, L.norm1_b, sp.layer_norm, eps, xn.data() + t * H);
      const int64_t qkv_panels = (Nqkv + kPanel - 1) / kPanel;
      product(xn.data(), H, T, H, static_cast<const W*>(L.qkv), qkv_panels, false, acc.data(),
              [&](int64_t p, const float* a)
                  GF_AVX512 { store_biased(a, T, p, L.qkv_b, f.qkv, Nqkv); });
#pragma omp barrier
      // (row, KV head) items, taken in turn by whichever thread is free
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t item = 0; item < B * sp.kv_heads; ++item)
        attend(f, L, l, item / sp.kv_heads, item % sp.kv_heads, scratch);
#pragma omp barrier
      const int64_t o_panels = (H + kPanel - 1) / kPanel;
      product(f.attn, Nq, T, Nq, static_cast<const W*>(L.o), o_panels, false, acc.data(),
              [&](int64_t p, const float* a)
                  GF_AVX512 { store_biased(a, T, p, L.o_b, f.o, H); });
#pragma omp barrier
      for (int64_t t = 0; t < T; ++t) {
        float* xr = x.data() + t * H;
        add_residual(xr, f.o + t * H, L.post1, H, eps, tmp.data());
        norm_row(xr, H, L.norm2, L.norm2_b, sp.layer_norm, eps, xn.data() + t * H);
      }
      const int64_t up_panels = (I + kPanel - 1) / kPanel;
      product(xn.data(), H, T, H, static_cast<const W*>(L.up), up_panels, sp.gated, acc.data(),
              [&](int64_t p, const float* a) GF_AVX512 {
                const int64_t c0 = p * kPanel, cols = std::min(kPanel, I - c0);
                for (int64_t t = 0; t < T; ++t) {
                  __m512 g = _mm512_loadu_ps(a + t * kPanel);
                  if (L.up_b) g = _mm512_add_ps(g, load(L.up_b + c0, cols));
                  g = activate(g, act);
                  if (sp.gated) {
                    __m512 u = _mm512_loadu_ps(a + (T + t) * kPanel);
                    if (L.up_b) u = _mm512_add_ps(u, load(L.up_b + I + c0, cols));
                    g = _mm512_mul_ps(g, u);
                  }
                  store(f.h + t * I + c0, g, cols);
                }
              });
#pragma omp barrier
      product(f.h, I, T, I, static_cast<const W*>(L.down), o_panels, false, acc.data(),
              [&](int64_t p, const float* a)
                  GF_AVX512 { store_biased(a, T, p, L.down_b, f.d, H); });
#pragma omp barrier
      for (int64_t t = 0; t < T; ++t)
        add_residual(x.data() + t * H, f.d + t * H, L.post2, H, eps, tmp.data());
    }

    // the LM head on each row's last token
    for (int64_t b = 0; b < B; ++b)
      norm_row(x.data() + (f.row_start[b + 1] - 1) * H, H, f.final_norm, f.final_norm_b,
               sp.layer_norm, eps, xn.data() + b * H);
    const int64_t head_panels = (V + kPanel - 1) / kPanel;
    product(xn.data(), H, B, H, static_cast<const W*>(f.head), head_panels, false, acc.data(),
            [&](int64_t p, const float* a) GF_AVX512 {
              const int64_t c0 = p * kPanel, cols = std::min(kPanel, V - c0);
              for (int64_t b = 0; b < B; ++b) {
                __m512 v = _mm512_loadu_ps(a + b * kPanel);
                if (f.head_b) v = _mm512_add_ps(v, load(f.head_b + c0, cols));
                if (final_cap > 0.0f)
                  v = _mm512_mul_ps(tanh512(_mm512_div_ps(v, _mm512_set1_ps(final_cap))),
                                    _mm512_set1_ps(final_cap));
                store(f.logits + b * V + c0, v, cols);
              }
            });
  }
}

#endif  // GF_DECODER

void check_vector(const torch::Tensor& t, const char* what, int64_t n) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == torch::kInt64 &&
                  t.device().is_cpu() && t.is_contiguous(),
              "DecoderCPU.forward: ", what, " must be a contiguous int64 CPU vector of ", n);
}

}  // namespace

const void* DecoderCPU::get(const std::string& name, std::vector<int64_t> shape,
                            c10::ScalarType dtype, bool optional) {
  auto it = weights_.find(name);
  if (it == weights_.end()) {
    TORCH_CHECK(optional, "DecoderCPU: weight '", name, "' is missing");
    return nullptr;
  }
  const torch::Tensor& t = it->second;
  TORCH_CHECK(t.scalar_type() == dtype && t.device().is_cpu() && t.is_contiguous(),
              "DecoderCPU: weight '", name, "' must be a contiguous ", c10::toString(dtype),
              " CPU tensor, got ", t.scalar_type());
  TORCH_CHECK(t.sizes().vec() == shape, "DecoderCPU: weight '", name, "' has shape ", t.sizes(),
              ", expected ", c10::IntArrayRef(shape));
  return t.data_ptr();
}

DecoderCPU::DecoderCPU(DecoderSpec spec, std::map<std::string, torch::Tensor> weights)
    : spec_(std::move(spec)), weights_(std::move(weights)) {
  const DecoderSpec& s = spec_;
  TORCH_CHECK(s.layers > 0 && s.hidden > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0 &&
                  s.inter > 0 && s.vocab > 0 && s.heads % s.kv_heads == 0,
              "DecoderCPU: inconsistent sizes");
  TORCH_CHECK(static_cast<int64_t>(s.scaling.size()) == s.layers &&
                  static_cast<int64_t>(s.window.size()) == s.layers,
              "DecoderCPU: scaling and window need one entry per layer");
  TORCH_CHECK(s.act == "silu" || s.act == "gelu_tanh" || s.act == "gelu_erf" || s.act == "relu",
              "DecoderCPU: unknown activation '", s.act, "'");
  const int64_t H = s.hidden, I = s.inter, hd = s.head_dim, Nq = s.heads * hd;
  const int64_t Nqkv = Nq + 2 * s.kv_heads * hd;
  auto panels = [](int64_t n) { return (n + kPanel - 1) / kPanel; };
  // the weights' dtype: the embedding's, or, read from the head's panels, the head's
  auto emb = weights_.find(s.embed_from_head ? "head" : "embed");
  TORCH_CHECK(emb != weights_.end() && emb->second.dim() >= 2,
              s.embed_from_head ? "DecoderCPU: the head's panels are missing"
                                : "DecoderCPU: 'embed' must be [vocab, hidden]");
  weight_dtype_ = emb->second.scalar_type();
  TORCH_CHECK(weight_dtype_ == torch::kFloat32 || weight_dtype_ == torch::kBFloat16 ||
                  weight_dtype_ == torch::kHalf,
              "DecoderCPU: the weights must be float32, bfloat16 or float16, got ", weight_dtype_);
  const c10::ScalarType wt = weight_dtype_;
  if (s.embed_from_head) {
    TORCH_CHECK(weights_.find("embed") == weights_.end(),
                "DecoderCPU: an 'embed' weight is given but embed_from_head is set");
    vocab_in_ = s.vocab;
  } else {
    TORCH_CHECK(emb->second.dim() == 2 && emb->second.size(1) == H,
                "DecoderCPU: 'embed' must be [vocab, hidden]");
    embed_ = get("embed", emb->second.sizes().vec(), wt);
    vocab_in_ = emb->second.size(0);
  }
  if (s.learned_positions) positions_ = get("pos_embed", {s.max_positions, H}, wt);
  final_norm_ = vector("final_norm", {H});
  final_norm_b_ = vector("final_norm_b", {H}, !s.layer_norm);
  head_ = get("head", {panels(s.vocab), H, kPanel}, wt);
  head_b_ = vector("head_b", {s.vocab}, true);
  layers_.resize(s.layers);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = std::to_string(l) + ".";
    Layer& L = layers_[l];
    L.norm1 = vector(p + "norm1", {H});
    L.norm1_b = vector(p + "norm1_b", {H}, !s.layer_norm);
    L.norm2 = vector(p + "norm2", {H});
    L.norm2_b = vector(p + "norm2_b", {H}, !s.layer_norm);
    L.post1 = vector(p + "post1", {H}, !s.post_norms);
    L.post2 = vector(p + "post2", {H}, !s.post_norms);
    L.q_norm = vector(p + "q_norm", {hd}, !s.qk_norm);
    L.k_norm = vector(p + "k_norm", {hd}, !s.qk_norm);
    L.qkv = get(p + "qkv", {panels(Nqkv), H, kPanel}, wt);
    L.qkv_b = vector(p + "qkv_b", {Nqkv}, true);
    L.o = get(p + "o", {panels(H), Nq, kPanel}, wt);
    L.o_b = vector(p + "o_b", {H}, true);
    L.up = get(p + "up", {(s.gated ? 2 : 1) * panels(I), H, kPanel}, wt);
    L.up_b = vector(p + "up_b", {(s.gated ? 2 : 1) * I}, true);
    L.down = get(p + "down", {panels(H), I, kPanel}, wt);
    L.down_b = vector(p + "down_b", {H}, true);
  }
  for (const auto& kv : weights_)
    if (kv.first != "embed" && kv.first != "pos_embed")
      weight_bytes_ += kv.second.numel() * static_cast<int64_t>(kv.second.element_size());
  // (the embedding's rows are read per token, not streamed)
}

torch::Tensor DecoderCPU::forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                                  const torch::Tensor& row_start, const torch::Tensor& cos,
                                  const torch::Tensor& sin, const torch::Tensor& runs,
                                  const torch::Tensor& run_start) const {
  const DecoderSpec& s = spec_;
  TORCH_CHECK(decoder_supported(), "DecoderCPU: this CPU lacks AVX-512F");
  const int64_t T = tokens.numel();
  TORCH_CHECK(row_start.dim() == 1 && row_start.size(0) >= 2,
              "DecoderCPU.forward: row_start must hold at least one row");
  const int64_t B = row_start.size(0) - 1;
  check_vector(tokens, "tokens", T);
  check_vector(positions, "positions", T);
  check_vector(row_start, "row_start", B + 1);
  check_vector(run_start, "run_start", B + 1);
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 4 && runs.scalar_type() == torch::kInt64 &&
                  runs.is_contiguous(),
              "DecoderCPU.forward: runs must be a contiguous int64 [R, 4] tensor");
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t* rus = run_start.data_ptr<int64_t>();
  const int64_t vocab_in = vocab_in_;
  TORCH_CHECK(rs[0] == 0 && rs[B] == T && rus[0] == 0 && rus[B] == runs.size(0),
              "DecoderCPU.forward: row_start / run_start do not cover the tokens / runs");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = rs[b + 1] - rs[b];
    TORCH_CHECK(n >= 1, "DecoderCPU.forward: row ", b, " has no new token");
    TORCH_CHECK(rus[b + 1] > rus[b], "DecoderCPU.forward: row ", b, " has no new segment");
    int64_t past = 0;
    for (int64_t r = rus[b]; r < rus[b + 1]; ++r) {
      const int64_t* e = run + 4 * r;
      TORCH_CHECK(e[0] != 0 && 0 <= e[2] && e[2] < e[3] && e[3] <= e[1],
                  "DecoderCPU.forward: run ", r, " is not a position range of its segment");
      if (r + 1 < rus[b + 1]) past += e[3] - e[2];
    }
    const int64_t* fresh = run + 4 * (rus[b + 1] - 1);
    TORCH_CHECK(fresh[1] == n && fresh[2] == 0 && fresh[3] == n,
                "DecoderCPU.forward: row ", b, "'s new segment must hold its ", n, " positions");
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(pos[rs[b] + j] == past + j, "DecoderCPU.forward: row ", b,
                  "'s positions must continue its past of ", past);
  }
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= tok[t] && tok[t] < vocab_in, "DecoderCPU.forward: token ", tok[t],
                " is outside the embedding's ", vocab_in, " rows");
    TORCH_CHECK(!s.learned_positions || pos[t] < s.max_positions, "DecoderCPU.forward: position ",
                pos[t], " is past the model's ", s.max_positions, " positions");
  }
  int64_t rot = 0;
  if (!s.learned_positions) {
    rot = s.head_dim;
    for (const torch::Tensor* c : {&cos, &sin})
      TORCH_CHECK(c->dim() == 2 && c->size(0) == T && c->size(1) == rot &&
                      c->scalar_type() == torch::kFloat32 && c->is_contiguous(),
                  "DecoderCPU.forward: cos and sin must be contiguous float32 [tokens, head_dim]");
  }

  const int64_t H = s.hidden, hd = s.head_dim, Nq = s.heads * hd;
  const int64_t Nqkv = Nq + 2 * s.kv_heads * hd;
  auto logits = torch::empty({B, s.vocab}, tokens.options().dtype(torch::kFloat32));
  std::vector<float> qkv(T * Nqkv), attn(T * Nq), o(T * H), h(T * s.inter), d(T * H);
  std::vector<LayerPtrs> layers(s.layers);
  for (int64_t l = 0; l < s.layers; ++l) {
    const Layer& L = layers_[l];
    layers[l] = {L.norm1, L.norm1_b, L.post1, L.norm2, L.norm2_b, L.post2,
                 L.q_norm, L.k_norm,  L.qkv_b, L.o_b,   L.up_b,    L.down_b,
                 L.qkv,   L.o,       L.up,    L.down};
  }
  Fwd f{&s,
        T,
        B,
        tok,
        pos,
        rs,
        run,
        rus,
        rot ? cos.data_ptr<float>() : nullptr,
        rot ? sin.data_ptr<float>() : nullptr,
        rot,
        qkv.data(),
        attn.data(),
        o.data(),
        h.data(),
        d.data(),
        logits.data_ptr<float>(),
        weight_bytes_,
        embed_,
        positions_,
        head_,
        final_norm_,
        final_norm_b_,
        head_b_,
        layers.data()};
#if GF_DECODER
  {
    pybind11::gil_scoped_release released;
    if (weight_dtype_ == torch::kBFloat16)
      run_forward<BFloat16>(f);
    else if (weight_dtype_ == torch::kHalf)
      run_forward<Float16>(f);
    else
      run_forward<float>(f);
  }
#endif
  return logits;
}

}  // namespace cpu
}  // namespace genlm_fast
