// The block kernel's tiles on AVX-512: one zmm register holds a panel's 16 columns; int8
// activations by VNNI's vpdpbusd. Included by block_linear.cpp alone (QLinear runs these
// tiles); block_tiles_avx2.h holds the same tiles for AVX2 builds, which give the same bits.

#pragma once

#include "block_layout.h"

#include <cstring>

namespace strait::block {

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

}  // namespace strait::block
