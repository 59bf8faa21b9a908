// Strait's paged attention: one query row per token (decode tokens and prefill chunks alike),
// each reading its own sequence's KV blocks in place through its block table; no gather, no
// mask. `paged_attention` writes a step's new K/V into the cache first, then attends.
//
// Called through bindings.cpp by libs/engine/attention.py for every token of a float32 CPU
// model, as torch.ops.strait.paged_attention from compiled graphs. AVX2 + FMA vector paths with
// plain C++ loops on other CPUs; where the build targets AVX-512, runs of rows that share a block
// table and the query heads that share a KV head are attended together. A row's result, bit
// for bit, does not depend on the other rows nor on the path that computed it.

#include "cpu_isa.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace strait {
namespace {

#if STRAIT_AVX2
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

}  // namespace

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

}  // namespace strait
