// Strait's CPU kernels: a linear over pre-packed weights, paged attention (one query row per
// token, decode tokens and prefill chunks alike) and the sampler's arg-max.
//
// Loaded (compiled on first use) by libs/engine/kernels/__init__.py; called by
// libs/engine/kernels/linear.py (PackedLinear), libs/engine/attention.py (every token) and
// libs/engine/sampler.py (arg-max, through the engine).
// fp32 only; AVX2 + FMA paths with a plain C++ fallback for other CPUs, and AVX-512 tiles for
// the linear at two rows and more where the CPU has AVX-512 (same results, bit for bit).
//
// Numerics: every output of `packed_linear` is one sequential fused-multiply-add chain over k
// = 0..K-1, whatever M is and wherever the row sits in the batch, so a sequence's logits do not
// depend on how many other sequences share its step.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STRAIT_AVX2 1
#else
#define STRAIT_AVX2 0
#endif
#if STRAIT_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STRAIT_AVX512 1
#else
#define STRAIT_AVX512 0
#endif
#ifndef STRAIT_QPF
#define STRAIT_QPF 8
#endif
#if STRAIT_AVX512 && defined(__AVX512VNNI__)
#define STRAIT_VNNI 1
#else
#define STRAIT_VNNI 0
#endif
// The block kernel's int8 activations: VNNI on AVX-512, vpmaddubsw on AVX2 (an AVX-512 CPU
// without VNNI takes the exact path).
#define STRAIT_QDOT (STRAIT_VNNI || (STRAIT_AVX2 && !STRAIT_AVX512))

namespace {

constexpr int64_t kNR = 16;  // output columns per packed panel (two 8-float registers)
constexpr int64_t kMR = 6;  // rows of x per micro-tile: 6 x 2 accumulators + 2 weight registers

// ------------------------------------------------------------------ packed linear

// w [N, K] -> [ceil(N / 16), K, 16]: panel p holds columns 16p..16p+15, k-major, zero padded.
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight must be [N, K]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack_weight: float32 CPU weights only");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kNR - 1) / kNR;
  auto out = torch::zeros({panels, k, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t j = 0; j < kNR && p * kNR + j < n; ++j) {
        const float* row = src + (p * kNR + j) * k;
        float* col = dst + p * k * kNR + j;
        for (int64_t i = 0; i < k; ++i) col[i * kNR] = row[i];
      }
    }
  });
  return out;
}

// y[r, 0:cols] = x[r, :] . panel  for r < R (R rows of x, row stride ldx), one panel.
// With PF, tile `tile` of `tiles` (> 1) also requests lines tile, tile + tiles, ... of the next
// panel `next` (one 64-byte line per k row), one every `tiles` iterations: spread over all the
// tiles of a panel, the next panel's DRAM reads overlap this panel's FMAs instead of stalling
// the first tile that touches it. A single tile (M <= 6) is bound by the weight stream anyway.
template <int R, bool PF>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                       int64_t ldy, int64_t cols, const float* bias, const float* next,
                       int64_t tile, int64_t tiles) {
  float tmp[kNR];
#if STRAIT_AVX2
  const float* pf = PF ? next + tile * kNR : nullptr;
  const float* pf_end = PF ? next + k * kNR : nullptr;
  int64_t countdown = 1;
  // Named accumulators, not an array: GCC spills an accumulator array to the stack every
  // iteration, which caps the tile at a third of the FMA rate.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (PF) {
      if (--countdown == 0) {
        countdown = tiles;
        if (pf < pf_end) __builtin_prefetch(pf, 0, 3);
        pf += tiles * kNR;
      }
    }
    const __m256 w0 = _mm256_loadu_ps(panel + i * kNR);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kNR + 8);
    __m256 xv = _mm256_broadcast_ss(x0 + i);
    c00 = _mm256_fmadd_ps(xv, w0, c00);
    c01 = _mm256_fmadd_ps(xv, w1, c01);
    if constexpr (R > 1) {
      xv = _mm256_broadcast_ss(x1 + i);
      c10 = _mm256_fmadd_ps(xv, w0, c10);
      c11 = _mm256_fmadd_ps(xv, w1, c11);
    }
    if constexpr (R > 2) {
      xv = _mm256_broadcast_ss(x2 + i);
      c20 = _mm256_fmadd_ps(xv, w0, c20);
      c21 = _mm256_fmadd_ps(xv, w1, c21);
    }
    if constexpr (R > 3) {
      xv = _mm256_broadcast_ss(x3 + i);
      c30 = _mm256_fmadd_ps(xv, w0, c30);
      c31 = _mm256_fmadd_ps(xv, w1, c31);
    }
    if constexpr (R > 4) {
      xv = _mm256_broadcast_ss(x4 + i);
      c40 = _mm256_fmadd_ps(xv, w0, c40);
      c41 = _mm256_fmadd_ps(xv, w1, c41);
    }
    if constexpr (R > 5) {
      xv = _mm256_broadcast_ss(x5 + i);
      c50 = _mm256_fmadd_ps(xv, w0, c50);
      c51 = _mm256_fmadd_ps(xv, w1, c51);
    }
  }
  const __m256 lo[6] = {c00, c10, c20, c30, c40, c50};
  const __m256 hi[6] = {c01, c11, c21, c31, c41, c51};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(tmp, lo[r]);
    _mm256_storeu_ps(tmp + 8, hi[r]);
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kNR; ++j) tmp[j] = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      const float xv = x[r * ldx + i];
      for (int64_t j = 0; j < kNR; ++j) tmp[j] = std::fma(xv, panel[i * kNR + j], tmp[j]);
    }
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
#endif
}

// All `rows` rows of x against one panel, six rows a tile; with PF, `next` is the panel to
// prefetch (see panel_tile).
template <bool PF>
inline void panel_rows(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t k,
                       float* y, int64_t ldy, int64_t cols, const float* bias, const float* next) {
  const int64_t tiles = (rows + kMR - 1) / kMR;
  int64_t r = 0, t = 0;
  for (; r + kMR <= rows; r += kMR, ++t)
    panel_tile<kMR, PF>(x + r * ldx, ldx, panel, k, y + r * ldy, ldy, cols, bias, next, t, tiles);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: panel_tile<5, PF>(xr, ldx, panel, k, yr, ldy, cols, bias, next, t, tiles); break;
    case 4: panel_tile<4, PF>(xr, ldx, panel, k, yr, ldy, cols, bias, next, t, tiles); break;
    case 3: panel_tile<3, PF>(xr, ldx, panel, k, yr, ldy, cols, bias, next, t, tiles); break;
    case 2: panel_tile<2, PF>(xr, ldx, panel, k, yr, ldy, cols, bias, next, t, tiles); break;
    case 1: panel_tile<1, PF>(xr, ldx, panel, k, yr, ldy, cols, bias, next, t, tiles); break;
    default: break;
  }
}

#if STRAIT_AVX2
// One row of x (M = 1) against four panels at once: four weight streams per core instead of
// one. A single row is bound by the weight stream, and one sequential stream per core left
// DRAM idle between requests (all SmolLM2 linears at M = 1: 23-28 ms -> 17-20 ms in
// interleaved A/B, up to ~32 GB/s). Each output is the same FMA chain as in panel_tile.
inline void row_four_panels(const float* x, const float* const* w, int64_t k, float* const* y,
                            const int64_t* cols, const float* const* bias) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
  const float *pa = w[0], *pb = w[1], *pc = w[2], *pd = w[3];
  for (int64_t i = 0; i < k; ++i) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pa + i * kNR), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pa + i * kNR + 8), a1);
    b0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pb + i * kNR), b0);
    b1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pb + i * kNR + 8), b1);
    c0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pc + i * kNR), c0);
    c1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pc + i * kNR + 8), c1);
    d0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pd + i * kNR), d0);
    d1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pd + i * kNR + 8), d1);
  }
  const __m256 acc[8] = {a0, a1, b0, b1, c0, c1, d0, d1};
  for (int s = 0; s < 4; ++s) {
    float tmp[kNR];
    _mm256_storeu_ps(tmp, acc[2 * s]);
    _mm256_storeu_ps(tmp + 8, acc[2 * s + 1]);
    for (int64_t j = 0; j < cols[s]; ++j) y[s][j] = bias[s] ? tmp[j] + bias[s][j] : tmp[j];
  }
}
#endif

