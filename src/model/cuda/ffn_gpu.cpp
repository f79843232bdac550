// Dense FFN on the GPU, forward: the twin of model/moe.cpp dense_ffn_forward (ops/cpu/ffn.cpp
// ffn_forward without saved pre-activations):
//   g = x·W_gateᵀ, u = x·W_upᵀ  [N, F] bf16;  h = act(g, u) in place in g (SwiGLU or SiTU per
//   glu_activation(cfg));  y = h·W_downᵀ  [N, d] fp32.
#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/moe.h"  // glu_activation
#include "ops/cuda/elementwise.h"

namespace dm::cuda {
namespace {

// One [N, F] bf16 view, rounded up to the scratch arena's 256-byte alignment.
size_t ffn_gpu_view_bytes(int64_t N, int64_t F) {
  return (size_t(N) * size_t(F) * sizeof(uint16_t) + 255) / 256 * 256;
}

}  // namespace

size_t dense_ffn_forward_gpu_bytes(const ModelConfig& c, int64_t N) {
  DM_CHECK(N >= 0 && c.dense_ffn > 0, "dense_ffn_forward_gpu: bad shape N=", N, " F=",
           c.dense_ffn);
  // gate (→ h) and up, plus slack for an unaligned arena mark.
  return 2 * ffn_gpu_view_bytes(N, c.dense_ffn) + 256;
}

void dense_ffn_forward_gpu(GpuRun& run, const DeviceWeights& dw, const FfnWeights& w,
                           const uint16_t* xn, float* y, int64_t N) {
  const ModelConfig& c = dw.config();
  const int64_t d = c.hidden, F = c.dense_ffn;
  DM_CHECK(N >= 0 && d > 0 && F > 0, "dense_ffn_forward_gpu: bad shape N=", N, " d=", d,
           " F=", F);
  if (N == 0) return;
  DeviceArenaScope scope(run.scratch);
  uint16_t* gate = run.scratch.alloc<uint16_t>(size_t(N) * size_t(F));  // [N, F]; h after the GLU
  uint16_t* up = run.scratch.alloc<uint16_t>(size_t(N) * size_t(F));    // [N, F]
  linear(run, xn, dw.bf16(w.gate), N, d, F, gate, GemmOutType::Bf16);
  linear(run, xn, dw.bf16(w.up), N, d, F, up, GemmOutType::Bf16);
  glu_forward(gate, up, gate, N * F, glu_activation(c), run.stream);
  linear(run, gate, dw.bf16(w.down), N, F, d, y, GemmOutType::F32);
}

}  // namespace dm::cuda
