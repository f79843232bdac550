// Private to the GPU MLA layer (mla_gpu.cpp forward, mla_gpu_backward.cpp backward): the call's
// dimensions, the forward's scratch views and the forward computation up to the attention output,
// so the backward recomputes exactly what the forward computes (same kernels, same roundings).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/cuda/gpu_run.h"

namespace dm::cuda::mla_detail {

constexpr size_t kArenaAlign = 256;  // DeviceArena view alignment

inline size_t aligned(size_t bytes) {
  return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
}
// Scratch a list of views takes when carved in order from an arena at any used() mark: the
// first view may start mid-block, and an empty view still rounds (generous, never short).
inline size_t arena_bytes(const std::vector<size_t>& views) {
  size_t bytes = kArenaAlign;
  for (size_t v : views) bytes += aligned(v > 0 ? v : 1);
  return bytes;
}

// Dimensions of one call (H heads, dq = nope + rope, dv = v_head, kvl = kv_lora, ql = q_lora).
struct MlaDims {
  int64_t B, N, T, d, H, nope, rope, dq, dv, kvl, ql;
  bool rope_on, gate;
  MlaDims(const ModelConfig& c, int64_t B, int64_t T);
  // Bytes of the forward's scratch views, in carve order (MlaForwardViews::carve).
  std::vector<size_t> forward_views() const;
};

// Throws when the GPU kernels cannot take the config (`who` names the caller).
void check_dims(const MlaDims& s, const char* who);

// The forward's activations (scratch views; nullptr where the config has no such tensor).
struct MlaForwardViews {
  float* q_a = nullptr;           // [N, ql] fp32, W_qa x before its norm
  uint16_t* q_a_normed = nullptr; // [N, ql] bf16, RMSNorm(q_a)
  uint16_t* q = nullptr;          // [N, H, dq] bf16, rotated when RoPE is on
  float* kv_a = nullptr;          // [N, kvl + rope] fp32, [c_raw ; kr] (kr NOT rotated here)
  uint16_t* c = nullptr;          // [N, kvl] bf16, RMSNorm(c_raw)
  uint16_t* kv = nullptr;         // [N, H, nope + dv] bf16, W_kvb c
  float* rope_cos = nullptr;      // [T, rope/2] (RoPE on only)
  float* rope_sin = nullptr;
  uint16_t* k = nullptr;          // [N, H, dq] bf16, [k_nope | R·kr]
  uint16_t* v = nullptr;          // [N, H, dv] bf16
  uint16_t* o = nullptr;          // [N, H, dv] bf16, attention output (ungated)
  uint16_t* gate = nullptr;       // [N, H·dv] bf16, W_gate x before the sigmoid (gate on only)

  static MlaForwardViews carve(DeviceArena& a, const MlaDims& s);
};

// Everything of the forward up to (not including) the output gate multiply and W_o: q, the
// latent path, RoPE, k/v, the attention output o (and lse [B, H, T] fp32 when non-null) and
// the gate pre-activation W_gate x. Stream-ordered on run.stream.
void mla_forward_core(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w, const MlaDims& s,
                      const MlaForwardViews& a, const uint16_t* xn, const int32_t* doc_start,
                      float* lse);

// The softmax scale both directions use (the CPU float engine's value, rounded to float).
double mla_gpu_softmax_scale(const ModelConfig& c);

}  // namespace dm::cuda::mla_detail