#if STRAIT_AVX512
constexpr int64_t kMR512 = 12;  // rows of x per AVX-512 tile: 12 x 2 accumulators of 32 zmm

// R rows of x against two adjacent panels (32 output columns; one 16-float register holds a
// panel row): 2R accumulators. Each output is the same FMA chain over k as in panel_tile, so
// the AVX-512 and AVX2 paths give the same bits. `pair` points at the first panel, the second
// follows it in memory. With PF, tile `tile` of `tiles` requests row i of the next pair's
// panels every `tiles` iterations (see panel_tile).
template <int R, bool PF>
inline void pair_tile(const float* x, int64_t ldx, const float* pair, int64_t k, float* y,
                      int64_t ldy, int64_t cols, const float* bias, const float* next,
                      int64_t tile, int64_t tiles) {
  const float* q = pair + k * kNR;  // the second panel
  const float* pf = PF ? next + tile * kNR : nullptr;
  const float* pf_end = PF ? next + k * kNR : nullptr;
  int64_t countdown = 1;
  __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  __m512 a4 = a0, b4 = a0, a5 = a0, b5 = a0, a6 = a0, b6 = a0, a7 = a0, b7 = a0;
  __m512 a8 = a0, b8 = a0, a9 = a0, b9 = a0, a10 = a0, b10 = a0, a11 = a0, b11 = a0;
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (PF) {
      if (--countdown == 0) {
        countdown = tiles;
        if (pf < pf_end) {
          __builtin_prefetch(pf, 0, 3);
          __builtin_prefetch(pf + k * kNR, 0, 3);
        }
        pf += tiles * kNR;
      }
    }
    const __m512 w0 = _mm512_loadu_ps(pair + i * kNR);
    const __m512 w1 = _mm512_loadu_ps(q + i * kNR);
#define STRAIT_PAIR_ROW(r)                                    \
    if constexpr (R > r) {                                    \
      const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);       \
      a##r = _mm512_fmadd_ps(xv, w0, a##r);                   \
      b##r = _mm512_fmadd_ps(xv, w1, b##r);                   \
    }
    STRAIT_PAIR_ROW(0) STRAIT_PAIR_ROW(1) STRAIT_PAIR_ROW(2) STRAIT_PAIR_ROW(3)
    STRAIT_PAIR_ROW(4) STRAIT_PAIR_ROW(5) STRAIT_PAIR_ROW(6) STRAIT_PAIR_ROW(7)
    STRAIT_PAIR_ROW(8) STRAIT_PAIR_ROW(9) STRAIT_PAIR_ROW(10) STRAIT_PAIR_ROW(11)
#undef STRAIT_PAIR_ROW
  }
  const __m512 lo[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
  const __m512 hi[12] = {b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11};
  for (int r = 0; r < R; ++r) {
    float tmp[2 * kNR];
    _mm512_storeu_ps(tmp, lo[r]);
    _mm512_storeu_ps(tmp + kNR, hi[r]);
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}

// All `rows` rows of x against a pair of panels, twelve rows a tile. The same walk as
// panel_rows, written out: one generic walk (a lambda per tile size) measured 4-5% slower
// at 32 rows in A/B.
template <bool PF>
inline void pair_rows(const float* x, int64_t ldx, int64_t rows, const float* pair, int64_t k,
                      float* y, int64_t ldy, int64_t cols, const float* bias, const float* next) {
  const int64_t tiles = (rows + kMR512 - 1) / kMR512;
  int64_t r = 0, t = 0;
  for (; r + kMR512 <= rows; r += kMR512, ++t)
    pair_tile<kMR512, PF>(x + r * ldx, ldx, pair, k, y + r * ldy, ldy, cols, bias, next, t, tiles);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
#define STRAIT_PAIR_CASE(n) \
    case n: pair_tile<n, PF>(xr, ldx, pair, k, yr, ldy, cols, bias, next, t, tiles); break;
    STRAIT_PAIR_CASE(11) STRAIT_PAIR_CASE(10) STRAIT_PAIR_CASE(9) STRAIT_PAIR_CASE(8)
    STRAIT_PAIR_CASE(7) STRAIT_PAIR_CASE(6) STRAIT_PAIR_CASE(5) STRAIT_PAIR_CASE(4)
    STRAIT_PAIR_CASE(3) STRAIT_PAIR_CASE(2) STRAIT_PAIR_CASE(1)
#undef STRAIT_PAIR_CASE
    default: break;
  }
}
#endif

// x [M, K] . packed [P, K, 16] (+ bias [N]) -> [M, N]
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32, "x must be [M, K] f32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR, "packed weight must be [P, K, 16]");
  const auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "packed_linear: K mismatch");
  TORCH_CHECK(panels * kNR >= n && (panels - 1) * kNR < n, "packed_linear: N mismatch");
  auto out = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
#if STRAIT_AVX512
  if (m > 1) {  // pairs of panels; an odd last panel through the AVX2 tile
    const int64_t pairs = (panels + 1) / 2;
    at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = 2 * q;
        const float* panel = wp + p * k * kNR;
        const float* pb = bp ? bp + p * kNR : nullptr;
        if (p + 1 < panels) {
          const int64_t cols = std::min(2 * kNR, n - p * kNR);
          if (q + 1 < q1 && p + 3 < panels)
            pair_rows<true>(xp, k, m, panel, k, yp + p * kNR, n, cols, pb, panel + 2 * k * kNR);
          else
            pair_rows<false>(xp, k, m, panel, k, yp + p * kNR, n, cols, pb, nullptr);
        } else {
          panel_rows<false>(xp, k, m, panel, k, yp + p * kNR, n, std::min(kNR, n - p * kNR), pb,
                            nullptr);
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
#if STRAIT_AVX2
    if (m == 1) {  // the thread's panels in four quarters, read side by side
      const int64_t part = (p1 - p0) / 4;
      for (int64_t q = 0; q < part; ++q) {
        const float* w[4];
        float* y[4];
        int64_t cols[4];
        const float* b4[4];
        for (int s = 0; s < 4; ++s) {
          const int64_t ps = p0 + s * part + q;
          w[s] = wp + ps * k * kNR;
          y[s] = yp + ps * kNR;
          cols[s] = std::min(kNR, n - ps * kNR);
          b4[s] = bp ? bp + ps * kNR : nullptr;
        }
        row_four_panels(xp, w, k, y, cols, b4);
      }
      p = p0 + 4 * part;
    }
#endif
    for (; p < p1; ++p) {
      const int64_t cols = std::min(kNR, n - p * kNR);
      const float* panel = wp + p * k * kNR;
      const float* pb = bp ? bp + p * kNR : nullptr;
      if (m > kMR && p + 1 < p1)
        panel_rows<true>(xp, k, m, panel, k, yp + p * kNR, n, cols, pb, panel + k * kNR);
      else
        panel_rows<false>(xp, k, m, panel, k, yp + p * kNR, n, cols, pb, nullptr);
    }
  });
  return out;
}


// ------------------------------------------------------------------ block-quantized linear
//
// Weights in blocks of `group` inputs (GGUF's Q4_0 / Q4_1 / Q8_0, Strait's int4 / int8), read
// as stored: q the level, d (and m) the block's fp16 scale (and offset). 4 bits: w = q * d + m
// (Q4_1), or (q - 8) * d without offsets (Q4_0); 8 bits: w = q * d, q signed (Q8_0).
//
// Layout: panels of 16 output columns (zero padded), four panels to a group interleaved chunk
// by chunk, in 32-bit lanes of 4 bytes (the shape VNNI's vpdpbusd multiplies): 4 bits uint8
// [G, K / 8, 4, 16, 4], byte (c, s, j, t) = q[j, 8c + t] | q[j, 8c + 4 + t] << 4 of column
// 16 (4g + s) + j; 8 bits uint8 [G, K / 4, 4, 16, 4], byte = q[j, 4c + t] + 128; d and m fp16
// [G, K / group, 4, 16] (m empty: no offsets). Built by libs/engine/quant/blocks.py. Two ways through it (`act_bits`):
//
// - 32: float32 activations. Each weight widened exactly as the `gguf` package dequantises it
//   (the product, then the sum: no fused multiply-add), every output the same sequential FMA
//   chain over k as packed_linear's: a model served from its blocks gives the bits of the
//   float32 model converted from the same GGUF.
// - 8: activations quantised per 32 inputs to int8 (xq = round(x / xd), xd = absmax / 127, as
//   llama.cpp's Q8 blocks), integer dot products of levels and xq by vpdpbusd (64 products an
//   instruction; AVX2: vpmaddubsw + vpmaddwd, the same integers), then per block
//   y += d * xd * dot + m * xd * sum(xq) in float32. Not the
//   float model's bits; ~4x fewer instructions than widening every weight.

