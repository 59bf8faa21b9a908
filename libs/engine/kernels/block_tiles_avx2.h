// The block kernel's tiles on AVX2 (+ FMA, F16C), for builds without AVX-512. Included by
// block_linear.cpp alone (QLinear runs these tiles); block_tiles_avx512.h holds the AVX-512 ones.

#pragma once

#include "block_layout.h"

#include <cstring>

namespace strait::block {

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

}  // namespace strait::block
