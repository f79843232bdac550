// Dense FFN on the GPU, forward: the twin of model/moe.cpp dense_ffn_forward (ops/cpu/ffn.cpp
// ffn_forward without saved pre-activations):
//   g = x·W_gateᵀ, u = x·W_upᵀ  [N, F] bf16 (one [N, 2F] GEMM when W_gate and W_up are adjacent,
//   as weights.cpp lays them out);  h = act(g, u) (SwiGLU or SiTU per glu_activation(cfg));
//   y = h·W_downᵀ  [N, d] fp32.
// Backward (dense_ffn_backward): recompute g, u from xn (or read them where the forward kept
// them) and run the gated FFN backward of
// ops/cuda/moe_backward.h on bf16(dy) (rounded once): dW_down += dyᵀ·h, dh = dy·W_down, GLU
// backward, dW_gate += dgᵀ·x, dW_up += duᵀ·x, dxn = dg·W_gate + du·W_up (written).
#include <type_traits>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/moe.h"  // glu_activation
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe_backward.h"
#include "ops/cuda/moe_layer_ops.h"  // convert_f32_to_bf16

namespace dm::cuda {
namespace {

// One [N, F] view of elem_bytes elements, rounded up to the scratch arena's 256-byte alignment.
size_t ffn_gpu_view_bytes(int64_t N, int64_t F, size_t elem_bytes = sizeof(uint16_t)) {
  return (size_t(N) * size_t(F) * elem_bytes + 255) / 256 * 256;
}

}  // namespace

size_t dense_ffn_forward_gpu_bytes(const ModelConfig& c, int64_t N, WeightPrecision precision) {
  DM_CHECK(N >= 0 && c.dense_ffn > 0, "dense_ffn_forward_gpu: bad shape N=", N, " F=",
           c.dense_ffn);
  // gate (→ h) and up, or g | u [N, 2F] and h (bf16, adjacent weights), plus slack for an
  // unaligned arena mark.
  const size_t elem = precision == WeightPrecision::F32 ? sizeof(float) : sizeof(uint16_t);
  return 3 * ffn_gpu_view_bytes(N, c.dense_ffn, elem) + 256;
}

size_t dense_ffn_kept_gpu_bytes(const ModelConfig& c, int64_t N) {
  DM_CHECK(N >= 0 && c.dense_ffn > 0, "dense_ffn_kept_gpu_bytes: bad shape N=", N,
           " F=", c.dense_ffn);
  return 2 * ffn_gpu_view_bytes(N, c.dense_ffn);
}

template <typename A>
void dense_ffn_forward_gpu(GpuRun& run, const DeviceWeights& dw, const FfnWeights& w, const A* xn,
                           float* y, int64_t N, const float* residual, uint16_t* kept_gate_up) {
  const ModelConfig& c = dw.config();
  const int64_t d = c.hidden, F = c.dense_ffn;
  DM_CHECK(N >= 0 && d > 0 && F > 0, "dense_ffn_forward_gpu: bad shape N=", N, " d=", d,
           " F=", F);
  if (N == 0) return;
  DeviceArenaScope scope(run.scratch);
  if constexpr (std::is_same_v<A, uint16_t>) {
    if (glu_gate_up_adjacent(dw.bf16(w.gate), dw.bf16(w.up), F, d)) {
      // One GEMM for g | u ([N, 2F] rows: in the kept memory for the backward, else scratch).
      uint16_t* gu = kept_gate_up ? kept_gate_up : run.scratch.alloc<uint16_t>(size_t(2 * N * F));
      uint16_t* h = run.scratch.alloc<uint16_t>(size_t(N * F));
      linear(run, xn, dw.bf16(w.gate), N, d, 2 * F, gu, GemmOutType::Bf16);
      glu_forward(gu, gu + F, h, N * F, glu_activation(c), run.stream, GluRows{F, 2 * F});
      linear_plus(run, h, dw.bf16(w.down), N, F, d, y, residual);
      return;
    }
  }
  // Separate products (fp32 mode; weights not adjacent): nothing kept, the backward recomputes.
  A* gate = run.scratch.alloc<A>(size_t(N) * size_t(F));  // [N, F]; h after the GLU
  A* up = run.scratch.alloc<A>(size_t(N) * size_t(F));    // [N, F]
  linear(run, xn, dw.operand<A>(w.gate), N, d, F, gate, activation_out<A>());
  linear(run, xn, dw.operand<A>(w.up), N, d, F, up, activation_out<A>());
  glu_forward(gate, up, gate, N * F, glu_activation(c), run.stream);
  linear_plus(run, gate, dw.operand<A>(w.down), N, F, d, y, residual);
}

template void dense_ffn_forward_gpu<uint16_t>(GpuRun&, const DeviceWeights&, const FfnWeights&,
                                              const uint16_t*, float*, int64_t, const float*,
                                              uint16_t*);
template void dense_ffn_forward_gpu<float>(GpuRun&, const DeviceWeights&, const FfnWeights&,
                                           const float*, float*, int64_t, const float*, uint16_t*);

size_t dense_ffn_backward_gpu_bytes(const ModelConfig& c, int64_t N) {
  DM_CHECK(N >= 0 && c.dense_ffn > 0, "dense_ffn_backward_gpu: bad shape N=", N, " F=",
           c.dense_ffn);
  // dy bf16 [N, d] + the gated FFN workspace (g, u, h [N, F] bf16), plus slack for an unaligned
  // arena mark.
  const size_t dy_bytes = (size_t(N) * size_t(c.hidden) * sizeof(uint16_t) + 255) / 256 * 256;
  const size_t ffn_bytes = (glu_ffn_backward_workspace_bytes(N, c.dense_ffn) + 255) / 256 * 256;
  return dy_bytes + ffn_bytes + 256;
}

void dense_ffn_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const FfnWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t N, const uint16_t* kept_gate_up) {
  const ModelConfig& c = dw.config();
  const int64_t d = c.hidden, F = c.dense_ffn;
  DM_CHECK(N >= 0 && d > 0 && F > 0, "dense_ffn_backward_gpu: bad shape N=", N, " d=", d,
           " F=", F);
  DM_CHECK(w.gate && w.up && w.down, "dense_ffn_backward_gpu: FFN weights missing");
  if (N == 0) return;
  DM_CHECK(xn && dy && dxn, "dense_ffn_backward_gpu: null argument");
  DeviceArenaScope scope(run.scratch);
  uint16_t* dy_b = run.scratch.alloc<uint16_t>(size_t(N) * size_t(d));  // [N, d]
  convert_f32_to_bf16(dy, dy_b, N * d, run.stream);
  void* workspace = run.scratch.alloc_bytes(glu_ffn_backward_workspace_bytes(N, F));
  // dx_beta = 0: the first input-gradient GEMM writes dxn.
  glu_ffn_backward(run.gemm, xn, dw.bf16(w.gate), dw.bf16(w.up), dw.bf16(w.down), dy_b, dxn, 0.0f,
                   grads.at(w.gate), grads.at(w.up), grads.at(w.down), N, d, F, glu_activation(c),
                   workspace, run.stream, kept_gate_up);
}

}  // namespace dm::cuda
