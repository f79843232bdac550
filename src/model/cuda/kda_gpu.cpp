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
// The steps before o_proj (kda_gpu::forward_steps) are shared with the backward's recompute
// (kda_gpu_backward.cpp), which keeps every intermediate instead of sharing buffers.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "model/cuda/kda_gpu_internal.h"
#include "model/cuda/layers.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_layer_ops.h"

namespace dm::cuda {
namespace kda_gpu {

void check(const ModelConfig& c, int64_t B, int64_t T, const char* what) {
  DM_CHECK(B >= 0 && T >= 0, what, ": bad shape B=", B, " T=", T);
  DM_CHECK(c.kda.num_heads > 0 && c.kda.head_dim > 0 && c.kda.conv_kernel > 0, what,
           ": KDA config not set");
  DM_CHECK(c.kda.head_dim <= kKdaCudaMaxHeadDim, what, ": head_dim ", c.kda.head_dim, " > ",
           kKdaCudaMaxHeadDim, " (the chunked CUDA operator's limit)");
}

namespace {

// A checkpoint's conv tail after p tokens of a fresh pass: raw rows [p − ctx, p) of `raw`
// [T, HK] → dst [ctx, HK] (host or device). p ≥ 64 > ctx (Kc ≤ 8), so no row precedes position 0.
void copy_checkpoint_tail(const uint16_t* raw, int64_t p, int64_t ctx, int64_t HK, uint16_t* dst,
                          CUstream_st* stream) {
  copy_async(dst, raw + (p - ctx) * HK, size_t(ctx * HK) * sizeof(uint16_t), stream);
}

// Checkpoint positions: strictly increasing chunk multiples inside the call (KdaCarry).
void check_checkpoints(const KdaCarry& carry, int64_t T) {
  int64_t last = 0;
  for (int c = 0; c < carry.checkpoint_count; ++c) {
    const int64_t p = carry.checkpoint_tokens[c];
    DM_CHECK(p > last && p <= T && p % kKdaCudaChunk == 0, "kda_layer_forward_gpu: checkpoint ", c,
             " after ", p, " tokens is not a multiple of ", kKdaCudaChunk, " in (", last, ", ", T,
             "]");
    last = p;
  }
}

}  // namespace

template <typename A>
void forward_steps(GpuRun& run, const DeviceWeights& dw, const KdaWeights& w, const A* xn,
                   int64_t B, int64_t T, const int32_t* doc_start, const KdaCarry* carry,
                   const ForwardViewsT<A>& v) {
  constexpr bool kBf16 = std::is_same_v<A, uint16_t>;
  constexpr GemmOutType kOut = activation_out<A>();
  DM_CHECK(kBf16 || carry == nullptr, "kda_layer_forward_gpu: the fp32 mode keeps no decode carry");
  if (carry) check_checkpoints(*carry, T);
  const ModelConfig& c = dw.config();
  const Dims dims = dims_of(c, B, T);
  const int64_t N = dims.N, d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  CUstream_st* stream = run.stream;

  // q, k, v = SiLU(ShortConv(W x)): [B, T, H·K], the operator's [B, T, H, K] layout. Each raw
  // projection is consumed (conv, decode tail) before the next is written: they may share memory.
  struct Branch {
    const float* proj;
    const float* conv;
    A* raw;
    A* out;
  };
  const Branch branches[3] = {Branch{w.q_proj, w.q_conv, v.q_raw, v.q},
                              Branch{w.k_proj, w.k_conv, v.k_raw, v.k},
                              Branch{w.v_proj, w.v_conv, v.v_raw, v.v}};
  const int64_t ctx = dims.Kc - 1;  // the conv's left context, in rows
  const bool continues = carry && carry->continues && ctx > 0;
  DM_CHECK(!continues || v.context_rows >= ctx,
           "kda_layer_forward_gpu: no room for the carried conv tail");
  const size_t row_bytes = size_t(HK) * sizeof(uint16_t);
  for (int i = 0; i < 3; ++i) {
    const Branch& br = branches[i];
    linear(run, xn, dw.operand<A>(br.proj), N, d, HK, br.raw, kOut);
    if constexpr (kBf16) {
      if (continues) {
        // [tail ; raw] (ctx + T rows) through the conv; its first ctx output rows are discarded.
        uint16_t* joined = br.raw - ctx * HK;
        copy_device_to_device(joined, carry->tail[i], size_t(ctx) * row_bytes);
        kda_short_conv_silu_forward(joined, dw.f32(br.conv), br.out - ctx * HK, 1, T + ctx, HK,
                                    dims.Kc, nullptr, stream);
        // A checkpoint's tail after p tokens: rows [p, p + ctx) of [tail ; raw]. The new tail:
        // the last ctx rows (some of the old tail when T < ctx).
        for (int c = 0; c < carry->checkpoint_count; ++c)
          copy_async(carry->checkpoint_tails[3 * c + i], joined + carry->checkpoint_tokens[c] * HK,
                     size_t(ctx) * row_bytes, stream);
        copy_device_to_device(carry->tail[i], joined + T * HK, size_t(ctx) * row_bytes);
        continue;
      }
    }
    kda_short_conv_silu_forward(br.raw, dw.f32(br.conv), br.out, B, T, HK, dims.Kc, doc_start,
                                stream);
    if constexpr (kBf16) {
      if (carry && ctx > 0) {  // conv tail: the last Kc−1 raw rows (zeros before position 0)
        for (int c = 0; c < carry->checkpoint_count; ++c)
          copy_checkpoint_tail(br.raw, carry->checkpoint_tokens[c], ctx, HK,
                               carry->checkpoint_tails[3 * c + i], stream);
        const int64_t kept = std::min<int64_t>(ctx, T);
        if (kept < ctx) fill_zero(carry->tail[i], size_t(ctx - kept) * row_bytes);
        copy_device_to_device(carry->tail[i] + (ctx - kept) * HK, br.raw + (T - kept) * HK,
                              size_t(kept) * row_bytes);
      }
    }
  }

  // Per-channel log decay g = gate(W_f↑ W_f↓ x) and per-head β = sigmoid(W_β x).
  linear(run, xn, dw.operand<A>(w.f_a), N, d, K, v.gate_low, kOut);
  linear(run, v.gate_low, dw.operand<A>(w.f_b), N, K, HK, v.gate_raw, kOut);
  kda_gate_forward(v.gate_raw, dw.f32(w.A_log), dw.f32(w.dt_bias), v.g, N, H, K,
                   c.kda.gate == KdaGateKind::Safe, c.kda.gate_lower_bound, stream);
  // β's logits stay fp32 (N·H values) so the sigmoid rounds once, into the bf16 operator input.
  linear(run, xn, dw.operand<A>(w.b_proj), N, d, H, v.beta_logits, GemmOutType::F32);
  kda_beta_sigmoid_forward(v.beta_logits, v.beta, N * H, stream);

  const KdaShape shape{B, T, H, K, K};
  const float scale = 1.0f / std::sqrt(float(K));
  // A continuing carry's state is the initial state, overwritten in place with the final one.
  kda_chunk_forward(v.q, v.k, v.v, v.g, v.beta,
                    /*s0=*/carry && carry->continues ? carry->state : nullptr, v.o,
                    /*sT=*/carry ? carry->state : nullptr, shape, scale, v.operator_workspace,
                    doc_start, stream);
  // Checkpoint states: a chunk start from the operator's workspace, or the final state.
  for (int c = 0; carry && c < carry->checkpoint_count; ++c) {
    const int64_t p = carry->checkpoint_tokens[c];
    if (p == T)
      copy_async(carry->checkpoint_state[c], carry->state, size_t(HK * K) * sizeof(float), stream);
    else
      kda_chunk_forward_state_at(v.operator_workspace, shape, 0, p / kKdaCudaChunk,
                                 carry->checkpoint_state[c], stream);
  }

  // Output gate (full-rank or low-rank), then per-head RMSNorm ⊙ sigmoid(gate) (rows = N·H
  // heads of K; normed may be o itself).
  if (c.kda.full_rank_output_gate) {
    linear(run, xn, dw.operand<A>(w.g_full), N, d, HK, v.out_gate, kOut);
  } else {
    linear(run, xn, dw.operand<A>(w.g_a), N, d, K, v.out_gate_low, kOut);
    linear(run, v.out_gate_low, dw.operand<A>(w.g_b), N, K, HK, v.out_gate, kOut);
  }
  kda_rmsnorm_gated_forward(v.o, dw.f32(w.o_norm), v.out_gate, v.normed, N * H, K, c.rms_eps,
                            stream);
}

template void forward_steps<uint16_t>(GpuRun&, const DeviceWeights&, const KdaWeights&,
                                      const uint16_t*, int64_t, int64_t, const int32_t*,
                                      const KdaCarry*, const ForwardViews&);
template void forward_steps<float>(GpuRun&, const DeviceWeights&, const KdaWeights&, const float*,
                                   int64_t, int64_t, const int32_t*, const KdaCarry*,
                                   const ForwardViewsT<float>&);

}  // namespace kda_gpu

namespace {

// The inference forward's temporaries, sharing memory where lives do not overlap (one stream
// orders every use): `raw` [N, H·K] holds W_q x, W_k x, W_v x (each dead once its conv ran), then
// f_b f_a x (dead after the gate kernel), then the output gate; `low` [N, K] holds f_a x, then
// g_a x; the norm runs in place in o.
// with_room (a continuing carry, KdaCarry::continues): raw, q, k and v get Kc − 1 rows of room in
// front for the carried conv tail, rounded up to 256 bytes so the views keep the arena's
// alignment. Without it the views are laid out as they always were.
// A: the activation type (uint16_t bf16, or float in the fp32 mode; no carry there).
template <typename A>
kda_gpu::ForwardViewsT<A> forward_carve(kda_gpu::ScratchPlan& plan, const kda_gpu::Dims& dims,
                                        const KdaShape& shape, bool with_room) {
  const int64_t N = dims.N, HK = dims.HK, ctx = std::max<int64_t>(dims.Kc - 1, 0);
  const int64_t room = with_room ? (ctx * HK * 2 + 255) / 256 * 256 / 2 : 0;  // elements
  kda_gpu::ForwardViewsT<A> v{};
  v.context_rows = with_room ? ctx : 0;
  auto with_context = [&]() -> A* {
    A* p = plan.take<A>(N * HK + room);
    return p ? p + room : nullptr;  // null while `plan` only counts
  };
  A* raw = with_context();
  v.q_raw = v.k_raw = v.v_raw = v.gate_raw = v.out_gate = raw;
  v.q = with_context();
  v.k = with_context();
  v.v = with_context();
  v.g = plan.take<A>(N * HK);
  v.gate_low = v.out_gate_low = plan.take<A>(N * dims.K);
  v.beta_logits = plan.take<float>(N * dims.H);
  v.beta = plan.take<A>(N * dims.H);
  v.o = v.normed = plan.take<A>(N * HK);
  v.operator_workspace = plan.take_bytes(kda_chunk_forward_workspace_bytes(shape));
  return v;
}

}  // namespace

size_t kda_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T,
                                   WeightPrecision precision) {
  kda_gpu::check(c, B, T, "kda_layer_forward_gpu");
  const kda_gpu::Dims dims = kda_gpu::dims_of(c, B, T);
  kda_gpu::ScratchPlan counter;
  const KdaShape shape{B, T, dims.H, dims.K, dims.K};
  if (precision == WeightPrecision::F32) {
    forward_carve<float>(counter, dims, shape, /*with_room=*/false);
    return counter.bytes;
  }
  // The larger layout: with room for a continuing carry.
  forward_carve<uint16_t>(counter, dims, shape, /*with_room=*/true);
  return counter.bytes;
}

