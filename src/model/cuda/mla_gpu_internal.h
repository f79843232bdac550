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
  // Bytes of the forward's scratch views, in carve order (MlaForwardViewsT::carve), for
  // activations of act_bytes each (2: bf16; 4: the fp32 mode).
  std::vector<size_t> forward_views(size_t act_bytes = 2) const;
};

// Throws when the GPU kernels cannot take the config (`who` names the caller).
void check_dims(const MlaDims& s, const char* who);

// The forward's activations (scratch views; nullptr where the config has no such tensor), of
// the activation type A (bf16 bit patterns, or float in the fp32 mode) unless noted.
template <typename A>
struct MlaForwardViewsT {
  float* q_a = nullptr;       // [N, ql] fp32, W_qa x before its norm
  A* q_a_normed = nullptr;    // [N, ql] RMSNorm(q_a)
  A* q = nullptr;             // [N, H, dq] rotated when RoPE is on
  float* kv_a = nullptr;      // [N, kvl + rope] fp32, [c_raw ; kr] (kr NOT rotated here)
  A* c = nullptr;             // [N, kvl] RMSNorm(c_raw)
  A* kv = nullptr;            // [N, H, nope + dv] W_kvb c
  float* rope_cos = nullptr;  // [T, rope/2] (RoPE on only)
  float* rope_sin = nullptr;
  A* k = nullptr;     // [N, H, dq] [k_nope | R·kr]
  A* v = nullptr;     // [N, H, dv]
  A* o = nullptr;     // [N, H, dv] attention output (ungated)
  A* gate = nullptr;  // [N, H·dv] W_gate x before the sigmoid (gate on only)

  static MlaForwardViewsT carve(DeviceArena& a, const MlaDims& s);
};
using MlaForwardViews = MlaForwardViewsT<uint16_t>;

// Everything of the forward up to (not including) the output gate multiply and W_o: q, the
// latent path, RoPE, k/v, the attention output o (and lse [B, H, T] fp32 when non-null) and
// the gate pre-activation W_gate x. Stream-ordered on run.stream. A = uint16_t or float.
template <typename A>
void mla_forward_core(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w, const MlaDims& s,
                      const MlaForwardViewsT<A>& a, const A* xn, const int32_t* doc_start,
                      float* lse);

// What a training forward keeps for its backward (layers.h mla_layer_kept_gpu_bytes): the
// forward's views and the attention's lse [B, H, T] fp32, carved in this order from the kept
// memory by both directions.
struct MlaKeptViews {
  MlaForwardViews f;
  float* lse = nullptr;
  static size_t bytes(const MlaDims& s);
  static MlaKeptViews carve(void* kept, const MlaDims& s);
};

// The softmax scale both directions use (the CPU float engine's value, rounded to float).
double mla_gpu_softmax_scale(const ModelConfig& c);

}  // namespace dm::cuda::mla_detail
