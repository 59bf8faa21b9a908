// The sampler's passes over rows of logits: `argmax_rows` (torch.argmax along the vocabulary,
// the same index in every case) and `mask_rows` (a structured-output bitmask applied in place).
//
// Called through bindings.cpp by libs/engine/sampler.py, through the engine: greedy rows and
// the sampled rows' exponential race take the arg-max; constrained rows
// (libs/engine/structured.py) are masked first.

#include "cpu_isa.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace strait {
namespace {

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

}  // namespace

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

}  // namespace strait