// Panels are stored four to a group, interleaved chunk by chunk (one sequential stream for the
// four panels one row reads side by side): chunk c of slot s at c * kQStride + s * 64 bytes,
// the scales of group g at g * kSStride + s * 16 halves.
constexpr int64_t kPanelsPerGroup = 4;
constexpr int64_t kQStride = kPanelsPerGroup * 64;
constexpr int64_t kSStride = kPanelsPerGroup * kNR;

#if STRAIT_AVX2
constexpr int64_t kQB = 32;  // inputs per activation block (act_bits 8)
constexpr int64_t kQPrefetch = STRAIT_QPF;  // chunks read ahead in each panel stream

struct QPanelPtr {
  const uint8_t* q;  // the panel's levels
  const uint16_t* d;  // its scales [K / group, 16]
  const uint16_t* m;  // its offsets, or nullptr
};
#endif

#if STRAIT_AVX512
constexpr int kQAcc = 16;  // 16-column accumulators a tile may hold (one zmm each)
constexpr bool kFiveRowTile = true;  // int8 activations: a 5-row x 4-panel tile (see QLinear)

inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
#if STRAIT_VNNI
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return acc;  // never reached: block_linear refuses int8 activations here (STRAIT_QDOT)
#endif
}

// y[r, 16p + j] = acc[r * NP + p][j] (+ bias[p][j]) for j < cols[p]: a tile's results out.
template <int R, int NP>
inline void store_tile(const __m512* acc, float* y, int64_t ldy, const int64_t* cols,
                       const float* const* bias) {
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) {
      float tmp[kNR];
      _mm512_storeu_ps(tmp, acc[r * NP + p]);
      float* yr = y + r * ldy + p * kNR;
      for (int64_t j = 0; j < cols[p]; ++j) yr[j] = bias[p] ? tmp[j] + bias[p][j] : tmp[j];
    }
  }
}

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// ---- float32 activations: R rows x NP panels, one sequential FMA chain per output.
template <int R, int NP, int BITS, bool OFFSET>
inline void qexact_tile(const float* x, int64_t ldx, const QPanelPtr* pn, int64_t k, int64_t group,
                        float* y, int64_t ldy, const int64_t* cols, const float* const* bias) {
  static_assert(R * NP <= 16, "too many accumulators");
#define STRAIT_ACC(r) __m512 c##r##_0 = _mm512_setzero_ps(), c##r##_1 = c##r##_0, c##r##_2 = c##r##_0, c##r##_3 = c##r##_0;
  STRAIT_ACC(0) STRAIT_ACC(1) STRAIT_ACC(2) STRAIT_ACC(3) STRAIT_ACC(4) STRAIT_ACC(5)
  STRAIT_ACC(6) STRAIT_ACC(7)
#undef STRAIT_ACC
#define STRAIT_FMA(r, p, w, i)                                                              \
  if constexpr (R > r && NP > p) c##r##_##p = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + (i)]), w, c##r##_##p);
#define STRAIT_FMA_ROWS(p, w, i)                                                               \
  STRAIT_FMA(0, p, w, i) STRAIT_FMA(1, p, w, i) STRAIT_FMA(2, p, w, i) STRAIT_FMA(3, p, w, i)  \
  STRAIT_FMA(4, p, w, i) STRAIT_FMA(5, p, w, i) STRAIT_FMA(6, p, w, i) STRAIT_FMA(7, p, w, i)
  constexpr int kChunk = BITS == 4 ? 8 : 4;  // inputs per 64-byte chunk of a panel
  const __m512i nibble = _mm512_set1_epi32(0x0F), byte = _mm512_set1_epi32(0xFF);
  const __m512i bias_q = _mm512_set1_epi32(BITS == 4 ? (OFFSET ? 0 : 8) : 128);
  __m512 scale[NP], offset[NP];
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const int64_t i0 = c * kChunk;
    if (i0 % group == 0) {
      for (int p = 0; p < NP; ++p) {
        scale[p] = load_half16(pn[p].d + (i0 / group) * kSStride);
        if constexpr (OFFSET) offset[p] = load_half16(pn[p].m + (i0 / group) * kSStride);
      }
    }
#define STRAIT_PANEL(p)                                                                        \
  if constexpr (NP > p) {                                                                      \
    const __m512i v = _mm512_loadu_si512(pn[p].q + c * kQStride);                                    \
    for (int t = 0; t < kChunk; ++t) {                                                         \
      const int shift = BITS == 4 ? (t % 4) * 8 + (t / 4) * 4 : t * 8;                         \
      const __m512i lv = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)),       \
                                          BITS == 4 ? nibble : byte);                          \
      __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lv, bias_q)), scale[p]);    \
      if constexpr (OFFSET) w = _mm512_add_ps(w, offset[p]);                                   \
      STRAIT_FMA_ROWS(p, w, i0 + t)                                                            \
    }                                                                                          \
  }
    STRAIT_PANEL(0) STRAIT_PANEL(1) STRAIT_PANEL(2) STRAIT_PANEL(3)
#undef STRAIT_PANEL
  }
#undef STRAIT_FMA_ROWS
#undef STRAIT_FMA
  const __m512 all[8][4] = {{c0_0, c0_1, c0_2, c0_3}, {c1_0, c1_1, c1_2, c1_3},
                            {c2_0, c2_1, c2_2, c2_3}, {c3_0, c3_1, c3_2, c3_3},
                            {c4_0, c4_1, c4_2, c4_3}, {c5_0, c5_1, c5_2, c5_3},
                            {c6_0, c6_1, c6_2, c6_3}, {c7_0, c7_1, c7_2, c7_3}};
  __m512 acc[R * NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r * NP + p] = all[r][p];
  store_tile<R, NP>(acc, y, ldy, cols, bias);
}

// ---- int8 activations: R rows x NP panels; xq [R, K] int8 (row stride ldq), xd and xs
// [R, K / 32] (row stride K / 32): each row's block scales and sums of levels.
template <int R, int NP, int BITS, bool OFFSET>
inline void qdot_tile(const int8_t* xq, int64_t ldq, const float* xd, const int32_t* xs,
                      const QPanelPtr* pn, int64_t k, int64_t group, float* y, int64_t ldy,
                      const int64_t* cols, const float* const* bias) {
  static_assert(R * NP <= 20, "too many accumulators");
  const int64_t nb = k / kQB;
  __m512 sum[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) sum[r][p] = _mm512_setzero_ps();
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  __m512 scale[NP], offset[NP];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kQB;
    if (i0 % group == 0) {
      for (int p = 0; p < NP; ++p) {
        scale[p] = load_half16(pn[p].d + (i0 / group) * kSStride);
        // The block's constant term per unit of xd * sum(xq): m (Q4_1), -8d (Q4_0: levels are
        // q - 8), -128d (8 bits: levels are stored + 128).
        if constexpr (OFFSET)
          offset[p] = load_half16(pn[p].m + (i0 / group) * kSStride);
        else
          offset[p] = _mm512_mul_ps(scale[p], _mm512_set1_ps(BITS == 4 ? -8.f : -128.f));
      }
    }
    __m512i dot[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) dot[r][p] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      for (int64_t c = i0 / 8; c < (i0 + kQB) / 8; ++c) {  // 8 inputs per 64-byte chunk
        for (int p = 0; p < NP; ++p) {
          // kQPrefetch chunks ahead in the group's stream (8 measured best of 8, 16, 24, 32,
          // 64; with the interleaved groups and huge pages, all SmolLM2 linears at one row
          // went 5.7 -> 4.3-4.4 ms).
          _mm_prefetch(reinterpret_cast<const char*>(pn[p].q + (c + kQPrefetch) * kQStride), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(pn[p].q + c * kQStride);
          const __m512i lo = _mm512_and_si512(v, nibbles);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xq + r * ldq + c * 8;
            int32_t x0, x1;
            std::memcpy(&x0, xr, 4);
            std::memcpy(&x1, xr + 4, 4);
            dot[r][p] = dpbusd(dot[r][p], lo, _mm512_set1_epi32(x0));
            dot[r][p] = dpbusd(dot[r][p], hi, _mm512_set1_epi32(x1));
          }
        }
      }
    } else {
      for (int64_t c = i0 / 4; c < (i0 + kQB) / 4; ++c) {  // 4 inputs per 64-byte chunk
        for (int p = 0; p < NP; ++p) {
          _mm_prefetch(reinterpret_cast<const char*>(pn[p].q + (c + kQPrefetch) * kQStride), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(pn[p].q + c * kQStride);
          for (int r = 0; r < R; ++r) {
            int32_t x0;
            std::memcpy(&x0, xq + r * ldq + c * 4, 4);
            dot[r][p] = dpbusd(dot[r][p], v, _mm512_set1_epi32(x0));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d_x = xd[r * nb + b];
      const __m512 vxd = _mm512_set1_ps(d_x), vxs = _mm512_set1_ps(d_x * float(xs[r * nb + b]));
      for (int p = 0; p < NP; ++p) {
        sum[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]), _mm512_mul_ps(scale[p], vxd),
                                    sum[r][p]);
        sum[r][p] = _mm512_fmadd_ps(offset[p], vxs, sum[r][p]);
      }
    }
  }
  store_tile<R, NP>(&sum[0][0], y, ldy, cols, bias);
}