template <typename A>
void kda_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const KdaWeights& w, const A* xn,
                           float* y, int64_t B, int64_t T, const int32_t* doc_start,
                           const KdaCarry* carry, void* kept, const float* residual) {
  const ModelConfig& c = dw.config();
  kda_gpu::check(c, B, T, "kda_layer_forward_gpu");
  DM_CHECK(carry == nullptr || (B == 1 && doc_start == nullptr),
           "kda_layer_forward_gpu: the decode carry needs one unpacked sequence (B = 1)");
  DM_CHECK(carry == nullptr || !carry->continues || kept == nullptr,
           "kda_layer_forward_gpu: a continuing carry is for inference (no kept intermediates)");
  DM_CHECK((std::is_same_v<A, uint16_t>) || kept == nullptr,
           "kda_layer_forward_gpu: the fp32 mode is inference only (nothing kept)");
  const kda_gpu::Dims dims = kda_gpu::dims_of(c, B, T);
  if (dims.N == 0) return;
  DeviceArenaScope scope(run.scratch);
  kda_gpu::ScratchPlan plan{&run.scratch};
  const KdaShape shape{B, T, dims.H, dims.K, dims.K};
  kda_gpu::ForwardViewsT<A> v;
  if constexpr (std::is_same_v<A, uint16_t>) {
    // Kept for the backward: every intermediate in its own buffer (as the backward recomputes
    // them).
    kda_gpu::ScratchPlan kept_plan;
    kept_plan.base = static_cast<char*>(kept);
    v = kept ? kda_gpu::keep_carve(kept_plan, c, dims, shape)
             : forward_carve<A>(plan, dims, shape, carry != nullptr && carry->continues);
  } else {
    v = forward_carve<A>(plan, dims, shape, /*with_room=*/false);
  }
  kda_gpu::forward_steps<A>(run, dw, w, xn, B, T, doc_start, carry, v);
  linear_plus(run, v.normed, dw.operand<A>(w.o_proj), dims.N, dims.HK, dims.d, y, residual);
}

template void kda_layer_forward_gpu<uint16_t>(GpuRun&, const DeviceWeights&, const KdaWeights&,
                                              const uint16_t*, float*, int64_t, int64_t,
                                              const int32_t*, const KdaCarry*, void*, const float*);
template void kda_layer_forward_gpu<float>(GpuRun&, const DeviceWeights&, const KdaWeights&,
                                           const float*, float*, int64_t, int64_t, const int32_t*,
                                           const KdaCarry*, void*, const float*);

}  // namespace dm::cuda
