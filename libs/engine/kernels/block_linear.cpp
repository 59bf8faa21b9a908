// Strait's linear over block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0, Strait's int4 / int8),
// read in place: the format is in block_layout.h, the per-ISA tiles in block_tiles_avx512.h and
// block_tiles_avx2.h, and here the walk over a thread's panels (QLinear) and the entry point.
//
// Called through bindings.cpp by libs/engine/quant (BlockLinear modules of a quantized model on
// the CPU) and, as torch.ops.strait.block_linear, from compiled graphs. Needs AVX2; the Python
// side serves these formats through torch's ops elsewhere.

#include "block_layout.h"
#include "block_tiles_avx2.h"
#include "block_tiles_avx512.h"
#include "cpu_isa.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace strait {

namespace block {
namespace {

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

}  // namespace
}  // namespace block

// x [M, K] float32 . block-quantized weight (+ bias [N]) -> [M, N] float32. `bits` 4 or 8;
// `act_bits` 32 (exact) or 8 (int8 activations, see block_layout.h). Needs AVX2 (8: AVX2's or
// VNNI's integer dot, STRAIT_QDOT).
torch::Tensor block_linear(const torch::Tensor& input, const torch::Tensor& qweight,
                           const torch::Tensor& scales, const torch::Tensor& mins, int64_t n,
                           int64_t bits, int64_t group, int64_t act_bits,
                           const c10::optional<torch::Tensor>& bias) {
  using namespace block;
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

}  // namespace strait