// Quantise each row of x [M, K] in blocks of 32: xq int8 [M, K], xd [M, K / 32] (absmax /
// 127, 0 for an all-zero block), xs [M, K / 32] (sum of the block's levels).
inline void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd,
                          int32_t* xs) {
  const int64_t nb = k / kQB;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * kQB;
      const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const float d = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 vi = _mm512_set1_ps(inv);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a0, vi), _MM_FROUND_TO_NEAREST_INT));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a1, vi), _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + b * kQB), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + b * kQB + 16), _mm512_cvtsepi32_epi8(q1));
      xd[r * nb + b] = d;
      xs[r * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  }
}

#endif  // STRAIT_AVX512

#if !STRAIT_AVX512 && STRAIT_AVX2
// The same tiles on AVX2 (+ FMA, F16C): a panel's 16 columns as two 8-float halves, the same
// arithmetic in the same order, so both builds give the same bits (test_cpu_kernels holds
// them together on an AVX-512 machine). Without VNNI, a 4-byte dot product is vpmaddubsw then
// vpmaddwd: exact for 4-bit levels (|pair| <= 2 * 15 * 127); 8-bit levels are multiplied
// signed (sign trick, |pair| <= 2 * 128 * 127) and the stored +128 added back per block.
constexpr int kQAcc = 4;  // 16-column accumulators a tile may hold (two ymm each; 16 ymm in all)
constexpr bool kFiveRowTile = false;

struct Q16 {  // 16 float lanes: one panel's columns
  __m256 lo, hi;
};

inline Q16 q16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

inline Q16 load_half16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

template <int R, int NP>
inline void store_tile(const Q16* acc, float* y, int64_t ldy, const int64_t* cols,
                       const float* const* bias) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      float tmp[kNR];
      _mm256_storeu_ps(tmp, acc[r * NP + p].lo);
      _mm256_storeu_ps(tmp + 8, acc[r * NP + p].hi);
      float* yr = y + r * ldy + p * kNR;
      for (int64_t j = 0; j < cols[p]; ++j) yr[j] = bias[p] ? tmp[j] + bias[p][j] : tmp[j];
    }
  }
}

// ---- float32 activations (see the AVX-512 qexact_tile).
template <int R, int NP, int BITS, bool OFFSET>
inline void qexact_tile(const float* x, int64_t ldx, const QPanelPtr* pn, int64_t k, int64_t group,
                        float* y, int64_t ldy, const int64_t* cols, const float* const* bias) {
  constexpr int kChunk = BITS == 4 ? 8 : 4;
  const __m256i mask = _mm256_set1_epi32(BITS == 4 ? 0x0F : 0xFF);
  const __m256i bias_q = _mm256_set1_epi32(BITS == 4 ? (OFFSET ? 0 : 8) : 128);
  Q16 acc[R * NP];
#pragma GCC unroll 16
  for (int i = 0; i < R * NP; ++i) acc[i] = q16_zero();
  Q16 scale[NP], offset[NP];
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const int64_t i0 = c * kChunk;
    if (i0 % group == 0) {
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        scale[p] = load_half16(pn[p].d + (i0 / group) * kSStride);
        if constexpr (OFFSET) offset[p] = load_half16(pn[p].m + (i0 / group) * kSStride);
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn[p].q + c * kQStride));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn[p].q + c * kQStride + 32));
#pragma GCC unroll 8
      for (int t = 0; t < kChunk; ++t) {
        const __m128i shift = _mm_cvtsi32_si128(BITS == 4 ? (t % 4) * 8 + (t / 4) * 4 : t * 8);
        const __m256i l0 = _mm256_sub_epi32(_mm256_and_si256(_mm256_srl_epi32(v0, shift), mask), bias_q);
        const __m256i l1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_srl_epi32(v1, shift), mask), bias_q);
        __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(l0), scale[p].lo);
        __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(l1), scale[p].hi);
        if constexpr (OFFSET) {
          w0 = _mm256_add_ps(w0, offset[p].lo);
          w1 = _mm256_add_ps(w1, offset[p].hi);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_set1_ps(x[r * ldx + i0 + t]);
          acc[r * NP + p].lo = _mm256_fmadd_ps(xv, w0, acc[r * NP + p].lo);
          acc[r * NP + p].hi = _mm256_fmadd_ps(xv, w1, acc[r * NP + p].hi);
        }
      }
    }
  }
  store_tile<R, NP>(acc, y, ldy, cols, bias);
}

// acc + per 32-bit lane the sum of 4 products u8 x s8 (vpdpbusd without VNNI).
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  const __m256i pairs = _mm256_maddubs_epi16(u8, s8);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// ---- int8 activations (see the AVX-512 qdot_tile): the same integer dots, the same float
// updates once per block of 32 inputs.
template <int R, int NP, int BITS, bool OFFSET>
inline void qdot_tile(const int8_t* xq, int64_t ldq, const float* xd, const int32_t* xs,
                      const QPanelPtr* pn, int64_t k, int64_t group, float* y, int64_t ldy,
                      const int64_t* cols, const float* const* bias) {
  const int64_t nb = k / kQB;
  Q16 sum[R * NP];
#pragma GCC unroll 16
  for (int i = 0; i < R * NP; ++i) sum[i] = q16_zero();
  const __m256i nibbles = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  Q16 scale[NP], offset[NP];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kQB;
    if (i0 % group == 0) {
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        scale[p] = load_half16(pn[p].d + (i0 / group) * kSStride);
        if constexpr (OFFSET) {
          offset[p] = load_half16(pn[p].m + (i0 / group) * kSStride);
        } else {
          const __m256 f = _mm256_set1_ps(BITS == 4 ? -8.f : -128.f);
          offset[p] = {_mm256_mul_ps(scale[p].lo, f), _mm256_mul_ps(scale[p].hi, f)};
        }
      }
    }
    __m256i dot[R * NP][2];
