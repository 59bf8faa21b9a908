// Strait's linear over pre-packed float32 weights: `pack_weight` re-lays a weight once at load,
// `packed_linear` multiplies by it every step.
//
// Called through bindings.cpp by libs/engine/kernels/linear.py (PackedLinear: every float32
// nn.Linear of a CPU model) and, as torch.ops.strait.packed_linear, from compiled graphs.
// AVX2 + FMA 6-row tiles over one panel (and one row against four panels side by side), a plain
// C++ loop on other CPUs, and AVX-512 12-row tiles over two panels from two rows up where the
// build targets AVX-512: the same results, bit for bit.
//
// Numerics: every output is one sequential fused-multiply-add chain over k = 0..K-1, whatever M
// is and wherever the row sits in the batch, so a sequence's logits do not depend on how many
// other sequences share its step.

#include "cpu_isa.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace strait {

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

namespace {

constexpr int64_t kMR = 6;  // rows of x per micro-tile: 6 x 2 accumulators + 2 weight registers

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

}  // namespace

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

}  // namespace strait
