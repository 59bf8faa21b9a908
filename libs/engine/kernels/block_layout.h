// The block-quantized weight format block_linear.cpp reads, and what its tiles share.
// Included by block_linear.cpp and by the tiles it runs (block_tiles_avx512.h,
// block_tiles_avx2.h); libs/engine/quant/blocks.py writes the same layout from Python.
//
// Weights in blocks of `group` inputs (GGUF's Q4_0 / Q4_1 / Q8_0, Strait's int4 / int8), read
// as stored: q the level, d (and m) the block's fp16 scale (and offset). 4 bits: w = q * d + m
// (Q4_1), or (q - 8) * d without offsets (Q4_0); 8 bits: w = q * d, q signed (Q8_0).
//
// Layout: panels of 16 output columns (zero padded), four panels to a group interleaved chunk
// by chunk, in 32-bit lanes of 4 bytes (the shape VNNI's vpdpbusd multiplies): 4 bits uint8
// [G, K / 8, 4, 16, 4], byte (c, s, j, t) = q[j, 8c + t] | q[j, 8c + 4 + t] << 4 of column
// 16 (4g + s) + j; 8 bits uint8 [G, K / 4, 4, 16, 4], byte = q[j, 4c + t] + 128; d and m fp16
// [G, K / group, 4, 16] (m empty: no offsets). Two ways through it (`act_bits`):
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

#pragma once

#include "cpu_isa.h"
#include "kernels.h"

#include <cstdint>

// Chunks of 64 bytes read ahead in each panel stream by the int8 tiles; -DSTRAIT_QPF=n for a
// build that tries another distance.
#ifndef STRAIT_QPF
#define STRAIT_QPF 8
#endif

namespace strait::block {

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

}  // namespace strait::block