#pragma GCC unroll 16
    for (int i = 0; i < R * NP; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    for (int64_t c = i0 / (BITS == 4 ? 8 : 4); c < (i0 + kQB) / (BITS == 4 ? 8 : 4); ++c) {
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(pn[p].q + (c + kQPrefetch) * kQStride), _MM_HINT_T0);
        const __m256i v[2] = {
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn[p].q + c * kQStride)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn[p].q + c * kQStride + 32))};
#pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) {
          if constexpr (BITS == 4) {
            // Pairs summed in 16 bits over the whole block (8 products of <= 2 * 15 * 127
            // each: < 2^15), widened once per block below.
            const __m256i lo = _mm256_and_si256(v[h], nibbles);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v[h], 4), nibbles);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              int32_t x0, x1;
              std::memcpy(&x0, xq + r * ldq + c * 8, 4);
              std::memcpy(&x1, xq + r * ldq + c * 8 + 4, 4);
              __m256i& d16 = dot[r * NP + p][h];
              d16 = _mm256_add_epi16(d16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
              d16 = _mm256_add_epi16(d16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
            }
          } else {
            const __m256i q = _mm256_xor_si256(v[h], flip);  // the signed level
            const __m256i mag = _mm256_sign_epi8(q, q);  // |q| (-128 reads as 128 unsigned)
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              int32_t x0;
              std::memcpy(&x0, xq + r * ldq + c * 4, 4);
              const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x0), q);
              dot[r * NP + p][h] = dot4(dot[r * NP + p][h], mag, sx);
            }
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float d_x = xd[r * nb + b];
      const __m256 vxd = _mm256_set1_ps(d_x), vxs = _mm256_set1_ps(d_x * float(xs[r * nb + b]));
      // 8 bits: the dot of the stored levels (q + 128), as vpdpbusd gives it.
      const __m256i stored = _mm256_set1_epi32(BITS == 8 ? 128 * xs[r * nb + b] : 0);
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        Q16& s = sum[r * NP + p];
        __m256i d0 = dot[r * NP + p][0], d1 = dot[r * NP + p][1];
        if constexpr (BITS == 4) {  // the block's 16-bit pair sums to 32 bits
          d0 = _mm256_madd_epi16(d0, _mm256_set1_epi16(1));
          d1 = _mm256_madd_epi16(d1, _mm256_set1_epi16(1));
        }
        d0 = _mm256_add_epi32(d0, stored);
        d1 = _mm256_add_epi32(d1, stored);
        s.lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(scale[p].lo, vxd), s.lo);
        s.hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(scale[p].hi, vxd), s.hi);
        s.lo = _mm256_fmadd_ps(offset[p].lo, vxs, s.lo);
        s.hi = _mm256_fmadd_ps(offset[p].hi, vxs, s.hi);
      }
    }
  }
  store_tile<R, NP>(sum, y, ldy, cols, bias);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Quantise each row of x in blocks of 32 (see the AVX-512 quantize_rows: the same levels).
inline void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd,
                          int32_t* xs) {
  const int64_t nb = k / kQB;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * kQB;
      __m256 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
      const float amax = hmax8(mx);
      const float d = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 vi = _mm256_set1_ps(inv);
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(a[i], vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // Saturating packs interleave 128-bit lanes; the permute restores the inputs' order.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + b * kQB),
                          _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      xd[r * nb + b] = d;
      xs[r * nb + b] = _mm_cvtsi128_si32(s4);
    }
  }
}
#endif  // STRAIT_AVX2

#if STRAIT_AVX2
// Rows [0, m) against panels [p0, p1) of one thread: four panels at a time for one row (four
// independent chains), two for more rows; tiles of rows below the accumulator limit.
template <int BITS, bool OFFSET>
struct QLinear {
  const float* x;
  const int8_t* xq;
  const float* xd;
  const int32_t* xs;
  int64_t m, k, n, group, panel_bytes, panel_scales;  // per group of four panels
  const uint8_t* qp;
  const uint16_t* dp;
  const uint16_t* mp;
  const float* bp;
  float* yp;
  bool exact;

  template <int NP>
  void panels_at(int64_t p) const {
    QPanelPtr pn[NP];
    int64_t cols[NP];
    const float* bias[NP];
    for (int j = 0; j < NP; ++j) {
      const int64_t g = (p + j) / kPanelsPerGroup, slot = (p + j) % kPanelsPerGroup;
      pn[j] = {qp + g * panel_bytes + slot * 64, dp + g * panel_scales + slot * kNR,
               OFFSET ? mp + g * panel_scales + slot * kNR : nullptr};
      cols[j] = std::min(kNR, n - (p + j) * kNR);
      bias[j] = bp ? bp + (p + j) * kNR : nullptr;
    }
    float* y = yp + p * kNR;
    constexpr int rows_exact = kQAcc / NP > 8 ? 8 : kQAcc / NP;  // rows per tile
    constexpr int rows_dot = rows_exact;
    int64_t r = 0;
    if (exact) {
      for (; r + rows_exact <= m; r += rows_exact)
        qexact_tile<rows_exact, NP, BITS, OFFSET>(x + r * k, k, pn, k, group, y + r * n, n, cols, bias);
      switch (m - r) {
#define STRAIT_CASE(R) \
  case R: if constexpr (R < rows_exact) qexact_tile<R, NP, BITS, OFFSET>(x + r * k, k, pn, k, group, y + r * n, n, cols, bias); break;
        STRAIT_CASE(1) STRAIT_CASE(2) STRAIT_CASE(3) STRAIT_CASE(4) STRAIT_CASE(5) STRAIT_CASE(6) STRAIT_CASE(7)
#undef STRAIT_CASE
        default: break;
      }
      return;
    }
    const int64_t nb = k / kQB;
    // Four-row tiles, but a last single row joins the tile before it: one five-row tile (its
    // float sums spill; the integer dots stay in registers) instead of a one-row tile that
    // unpacks every level again for one row. All SmolLM2 linears at 5 rows: 9.8 -> 8.8 ms.
    constexpr bool five = kFiveRowTile && NP == 4 && rows_dot == 4;
    const int64_t tiled = five && m > rows_dot && m % rows_dot == 1 ? m - 5 : m;
    for (; r + rows_dot <= tiled; r += rows_dot)
      qdot_tile<rows_dot, NP, BITS, OFFSET>(xq + r * k, k, xd + r * nb, xs + r * nb, pn, k, group,
                                            y + r * n, n, cols, bias);
    if constexpr (five) {
      if (m - r == 5) {
        qdot_tile<5, NP, BITS, OFFSET>(xq + r * k, k, xd + r * nb, xs + r * nb, pn, k, group,
                                       y + r * n, n, cols, bias);
        return;
      }
    }
    switch (m - r) {
#define STRAIT_CASE(R) \
  case R: if constexpr (R < rows_dot) qdot_tile<R, NP, BITS, OFFSET>(xq + r * k, k, xd + r * nb, xs + r * nb, pn, k, group, y + r * n, n, cols, bias); break;
      STRAIT_CASE(1) STRAIT_CASE(2) STRAIT_CASE(3) STRAIT_CASE(4) STRAIT_CASE(5) STRAIT_CASE(6) STRAIT_CASE(7)
#undef STRAIT_CASE
      default: break;
    }
  }

  // Whole groups of four panels (one sequential stream; with int8 activations four rows a
  // tile: 16 integer accumulators, the float sums updated once per 32 inputs), then the
  // last group's panels two and one at a time.
  void run(int64_t p0, int64_t p1) const {
    int64_t p = p0;
#if !STRAIT_AVX512
    // AVX2, several rows: one panel a tile and the most rows (each chunk's levels unpacked
    // once for all of them; the group's other panels follow from L2).
    if (m > 1) {
      for (; p < p1; ++p) panels_at<1>(p);
      return;
    }
#endif
    for (; p + 4 <= p1; p += 4) panels_at<4>(p);
    for (; p + 2 <= p1; p += 2) panels_at<2>(p);
    for (; p < p1; ++p) panels_at<1>(p);
  }
};
#endif

// x [M, K] float32 . block-quantized weight (+ bias [N]) -> [M, N] float32. `bits` 4 or 8;
// `act_bits` 32 (exact) or 8 (int8 activations, see above). Needs AVX2 (8: AVX2's or VNNI's
// integer dot, STRAIT_QDOT);
// the Python side serves these formats through torch's ops elsewhere.
torch::Tensor block_linear(const torch::Tensor& input, const torch::Tensor& qweight,
                           const torch::Tensor& scales, const torch::Tensor& mins, int64_t n,
                           int64_t bits, int64_t group, int64_t act_bits,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(STRAIT_AVX2, "block_linear needs AVX2 and FMA");
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32, "x must be [M, K] f32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(act_bits == 32 || (act_bits == 8 && STRAIT_QDOT),
              "act_bits must be 32 or 8 (AVX-512 VNNI or AVX2)");
  const auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = qweight.size(0);
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t chunk = bits == 4 ? 8 : 4;
  TORCH_CHECK(group > 0 && group % chunk == 0 && k % group == 0 &&
                  (act_bits == 32 || group % 32 == 0),
              "K must be a multiple of group, group of 8 (4 bits) or 4 (8 bits), and of 32 "
              "for int8 activations");
  TORCH_CHECK(qweight.dim() == 5 && qweight.size(1) == k / chunk &&
                  qweight.size(2) == kPanelsPerGroup && qweight.size(3) == kNR &&
                  qweight.size(4) == 4 && qweight.scalar_type() == torch::kByte &&
                  qweight.is_contiguous(),
              "qweight must be uint8 [G, K / 8 (4 bits) or K / 4 (8 bits), 4, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.dim() == 4 && scales.size(0) == groups && scales.size(1) == k / group &&
                  scales.size(2) == kPanelsPerGroup && scales.size(3) == kNR,
              "scales must be fp16 [G, K / group, 4, 16]");
  const bool offset = mins.numel() > 0;
  TORCH_CHECK(!offset || (bits == 4 && mins.sizes() == scales.sizes() &&
                          mins.scalar_type() == torch::kHalf && mins.is_contiguous()),
              "offsets (4 bits only) must be fp16 shaped like the scales");
  TORCH_CHECK(groups * kPanelsPerGroup * kNR >= n && (groups - 1) * kPanelsPerGroup * kNR < n,
              "block_linear: N mismatch");
  auto out = torch::empty({m, n}, x.options());
