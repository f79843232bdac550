// KDA token mixer on the GPU, forward (inference / prefill without a cache): the twin of
// model/kda.cpp kda_layer_forward with the chunked operator, no saved activations.
//
// Per token x (normed input [d], bf16), head h, the same op order as the CPU layer:
//   q, k, v = SiLU(ShortConv(W_{q,k,v} x))            (three GEMMs, each + one conv kernel)
//   g = gate(f_b f_a x; A_log, dt_bias)                (two GEMMs + the gate kernel)
//   β = sigmoid(b_proj x)                              (GEMM to fp32 + the sigmoid kernel)
//   o = KDA(q, k, v, g, β)                             (chunked operator, bf16 in/out, fp32 state)
//   y = o_proj · [RMSNorm(o_h)·o_norm ⊙ sigmoid(G x)_h] (G = g_b g_a or g_full)
// Activations between ops are bf16 (GEMM outputs rounded once); element-wise math is fp32.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_layer_ops.h"

namespace dm::cuda {
namespace {

struct KdaGpuDims {
  int64_t N, d, H, K, HK;
  int Kc;
};

KdaGpuDims kda_gpu_dims(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim;
  return {B * T, int64_t(c.hidden), H, K, H * K, c.kda.conv_kernel};
}

// Carves from the scratch arena, or (arena == nullptr) only counts: the bytes function runs the
// same sequence as the layer, so the two cannot disagree. Each view rounds up to the arena's
// 256-byte alignment; `bytes` starts with 256 of slack for an unaligned arena mark.
struct KdaScratchPlan {
  DeviceArena* arena = nullptr;
  size_t bytes = 256;
  void* take_bytes(size_t n) {
    bytes += (n + 255) / 256 * 256;
    return arena ? arena->alloc_bytes(n) : nullptr;
  }
  template <typename T>
  T* take(int64_t n) {
    return static_cast<T*>(take_bytes(size_t(n) * sizeof(T)));
  }
};

// The layer's temporaries. Buffers whose lives do not overlap share memory (one stream orders
// every use): `raw` holds W_q x, W_k x, W_v x (each dead once its conv ran), then f_b f_a x (dead
// after the gate kernel), then the output gate; `low` holds f_a x, then g_a x.
struct KdaGpuBuffers {
  uint16_t* raw = nullptr;                                        // [N, H·K]
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr;  // [N, H·K] operator inputs
  uint16_t* low = nullptr;                                        // [N, K]
  float* beta_logits = nullptr;                                   // [N, H] b_proj x
  uint16_t* beta = nullptr;                                       // [N, H]
  uint16_t* o = nullptr;            // [N, H·K] operator output, then (in place) the normed output
  void* operator_workspace = nullptr;  // kda_chunk_forward_workspace_bytes
};

KdaGpuBuffers kda_gpu_carve(KdaScratchPlan& plan, const KdaGpuDims& dims,
                            const KdaShape& shape) {
  const int64_t N = dims.N, HK = dims.HK;
  KdaGpuBuffers b;
  b.raw = plan.take<uint16_t>(N * HK);
  b.q = plan.take<uint16_t>(N * HK);
  b.k = plan.take<uint16_t>(N * HK);
  b.v = plan.take<uint16_t>(N * HK);
  b.g = plan.take<uint16_t>(N * HK);
  b.low = plan.take<uint16_t>(N * dims.K);
  b.beta_logits = plan.take<float>(N * dims.H);
  b.beta = plan.take<uint16_t>(N * dims.H);
  b.o = plan.take<uint16_t>(N * HK);
  b.operator_workspace = plan.take_bytes(kda_chunk_forward_workspace_bytes(shape));
  return b;
}

void kda_gpu_check(const ModelConfig& c, int64_t B, int64_t T) {
  DM_CHECK(B >= 0 && T >= 0, "kda_layer_forward_gpu: bad shape B=", B, " T=", T);
  DM_CHECK(c.kda.num_heads > 0 && c.kda.head_dim > 0 && c.kda.conv_kernel > 0,
           "kda_layer_forward_gpu: KDA config not set");
  DM_CHECK(c.kda.head_dim <= kKdaCudaMaxHeadDim, "kda_layer_forward_gpu: head_dim ",
           c.kda.head_dim, " > ", kKdaCudaMaxHeadDim, " (the chunked CUDA operator's limit)");
}

}  // namespace

size_t kda_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  kda_gpu_check(c, B, T);
  const KdaGpuDims dims = kda_gpu_dims(c, B, T);
  KdaScratchPlan counter;
  kda_gpu_carve(counter, dims, KdaShape{B, T, dims.H, dims.K, dims.K});
  return counter.bytes;
}

