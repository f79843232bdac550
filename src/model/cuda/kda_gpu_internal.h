// What the GPU KDA layer's forward (kda_gpu.cpp) and backward (kda_gpu_backward.cpp) share: the
// dimensions, the scratch plan that both carves and counts, and the forward's steps up to the
// gated norm (the backward recomputes them with every intermediate kept).
#pragma once
#include <cstdint>

#include "model/cuda/layers.h"
#include "ops/cpu/kda.h"  // KdaShape

namespace dm::cuda::kda_gpu {

struct Dims {
  int64_t N, d, H, K, HK;
  int Kc;
};

inline Dims dims_of(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim;
  return {B * T, int64_t(c.hidden), H, K, H * K, c.kda.conv_kernel};
}

// Shape and config checks shared by forward and backward (`what` names the caller).
void check(const ModelConfig& c, int64_t B, int64_t T, const char* what);

// Carves from the scratch arena, or (arena == nullptr) only counts: the bytes functions run the
// same sequence as the layer, so the two cannot disagree. Each view rounds up to the arena's
// 256-byte alignment; `bytes` starts with 256 of slack for an unaligned arena mark.
// With `base` instead (256-byte aligned memory of at least the counted bytes), views are carved
// from it at the same offsets every time (the kept forward internals of training).
struct ScratchPlan {
  DeviceArena* arena = nullptr;
  size_t bytes = 256;
  char* base = nullptr;
  void* take_bytes(size_t n) {
    const size_t at = bytes - 256;
    bytes += (n + 255) / 256 * 256;
    if (arena) return arena->alloc_bytes(n);
    return base ? base + at : nullptr;
  }
  template <typename T>
  T* take(int64_t n) {
    return static_cast<T*>(take_bytes(size_t(n) * sizeof(T)));
  }
};

// Where the forward steps leave their results, in the activation type A (bf16 bit patterns, or
// fp32 in the fp32 GPU mode) unless noted. The inference forward lets buffers whose lives do not
// overlap share memory (q_raw = k_raw = v_raw = gate_raw = out_gate, gate_low = out_gate_low,
// normed = o); the backward (bf16 only) gives each its own.
template <typename A>
struct ForwardViewsT {
  A *q_raw, *k_raw, *v_raw;  // [N, H·K] W_{q,k,v} x before the short conv
  A *q, *k, *v;              // [N, H·K] SiLU(conv(·)): operator inputs
  A* gate_low;               // [N, K]   f_a x
  A* gate_raw;               // [N, H·K] f_b f_a x, before the gate nonlinearity
  A* g;                      // [N, H·K] log decay
  float* beta_logits;        // [N, H]   b_proj x (fp32)
  A* beta;                   // [N, H]   σ(logits)
  A* o;                      // [N, H·K] operator output
  A* out_gate_low;           // [N, K]   g_a x (low-rank output gate only)
  A* out_gate;               // [N, H·K] output gate before the sigmoid
  A* normed;                 // [N, H·K] RMSNorm(o_h)·o_norm ⊙ σ(out_gate): o_proj's input
  void* operator_workspace;  // ≥ kda_chunk_forward_workspace_bytes
  // Rows of room before q_raw, k_raw, v_raw and before q, k, v (the same count for both): a
  // continuing carry (KdaCarry::continues) puts the conv tail there, and the conv's output for
  // those rows, discarded, lands in front of q, k, v. Needs ≥ Kc − 1; 0 where not carved.
  int64_t context_rows = 0;
};
using ForwardViews = ForwardViewsT<uint16_t>;

// The forward's views with every intermediate in its own buffer and an operator workspace big
// enough for the operator's backward too: what the backward recomputes into, or what training
// without the mixer recompute keeps from the forward (kda_layer_kept_gpu_bytes).
ForwardViews keep_carve(ScratchPlan& plan, const ModelConfig& c, const Dims& dims,
                        const KdaShape& shape);

// Every step of the layer forward before o_proj, in the order of model/kda.cpp, into `v`
// (carry: the decode carry of kda_layer_forward_gpu, nullable; bf16 only). N = B·T > 0.
// A = uint16_t (bf16) or float (the fp32 mode).
template <typename A>
void forward_steps(GpuRun& run, const DeviceWeights& dw, const KdaWeights& w, const A* xn,
                   int64_t B, int64_t T, const int32_t* doc_start, const KdaCarry* carry,
                   const ForwardViewsT<A>& v);

}  // namespace dm::cuda::kda_gpu