#if STRAIT_AVX2
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  // The activations' int8 blocks in scratch memory of the calling thread (reused by every
  // call: three tensor allocations a linear were ~0.35 ms of a one-row step).
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> xd_buf;
  thread_local std::vector<int32_t> xs_buf;
  const bool exact = act_bits == 32;
  if (!exact) {
    TORCH_CHECK(k % kQB == 0, "int8 activations need K a multiple of 32");
    xq_buf.resize(m * k);
    xd_buf.resize(m * (k / kQB));
    xs_buf.resize(m * (k / kQB));
    quantize_rows(x.data_ptr<float>(), m, k, xq_buf.data(), xd_buf.data(), xs_buf.data());
  }
  auto launch = [&](auto job) {
    // Grain: whole groups of four panels per task, so one row keeps its four chains.
    at::parallel_for(0, (panels + 3) / 4, 1, [&](int64_t t0, int64_t t1) {
      job.run(4 * t0, std::min(panels, 4 * t1));
    });
  };
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* mp = offset ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  const int64_t panel_bytes = (k / chunk) * kQStride, panel_scales = (k / group) * kSStride;
  const int8_t* xq = exact ? nullptr : xq_buf.data();
  const float* xd = exact ? nullptr : xd_buf.data();
  const int32_t* xs = exact ? nullptr : xs_buf.data();
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  if (bits == 8)
    launch(QLinear<8, false>{xp, xq, xd, xs, m, k, n, group, panel_bytes, panel_scales, qp, dp,
                             nullptr, bp, yp, exact});
  else if (offset)
    launch(QLinear<4, true>{xp, xq, xd, xs, m, k, n, group, panel_bytes, panel_scales, qp, dp, mp,
                            bp, yp, exact});
  else
    launch(QLinear<4, false>{xp, xq, xd, xs, m, k, n, group, panel_bytes, panel_scales, qp, dp,
                             nullptr, bp, yp, exact});
#endif
  return out;
}

// ------------------------------------------------------------------ paged attention

#if STRAIT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax after subtracting the max): range reduction to r in [-ln2/2, ln2/2]
// and a degree-6 polynomial; relative error ~2e-7. Inputs below -87 give ~0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

inline float dot(const float* a, const float* b, int64_t d) {
#if STRAIT_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  float s = hsum(_mm256_add_ps(s0, s1));
#else
  float s = 0.f;
  int64_t i = 0;
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

#if STRAIT_AVX2
// Lane j of the result = the sum of the eight lanes of a_j.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  // hadd pairs within 128-bit halves: u0 = [a0..a3 low-half sums | a0..a3 high-half sums]
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Eight keys at once (rows k, k + d, ..., k + 7d; d a multiple of 8): lane j = q . k_j.
// Eight independent FMA chains instead of one per key, and one reduction for all eight.
inline __m256 dot8(const float* q, const float* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * d + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * d + i), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * d + i), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * d + i), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * d + i), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * d + i), a7);
  }
  return hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
}
#endif

// Ask for `floats` floats from p into L2, one request per 64-byte line. Each KV block is a
// separate, randomly placed 4 KB run (block_size 16 x head dim 64), where the hardware
// prefetcher starts cold; the attention loops request the next block ahead of use. Into L2,
// not L1 (locality 2: prefetcht1): a block's 64 requests at once overflow L1's miss buffers;
// in interleaved A/B (30 layers, 8-64 rows) attention ran 1.15-1.36x faster than with L1.
inline void prefetch_floats(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 2);
}

// scores[0:len] <- exp(scores - max); returns the sum.
inline float softmax_numerators(float* scores, int64_t len) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < len; ++j) mx = std::max(mx, scores[j]);
  float sum = 0.f;
  int64_t j = 0;
#if STRAIT_AVX2
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmx));
    _mm256_storeu_ps(scores + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; j < len; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  return sum;
}

// out[0:d] = inv * sum_j p[j] * v_j over the first `len` tokens of the sequence's blocks.
inline void weighted_values(const float* p, int64_t len, const float* v_head, const int64_t* table,
                            int64_t bs, int64_t d, float inv, float* out) {
  int64_t d0 = 0;
#if STRAIT_AVX2
  // 64 columns at a time in eight named accumulators (an array would be spilled every key).
  for (; d0 + 64 <= d; d0 += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j0 = 0, blk = 0; j0 < len; j0 += bs, ++blk) {
      const int64_t n = std::min(bs, len - j0);
      const float* vb = v_head + table[blk] * bs * d + d0;
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pj = _mm256_set1_ps(p[j0 + t]);
        const float* v = vb + t * d;
        a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 56), a7);
      }
    }
    const __m256 vi = _mm256_set1_ps(inv);
    _mm256_storeu_ps(out + d0, _mm256_mul_ps(a0, vi));
    _mm256_storeu_ps(out + d0 + 8, _mm256_mul_ps(a1, vi));
    _mm256_storeu_ps(out + d0 + 16, _mm256_mul_ps(a2, vi));
    _mm256_storeu_ps(out + d0 + 24, _mm256_mul_ps(a3, vi));
    _mm256_storeu_ps(out + d0 + 32, _mm256_mul_ps(a4, vi));
    _mm256_storeu_ps(out + d0 + 40, _mm256_mul_ps(a5, vi));
    _mm256_storeu_ps(out + d0 + 48, _mm256_mul_ps(a6, vi));
    _mm256_storeu_ps(out + d0 + 56, _mm256_mul_ps(a7, vi));
  }
#endif
  for (; d0 < d; ++d0) {  // head dims that are not a multiple of 64 (and non-AVX2 CPUs)
    float a = 0.f;
    for (int64_t j = 0; j < len; ++j) a = std::fma(p[j], v_head[(table[j / bs] * bs + j % bs) * d + d0], a);
    out[d0] = a * inv;
  }
}

#if STRAIT_AVX512
// The query heads that share one KV head (G of them), attended together: each key and value
// is loaded once for the G heads instead of once per head. Every head's arithmetic is exactly
// dot8's and weighted_values' (the same FMA chains in the same order, the same reduction), so
// results are bit-identical to attending the heads one at a time. G <= 3: G x 8 accumulators
// must stay in the 32 vector registers.
template <int G>
inline void dot8_heads(const float* q, int64_t d, const float* k, float scale, float* scores,
                       int64_t ld) {
  __m256 a[G][8];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(q + g * d + i);
    for (int j = 0; j < 8; ++j) {
      const __m256 kj = _mm256_loadu_ps(k + j * d + i);
      for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(qv[g], kj, a[g][j]);
    }
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    _mm256_storeu_ps(scores + g * ld, _mm256_mul_ps(hsum8(a[g][0], a[g][1], a[g][2], a[g][3], a[g][4],
                                                           a[g][5], a[g][6], a[g][7]),
                                                     vscale));
}

// a[g][c] += p[g * ld + t] * v_t[16c : 16c + 16] for keys t < n, in order: G heads' sums over
// 64 value columns (vb: the first key's columns in a block [n, d]).
template <int G>
inline void fma_values(__m512 (&a)[G][4], const float* p, int64_t ld, const float* vb, int64_t n,
                       int64_t d) {
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vb + t * d;
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16),
                 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * ld + t]);
      a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(pj, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(pj, v3, a[g][3]);
    }
  }
}