void kda_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const KdaWeights& w,
                           const uint16_t* xn, float* y, int64_t B, int64_t T,
                           const int32_t* doc_start, const KdaCarryOut* carry) {
  const ModelConfig& c = dw.config();
  kda_gpu_check(c, B, T);
  DM_CHECK(carry == nullptr || (B == 1 && doc_start == nullptr),
           "kda_layer_forward_gpu: the decode carry needs one unpacked sequence (B = 1)");
  const KdaGpuDims dims = kda_gpu_dims(c, B, T);
  const int64_t N = dims.N, d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  if (N == 0) return;
  const KdaShape shape{B, T, H, K, K};
  DeviceArenaScope scope(run.scratch);
  KdaScratchPlan plan{&run.scratch};
  const KdaGpuBuffers b = kda_gpu_carve(plan, dims, shape);
  CUstream_st* stream = run.stream;

  // q, k, v = SiLU(ShortConv(W x)): [B, T, H·K], the operator's [B, T, H, K] layout.
  struct Branch {
    const float* proj;
    const float* conv;
    uint16_t* out;
  };
  const Branch branches[3] = {Branch{w.q_proj, w.q_conv, b.q}, Branch{w.k_proj, w.k_conv, b.k},
                              Branch{w.v_proj, w.v_conv, b.v}};
  for (int i = 0; i < 3; ++i) {
    const Branch& br = branches[i];
    linear(run, xn, dw.bf16(br.proj), N, d, HK, b.raw, GemmOutType::Bf16);
    kda_short_conv_silu_forward(b.raw, dw.f32(br.conv), br.out, B, T, HK, dims.Kc, doc_start,
                                stream);
    if (carry && dims.Kc > 1) {  // conv tail: the last Kc−1 raw rows (zeros before position 0)
      const int64_t rows = dims.Kc - 1, kept = std::min<int64_t>(rows, T);
      const size_t row_bytes = size_t(HK) * sizeof(uint16_t);
      if (kept < rows) fill_zero(carry->tail[i], size_t(rows - kept) * row_bytes);
      copy_device_to_device(carry->tail[i] + (rows - kept) * HK, b.raw + (T - kept) * HK,
                            size_t(kept) * row_bytes);
    }
  }

  // Per-channel log decay g = gate(W_f↑ W_f↓ x) and per-head β = sigmoid(W_β x).
  linear(run, xn, dw.bf16(w.f_a), N, d, K, b.low, GemmOutType::Bf16);
  linear(run, b.low, dw.bf16(w.f_b), N, K, HK, b.raw, GemmOutType::Bf16);
  kda_gate_forward(b.raw, dw.f32(w.A_log), dw.f32(w.dt_bias), b.g, N, H, K,
                   c.kda.gate == KdaGateKind::Safe, c.kda.gate_lower_bound, stream);
  // β's logits stay fp32 (N·H values) so the sigmoid rounds once, into the bf16 operator input.
  linear(run, xn, dw.bf16(w.b_proj), N, d, H, b.beta_logits, GemmOutType::F32);
  kda_beta_sigmoid_forward(b.beta_logits, b.beta, N * H, stream);

  const float scale = 1.0f / std::sqrt(float(K));
  kda_chunk_forward(b.q, b.k, b.v, b.g, b.beta, /*s0=*/nullptr, b.o,
                    /*sT=*/carry ? carry->state : nullptr, shape, scale, b.operator_workspace,
                    doc_start, stream);

  // Output gate (full-rank or low-rank) into `raw`, per-head RMSNorm ⊙ sigmoid(gate) in place in
  // o (rows = N·H heads of K), then W_o into the fp32 output.
  uint16_t* out_gate = b.raw;
  if (c.kda.full_rank_output_gate) {
    linear(run, xn, dw.bf16(w.g_full), N, d, HK, out_gate, GemmOutType::Bf16);
  } else {
    linear(run, xn, dw.bf16(w.g_a), N, d, K, b.low, GemmOutType::Bf16);
    linear(run, b.low, dw.bf16(w.g_b), N, K, HK, out_gate, GemmOutType::Bf16);
  }
  kda_rmsnorm_gated_forward(b.o, dw.f32(w.o_norm), out_gate, b.o, N * H, K, c.rms_eps, stream);
  linear(run, b.o, dw.bf16(w.o_proj), N, HK, d, y, GemmOutType::F32);
}

}  // namespace dm::cuda
