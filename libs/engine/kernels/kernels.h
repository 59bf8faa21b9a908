// The entry points of Strait's CPU kernels, one source file per family, and the panel width
// the two linears share. bindings.cpp exposes these to Python (pybind11) and to torch's
// dispatcher; each family's .cpp defines its own. All take and return float32 CPU tensors
// unless said otherwise; shapes are documented at the definitions.

#pragma once

#include <torch/types.h>

#include <cstdint>

namespace strait {

// Output columns per weight panel of both linears (two 8-float AVX2 registers, one AVX-512
// register); libs/engine/quant/blocks.py lays the block-quantized weights out with the same.
inline constexpr int64_t kNR = 16;

// packed_linear.cpp: a linear over weights re-laid once into [ceil(N / 16), K, 16] panels.
torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias);

// block_linear.cpp: a linear over block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0, int4, int8).
torch::Tensor block_linear(const torch::Tensor& input, const torch::Tensor& qweight,
                           const torch::Tensor& scales, const torch::Tensor& mins, int64_t n,
                           int64_t bits, int64_t group, int64_t act_bits,
                           const c10::optional<torch::Tensor>& bias);

// paged_attention.cpp: one query row per token over its sequence's KV blocks.
torch::Tensor paged_row_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens, double scale);
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, torch::Tensor& kv, int64_t layer,
                              const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, double scale);

// sampler.cpp: the sampler's passes over rows of logits.
torch::Tensor argmax_rows(const torch::Tensor& logits);
void mask_rows(torch::Tensor logits, const torch::Tensor& rows, const torch::Tensor& bitmask);

}  // namespace strait