// One (row, KV head) item's scores for a key block of n keys, G heads at once.
template <int G>
inline void block_scores_heads(const float* q0, int64_t d, const float* kb, int64_t n,
                               float scale, float* scores, int64_t len) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) dot8_heads<G>(q0, d, kb + t * d, scale, scores + t, len);
  for (; t < n; ++t)
    for (int g = 0; g < G; ++g) scores[g * len + t] = dot(q0 + g * d, kb + t * d, d) * scale;
}
#endif

#if STRAIT_AVX512
constexpr int64_t kRunRows = 16;  // rows of one block table attended together, at most

// Rows [r0, r1) that share one block table (one sequence's decode row and its speculative
// rows, or a prefill chunk) for KV head kh, G query heads each: every key and value block is
// read once for all of them (from L1 after the first row) instead of once per row. Each row's
// arithmetic is the row-by-row path's (dot8's chains in block_scores_heads; softmax_numerators;
// weighted_values' FMA chain over the keys in order, in fma_values, kept in `acc` between
// blocks), so its bits do not depend on which rows share its run.
template <int G>
void attend_run(const float* qp, int64_t h, int64_t d, const float* kh_base,
                const float* vh_base, const int64_t* table, int64_t bs, const int64_t* lens,
                int64_t r0, int64_t r1, int64_t kh, float scale, float* op,
                std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t nr = r1 - r0;
  int64_t off[kRunRows + 1];  // row i's scores [G, len_i] start at off[i]
  int64_t max_len = 0;
  off[0] = 0;
  for (int64_t i = 0; i < nr; ++i) {
    max_len = std::max(max_len, lens[r0 + i]);
    off[i + 1] = off[i] + G * lens[r0 + i];
  }
  scores.resize(off[nr]);
  for (int64_t j0 = 0, blk = 0; j0 < max_len; j0 += bs, ++blk) {
    const float* kb = kh_base + table[blk] * bs * d;
    if (j0 + bs < max_len) prefetch_floats(kh_base + table[blk + 1] * bs * d, bs * d);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t len = lens[r0 + i];
      if (j0 >= len) continue;
      block_scores_heads<G>(qp + ((r0 + i) * h + kh * G) * d, d, kb, std::min(bs, len - j0),
                            scale, scores.data() + off[i] + j0, len);
    }
  }
  float inv[kRunRows][G];
  for (int64_t i = 0; i < nr; ++i)
    for (int g = 0; g < G; ++g)
      inv[i][g] = 1.f / softmax_numerators(scores.data() + off[i] + g * lens[r0 + i], lens[r0 + i]);
  acc.assign(nr * G * d, 0.f);  // row i, head g: acc[(i * G + g) * d + c]
  for (int64_t j0 = 0, blk = 0; j0 < max_len; j0 += bs, ++blk) {
    const float* vb = vh_base + table[blk] * bs * d;
    if (j0 + bs < max_len) prefetch_floats(vh_base + table[blk + 1] * bs * d, bs * d);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t len = lens[r0 + i];
      if (j0 >= len) continue;
      const int64_t n = std::min(bs, len - j0);
      const float* p = scores.data() + off[i] + j0;
      float* ai = acc.data() + i * G * d;
      for (int64_t d0 = 0; d0 < d; d0 += 64) {
        __m512 a[G][4];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(ai + g * d + d0 + 16 * c);
        fma_values<G>(a, p, len, vb + d0, n, d);
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(ai + g * d + d0 + 16 * c, a[g][c]);
      }
    }
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int g = 0; g < G; ++g) {
      const __m512 vi = _mm512_set1_ps(inv[i][g]);
      float* o = op + ((r0 + i) * h + kh * G + g) * d;
      for (int64_t c = 0; c < d; c += 16)
        _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + (i * G + g) * d + c), vi));
    }
}
#endif

constexpr int64_t kAttnGrain = 4;  // (row, KV head) items below which one thread attends

// One query row per token, each over the first context_lens[r] keys of its own block table: a
// decode token sees its whole sequence, token i of a prefill chunk starting at position s the
// keys 0..s+i (causal). q [T, H, D]; k_cache, v_cache [Hkv, num_blocks, block_size, D] (last
// three dims contiguous); block_tables [T, max_blocks] int64 (the row's sequence's blocks,
// padded past them); context_lens [T] int64 -> out [T, H, D]. Query head h reads KV head
// h / (H / Hkv). A row's result does not depend on the other rows.
torch::Tensor paged_row_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat32, "bad k_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must match");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "cache blocks must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens must be int64");
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t rows = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(0), bs = k_cache.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == d && h % hkv == 0, "head shapes do not match");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && lens.numel() == rows,
              "block_tables must be [T, max_blocks] and context_lens [T]");
  const int64_t groups = h / hkv, head_stride = k_cache.stride(0);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

#if STRAIT_AVX512
  // Head dims a multiple of 64 and 2 or 3 query heads a KV head: runs of rows (attend_run).
  if (d % 64 == 0 && (groups == 2 || groups == 3)) {
    // Runs of consecutive rows with the same block table, at most kRunRows each.
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (int64_t r = 0; r < rows;) {
      int64_t e = r + 1;
      while (e < rows && e - r < kRunRows &&
             std::equal(tp + e * max_blocks, tp + (e + 1) * max_blocks, tp + r * max_blocks))
        ++e;
      runs.emplace_back(r, e);
      r = e;
    }
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(lp[r] > 0 && lp[r] <= max_blocks * bs, "context length outside the block table");
    const int64_t items = static_cast<int64_t>(runs.size()) * hkv;
    // As below: a step of few (row, KV head) pairs runs on the calling thread.
    at::parallel_for(0, items, rows * hkv <= kAttnGrain ? items : 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores, acc;
      for (int64_t i = i0; i < i1; ++i) {
        const auto [r0, r1] = runs[i / hkv];
        const int64_t kh = i % hkv;
        const int64_t* table = tp + r0 * max_blocks;
        const float* kh_base = kp + kh * head_stride;
        const float* vh_base = vp + kh * head_stride;
        if (groups == 3)
          attend_run<3>(qp, h, d, kh_base, vh_base, table, bs, lp, r0, r1, kh, fscale, op, scores, acc);
        else
          attend_run<2>(qp, h, d, kh_base, vh_base, table, bs, lp, r0, r1, kh, fscale, op, scores, acc);
      }
    });
    return out;
  }
#endif
  // Grain of kAttnGrain items: a step with few rows (one sequence decoding: 3 items) runs on
  // the calling thread, without waking the pool for microseconds of work.
  at::parallel_for(0, rows * hkv, kAttnGrain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / hkv, kh = i % hkv, len = lp[row];
      TORCH_CHECK(len > 0 && len <= max_blocks * bs, "context length outside the block table");
      scores.resize(groups * len);
      const int64_t* table = tp + row * max_blocks;
      const float* kh_base = kp + kh * head_stride;
      const float* vh_base = vp + kh * head_stride;
      const float* q0 = qp + (row * h + kh * groups) * d;
      // scores[g, j] = q_g . k_j * scale, block by block (no division per key), requesting
      // the next key block and this block's values ahead of use.
      for (int64_t j0 = 0, blk = 0; j0 < len; j0 += bs, ++blk) {
        const int64_t n = std::min(bs, len - j0);
        const float* kb = kh_base + table[blk] * bs * d;
        if (j0 + bs < len) prefetch_floats(kh_base + table[blk + 1] * bs * d, bs * d);
        prefetch_floats(vh_base + table[blk] * bs * d, n * d);  // for the value pass
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = q0 + g * d;
          float* sg = scores.data() + g * len + j0;
          int64_t t = 0;
#if STRAIT_AVX2
          if (d % 8 == 0) {
            const __m256 vscale = _mm256_set1_ps(fscale);
            for (; t + 8 <= n; t += 8)
              _mm256_storeu_ps(sg + t, _mm256_mul_ps(dot8(qg, kb + t * d, d), vscale));
          }
#endif
          for (; t < n; ++t) sg[t] = dot(qg, kb + t * d, d) * fscale;
        }
      }
      // The next item's first key block, while this item's values are read (from L2): each
      // item would otherwise start with a cold block (1.06-1.17x at 8-64 rows in A/B).
      if (i + 1 < i1) {
        const int64_t next_row = (i + 1) / hkv, next_kh = (i + 1) % hkv;
        prefetch_floats(kp + next_kh * head_stride + tp[next_row * max_blocks] * bs * d, bs * d);
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * len;
        const float inv = 1.f / softmax_numerators(s, len);
        weighted_values(s, len, vh_base, table, bs, d, inv, op + (row * h + kh * groups + g) * d);
      }
    }
  });
  return out;
}

