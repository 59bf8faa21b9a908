// The instruction sets a build of Strait's CPU kernels targets, and the 8-lane horizontal
// reductions (attention's sums, the block kernel's activation maxima).
//
// Included by every kernel source (packed_linear.cpp, block_linear.cpp,
// paged_attention.cpp, sampler.cpp) and by bindings.cpp, which reports the macros to Python as
// the module's `avx2` / `avx512` / `vnni` / `int8_dot` attributes. What the compiler targets
// decides everything: the loader (libs/engine/kernels/__init__.py) builds with -march=native,
// and its "avx2" variant adds -mno-avx512f, so these macros are compile-time constants and no
// kernel tests the CPU at run time.
//
// STRAIT_AVX2    AVX2 + FMA: every family's vector paths (and F16C, which every AVX2 CPU
//                has and the block kernel's fp16 scales use; not tested separately).
// STRAIT_AVX512  AVX-512 F/BW/VL on top: the linears' wider tiles, attention's multi-row runs.
// STRAIT_VNNI    AVX-512 VNNI: the block kernel's int8 dot products by vpdpbusd.
// STRAIT_QDOT    the block kernel takes int8 activations (VNNI, or AVX2's vpmaddubsw where
//                there is no AVX-512); an AVX-512 CPU without VNNI has the exact path only.
// Without AVX2 the kernels run their plain C++ loops (and block_linear refuses to run).

#pragma once

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
#if STRAIT_AVX512 && defined(__AVX512VNNI__)
#define STRAIT_VNNI 1
#else
#define STRAIT_VNNI 0
#endif
#define STRAIT_QDOT (STRAIT_VNNI || (STRAIT_AVX2 && !STRAIT_AVX512))

namespace strait {

#if STRAIT_AVX2
// The sum of the 8 lanes of v (pairwise: lanes i and i + 4, then i and i + 2, then 0 and 1).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of the 8 lanes of v.
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

}  // namespace strait
