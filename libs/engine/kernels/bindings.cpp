// The Python module torch's extension loader builds from Strait's CPU kernels
// (libs/engine/kernels/__init__.py lists this file's sources: one .cpp per kernel family,
// declared in kernels.h), and the dispatcher ops compiled graphs call.

#include "cpu_isa.h"
#include "kernels.h"

#include <torch/extension.h>

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
  m.impl("packed_linear", &strait::packed_linear);
  m.impl("block_linear", &strait::block_linear);
  m.impl("paged_attention", &strait::paged_attention);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &strait::pack_weight, "w [N, K] -> packed [ceil(N/16), K, 16]");
  m.def("packed_linear", &strait::packed_linear, "x [M, K] . packed weight (+ bias) -> [M, N]");
  m.def("block_linear", &strait::block_linear,
        "x [M, K] . block-quantized weight (4 or 8 bits, fp16 scales) (+ bias) -> [M, N]");
  m.def("paged_row_attention", &strait::paged_row_attention,
        "one query row per token over its sequence's KV blocks");
  m.def("paged_attention", &strait::paged_attention,
        "write every token's K/V, then attend (one query row per token)");
  m.def("argmax_rows", &strait::argmax_rows, "logits [S, V] -> [S] int64, as torch.argmax(-1)");
  m.def("mask_rows", &strait::mask_rows,
        "logits [S, V] (in place): -inf where rows' bitmask [R, W] int32 bits are clear");
  m.attr("avx2") = static_cast<bool>(STRAIT_AVX2);
  m.attr("avx512") = static_cast<bool>(STRAIT_AVX512);
  m.attr("vnni") = static_cast<bool>(STRAIT_VNNI);
  m.attr("int8_dot") = static_cast<bool>(STRAIT_QDOT);  // block_linear's int8 activations
}