// A whole step's attention for one layer, in one call: write every token's K/V into the paged
// cache, then attend each token's query row (paged_row_attention; all writes come first, and a
// row sees only positions up to its own). query [T, H, D]; key, value [T, Hkv, D]; kv the whole
// cache [layers, 2, Hkv, num_blocks, block_size, D] (written at `layer`); slot_mapping [T]
// int64 (flat slot = block * block_size + offset) -> out [T, H, D].
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, torch::Tensor& kv, int64_t layer,
                              const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous() && kv.scalar_type() == torch::kFloat32,
              "kv must be a contiguous float32 [layers, 2, Hkv, blocks, block_size, D]");
  TORCH_CHECK(layer >= 0 && layer < kv.size(0), "layer out of range");
  const int64_t hkv = kv.size(2), slots_per_head = kv.size(3) * kv.size(4), d = kv.size(5);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == hkv && key.size(2) == d &&
                  key.sizes() == value.sizes() && key.scalar_type() == torch::kFloat32 &&
                  value.scalar_type() == torch::kFloat32,
              "key and value must be float32 [T, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == key.size(0),
              "slot_mapping must be int64 [T]");
  auto k_cache = kv.select(0, layer).select(0, 0);  // [Hkv, blocks, block_size, D]
  auto v_cache = kv.select(0, layer).select(0, 1);
  const auto k = key.contiguous(), v = value.contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t i = 0; i < k.size(0); ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots_per_head, "slot outside the cache");
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t dst = (h * slots_per_head + sp[i]) * d, src = (i * hkv + h) * d;
      std::copy(kp + src, kp + src + d, kc + dst);
      std::copy(vp + src, vp + src + d, vc + dst);
    }
  }
  return paged_row_attention(query, k_cache, v_cache, block_tables, context_lens, scale);
}

// ------------------------------------------------------------------ greedy arg-max

// Index of the first maximum of x[0:n], as torch.argmax: a NaN counts as the maximum (the
// first NaN wins); ties go to the lower index. Four groups of eight running maxima (AVX2), each
// lane with the index of its first occurrence (strict ">" keeps the earlier of equal values);
// four independent compare-blend chains instead of one (3.4x -> ~9x torch's in a
// micro-benchmark), merged at the end by value, then lowest index.
inline int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_v = n > 0 ? x[0] : 0.f;
#if STRAIT_AVX2
  constexpr int kChains = 4;
  if (n >= 8 * kChains) {
    __m256 vmax[kChains];
    __m256i vidx[kChains];
    __m256 unordered = _mm256_setzero_ps();
    for (int c = 0; c < kChains; ++c) {
      vmax[c] = _mm256_loadu_ps(x + 8 * c);
      vidx[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                 _mm256_set1_epi32(8 * c));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(vmax[c], vmax[c], _CMP_UNORD_Q));
    }
    __m256i cur = vidx[0];
    const __m256i step = _mm256_set1_epi32(8), chunk = _mm256_set1_epi32(8 * kChains);
    for (i = 8 * kChains; i + 8 * kChains <= n; i += 8 * kChains) {
      cur = _mm256_add_epi32(cur, chunk);
      __m256i c_idx = cur;
      for (int c = 0; c < kChains; ++c, c_idx = _mm256_add_epi32(c_idx, step)) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, vmax[c], _CMP_GT_OQ);
        vmax[c] = _mm256_blendv_ps(vmax[c], v, gt);
        vidx[c] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(vidx[c]), _mm256_castsi256_ps(c_idx), gt));
      }
    }
    if (_mm256_movemask_ps(unordered)) {  // a NaN: the first one is the answer
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(32) float mv[8 * kChains];
    alignas(32) int32_t mi[8 * kChains];
    for (int c = 0; c < kChains; ++c) {
      _mm256_store_ps(mv + 8 * c, vmax[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(mi + 8 * c), vidx[c]);
    }
    best_v = mv[0];
    best = mi[0];
    for (int l = 1; l < 8 * kChains; ++l)
      if (mv[l] > best_v || (mv[l] == best_v && mi[l] < best)) best_v = mv[l], best = mi[l];
  }
#endif
  // The tail (all of a short row), in order after NaN-free elements: the first NaN is this
  // one; otherwise later indices win only when greater.
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best_v) best_v = x[i], best = i;
  }
  return best;
}

// logits [S, V] float32 -> [S] int64: torch.argmax(logits, -1), bit for bit, rows in parallel.
// Called by the sampler (greedy rows, and the sampled rows' exponential race): torch.argmax
// along the last dim took 1.3 ms for 32 x 49152 logits here (25x torch.amax over the same
// logits; ~2% of a 32-sequence step).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "logits must be float32 [S, V]");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= INT32_MAX, "vocab size out of range");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

// logits [S, V] float32, modified in place: in row rows[j], every token whose bit is clear in
// bitmask[j] ([R, W] int32, bit b of word w is token 32 * w + b; tokens past 32 * W are
// disallowed) becomes -inf. Called by the sampler for the rows of constrained sequences
// (libs/engine/structured.py); llguidance fills the bitmask. Unpacking the bits with torch ops
// took ~4 ms for 32 x 49152 logits here, this ~0.1 ms.
void mask_rows(torch::Tensor logits, const torch::Tensor& rows, const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.is_contiguous(),
              "logits must be contiguous float32 [S, V]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong, "rows must be int64 [R]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt &&
                  bitmask.is_contiguous() && bitmask.size(0) == rows.size(0),
              "bitmask must be contiguous int32 [R, W]");
  const int64_t n = logits.size(1), words = bitmask.size(1), r_count = rows.size(0);
  const auto rows_c = rows.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  for (int64_t j = 0; j < r_count; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < logits.size(0), "row index out of range");
  float* xp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, r_count, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      float* x = xp + rp[j] * n;
      const uint32_t* b = bp + j * words;
      for (int64_t w = 0; w < words && 32 * w < n; ++w) {
        const uint32_t bits = b[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t end = std::min<int64_t>(32, n - 32 * w);
        for (int64_t t = 0; t < end; ++t)
          if (!((bits >> t) & 1u)) x[32 * w + t] = ninf;
      }
      for (int64_t t = 32 * words; t < n; ++t) x[t] = ninf;
    }
  });
}

}  // namespace

// The same kernels as dispatcher ops (torch.ops.strait.*), which torch.compile keeps as opaque
// nodes; their shape functions ("fake" kernels) are registered in kernels/ops.py.
// A build with STRAIT_NO_OPS (tests: the AVX2 path beside an AVX-512 build in one process)
// registers none: an op library may be defined once per process.
#ifndef STRAIT_NO_OPS
TORCH_LIBRARY(strait, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def(
      "block_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int n, int bits, "
      "int group, int act_bits, Tensor? bias) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv, int layer, "
      "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(strait, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("block_linear", &block_linear);
  m.impl("paged_attention", &paged_attention);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "w [N, K] -> packed [ceil(N/16), K, 16]");
  m.def("packed_linear", &packed_linear, "x [M, K] . packed weight (+ bias) -> [M, N]");
  m.def("block_linear", &block_linear,
        "x [M, K] . block-quantized weight (4 or 8 bits, fp16 scales) (+ bias) -> [M, N]");
  m.def("paged_row_attention", &paged_row_attention,
        "one query row per token over its sequence's KV blocks");
  m.def("paged_attention", &paged_attention,
        "write every token's K/V, then attend (one query row per token)");
  m.def("argmax_rows", &argmax_rows, "logits [S, V] -> [S] int64, as torch.argmax(-1)");
  m.def("mask_rows", &mask_rows,
        "logits [S, V] (in place): -inf where rows' bitmask [R, W] int32 bits are clear");
  m.attr("avx2") = static_cast<bool>(STRAIT_AVX2);
  m.attr("avx512") = static_cast<bool>(STRAIT_AVX512);
  m.attr("vnni") = static_cast<bool>(STRAIT_VNNI);
  m.attr("int8_dot") = static_cast<bool>(STRAIT_QDOT);  // block_linear's int8 activations
}
