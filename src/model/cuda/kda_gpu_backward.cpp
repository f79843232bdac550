// KDA token mixer on the GPU, backward (training): the twin of model/kda.cpp kda_layer_backward
// with the chunked operator. The forward is recomputed from xn (kda_gpu::forward_steps, every
// intermediate kept), or taken from what the training forward kept (`kept`), then each step is back-propagated in the reverse order of the forward:
//   y = o_proj·normed                 → d normed [N, H·K] fp32, d o_proj
//   normed = RMSNorm(o)·o_norm ⊙ σ(G)  → d o (bf16: the operator takes it in its input type),
//                                        d out_gate (bf16, a GEMM operand), d o_norm
//   G = g_full x | g_b g_a x           → dxn (WRITTEN here), d g_full | d g_b, d g_a
//   o = KDA(q, k, v, g, β)             → dq, dk, dv, dg [N, H·K], dβ [N, H] fp32
//   β = σ(b_proj x)                    → dxn +=, d b_proj
//   g = gate(f_b f_a x)                → dxn +=, d f_b, d f_a, d A_log, d dt_bias
//   q, k, v = SiLU(conv(W x))          → dxn +=, d W_{q,k,v}, d conv weights
// GEMM operands are bf16 (dy rounded once); gradients feeding element-wise math stay fp32.
#include <algorithm>
#include <cmath>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/kda_gpu_internal.h"
#include "model/cuda/layers.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/moe_layer_ops.h"  // convert_f32_to_bf16

namespace dm::cuda {
namespace {

// The backward's temporaries beyond the recomputed forward. Buffers share memory where one
// stream orders a dead use before the next write:
//   d_o reuses `normed` (read last by the o_proj weight GEMM, before the norm backward);
//   dg reuses d_normed (read last by the norm backward; zeroed after it);
//   d_proj [N, 3·H·K] bf16 holds d out_gate, then df (gate), then the three branches' d raw side
//   by side (row stride 3·H·K; with the products unfused each branch's in turn at stride H·K);
//   d_small [N, H + K] bf16 holds d(g_a x) ([N, K]), then dz_β | d(f_a x) side by side (row
//   stride H + K), w_small [H + K, d] bf16 W_β over W_f_a, for one dxn product over both;
//   partial holds the row partial sums of one parameter gradient at a time.
//
// dxn takes one GEMM over K = 3·H·K for q, k, v (their weights, and their gradient slots, lie one
// after another in the arenas: weights.cpp adds them in a row) and one over K = H + K for β and
// f_a, instead of five accumulating passes over the fp32 [N, d] dxn (each small-K one is all
// memory traffic). DM_KDA_FUSED_GRAD_GEMMS=0 keeps one product per weight (the A/B reference).
//
// With the full-rank output gate (weights.cpp then adds W_q, W_k, W_v, W_g, W_β, W_f_a in a row)
// every input-gradient operand goes into one [N, 4·H·K + H + K] matrix instead (one_dx_product):
// d_proj = [dq | dk | dv | d out_gate | dz_β | d(f_a x)] (raw q, k, v gradients from the short
// conv, d out_gate from the gated norm, dz_β from the β sigmoid, d(f_a x) from its GEMM, each
// writing its column block), df goes into d_o's memory (dead once the operator's backward has
// read it), and dxn = d_proj·[W_q; …; W_f_a] is ONE product over K = 8336 (gpu_1b) writing the
// fp32 dxn once: the three products before wrote it once and read and wrote it twice more. The
// six weight gradients are one [4·H·K + H + K, d] product. DM_KDA_ONE_DX_PRODUCT=0: the products
// above (the A/B reference).
struct BackwardBuffers {
  kda_gpu::ForwardViews fwd;
  uint16_t* dy;         // [N, d] bf16
  float* d_normed_then_dg;  // [N, H·K] fp32
  uint16_t* d_o;        // [N, H·K] bf16 (= fwd.normed)
  uint16_t* d_proj;     // [N, 3·H·K] bf16 ([N, 4·H·K + H + K] with the full-rank gate)
  float *dq, *dk, *dv;  // [N, H·K] fp32 operator gradients, then (in place) d pre-activation
  float* dbeta;         // [N, H] fp32
  uint16_t* d_small;    // [N, H + K] bf16: d(g_a x) [N, K], then dz_β | d(f_a x)
  uint16_t* w_small;    // [H + K, d] bf16: W_β over W_f_a
  float* partial;       // fp32 row partials (the largest of the three ops' needs)
  void* operator_own;   // the operator backward's own region (kda_chunk_backward_own_bytes)
};

// The backward's buffers; the forward's views come from `forward_plan` (the scratch, or the
// kept memory when the forward kept its internals), the rest from `plan`.
BackwardBuffers backward_carve(kda_gpu::ScratchPlan& forward_plan, kda_gpu::ScratchPlan& plan,
                               const ModelConfig& c, const kda_gpu::Dims& dims,
                               const KdaShape& shape) {
  const int64_t N = dims.N, HK = dims.HK, H = dims.H, K = dims.K;
  BackwardBuffers b{};
  b.fwd = kda_gpu::keep_carve(forward_plan, c, dims, shape);
  const kda_gpu::ForwardViews& f = b.fwd;

  b.dy = plan.take<uint16_t>(N * dims.d);
  b.d_normed_then_dg = plan.take<float>(N * HK);
  b.d_o = f.normed;
  b.d_proj = plan.take<uint16_t>(N * (c.kda.full_rank_output_gate ? 4 * HK + H + K : 3 * HK));
  b.dq = plan.take<float>(N * HK);
  b.dk = plan.take<float>(N * HK);
  b.dv = plan.take<float>(N * HK);
  b.dbeta = plan.take<float>(N * H);
  b.d_small = plan.take<uint16_t>(N * (H + K));
  b.w_small = plan.take<uint16_t>((H + K) * dims.d);
  const size_t partial_floats =
      std::max({kda_rmsnorm_gated_backward_partial_floats(N * H, K),
                kda_gate_backward_partial_floats(N, H, K),
                kda_short_conv_silu_backward_partial_floats(N, HK, dims.Kc)});
  b.partial = plan.take<float>(int64_t(partial_floats));
  b.operator_own = plan.take_bytes(kda_chunk_backward_own_bytes(shape));
  return b;
}

bool fused_grad_gemms() {  // read at each call, so that one process can run both (tests, A/B)
  return env_flag("DM_KDA_FUSED_GRAD_GEMMS", true);
}

// one_dx_product (BackwardBuffers above): the full-rank gate, the six matrices and their gradient
// slots adjacent in the arenas, and the switch on.
bool one_dx_product(const ModelConfig& c, const DeviceWeights& dw, const DeviceGrads& grads,
                    const KdaWeights& w, int64_t HK, int64_t H, int64_t d) {
  if (!c.kda.full_rank_output_gate || !fused_grad_gemms() ||
      !env_flag("DM_KDA_ONE_DX_PRODUCT", true))
    return false;
  const float* const order[] = {w.q_proj, w.k_proj, w.v_proj, w.g_full, w.b_proj, w.f_a};
  const int64_t rows[] = {HK, HK, HK, HK, H};
  int64_t at = 0;
  for (int i = 0; i < 6; ++i) {
    if (dw.bf16(order[i]) != dw.bf16(w.q_proj) + at * d ||
        grads.at(order[i]) != grads.at(w.q_proj) + at * d)
      return false;
    if (i < 5) at += rows[i];
  }
  return true;
}

void backward_check(const ModelConfig& c, int64_t B, int64_t T) {
  kda_gpu::check(c, B, T, "kda_layer_backward_gpu");
  DM_CHECK(c.kda.head_dim <= kKdaNormBackwardMaxD, "kda_layer_backward_gpu: head_dim ",
           c.kda.head_dim, " > ", kKdaNormBackwardMaxD, " (the gated-norm backward's limit)");
}

}  // namespace

namespace kda_gpu {

ForwardViews keep_carve(ScratchPlan& plan, const ModelConfig& c, const Dims& dims,
                        const KdaShape& shape) {
  const int64_t N = dims.N, HK = dims.HK, H = dims.H, K = dims.K;
  ForwardViews f{};
  for (uint16_t** p : {&f.q_raw, &f.k_raw, &f.v_raw, &f.q, &f.k, &f.v, &f.gate_raw, &f.g, &f.o,
                       &f.out_gate, &f.normed})
    *p = plan.take<uint16_t>(N * HK);
  f.gate_low = plan.take<uint16_t>(N * K);
  f.out_gate_low = c.kda.full_rank_output_gate ? nullptr : plan.take<uint16_t>(N * K);
  f.beta_logits = plan.take<float>(N * H);
  f.beta = plan.take<uint16_t>(N * H);
  // The forward's operator workspace only: the backward takes its own region (dS', stage 4's
  // hand-over) from the step's scratch (backward_carve), so a kept layer holds nothing of it.
  f.operator_workspace = plan.take_bytes(kda_chunk_forward_workspace_bytes(shape));
  return f;
}

}  // namespace kda_gpu

size_t kda_layer_backward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T, bool kept) {
  backward_check(c, B, T);
  const kda_gpu::Dims dims = kda_gpu::dims_of(c, B, T);
  kda_gpu::ScratchPlan counter, kept_counter;
  backward_carve(kept ? kept_counter : counter, counter, c, dims,
                 KdaShape{B, T, dims.H, dims.K, dims.K});
  return counter.bytes;
}

size_t kda_layer_kept_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  backward_check(c, B, T);
  const kda_gpu::Dims dims = kda_gpu::dims_of(c, B, T);
  kda_gpu::ScratchPlan counter;
  kda_gpu::keep_carve(counter, c, dims, KdaShape{B, T, dims.H, dims.K, dims.K});
  return counter.bytes;
}

void kda_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const KdaWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t B, int64_t T, const int32_t* doc_start, void* kept) {
  const ModelConfig& c = dw.config();
  backward_check(c, B, T);
  const kda_gpu::Dims dims = kda_gpu::dims_of(c, B, T);
  const int64_t N = dims.N, d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  if (N == 0) return;
  const KdaShape shape{B, T, H, K, K};
  DeviceArenaScope scope(run.scratch);
  kda_gpu::ScratchPlan plan{&run.scratch};
  kda_gpu::ScratchPlan kept_plan;
  kept_plan.base = static_cast<char*>(kept);
  const BackwardBuffers b = backward_carve(kept ? kept_plan : plan, plan, c, dims, shape);
  const kda_gpu::ForwardViews& f = b.fwd;
  CUstream_st* stream = run.stream;

  // Recompute the forward up to o_proj's input, unless the forward kept it
  // (kda_layer_forward_gpu with the same `kept`; its o_proj input `normed` is read below).
  if (!kept) kda_gpu::forward_steps(run, dw, w, xn, B, T, doc_start, /*carry=*/nullptr, f);

  // y = normed · o_projᵀ: d normed [N, H·K] fp32 (it feeds the norm's element-wise backward).
  convert_f32_to_bf16(dy, b.dy, N * d, stream);
  linear_backward(run, f.normed, dw.bf16(w.o_proj), b.dy, N, HK, d, b.d_normed_then_dg,
                  GemmOutType::F32, 0.0f, grads, w.o_proj);

  // The joint input-gradient operand's row stride and its column blocks (one_dx_product).
  const bool one_dx = one_dx_product(c, dw, grads, w, HK, H, d);
  const int64_t ld_joint = 4 * HK + H + K;

  // normed = RMSNorm(o)·o_norm ⊙ σ(out_gate), rows = N·H heads of K. d_o overwrites `normed`,
  // whose last reader (the d o_proj GEMM) is already queued.
  uint16_t* d_out_gate = one_dx ? b.d_proj + 3 * HK : b.d_proj;
  kda_rmsnorm_gated_backward(f.o, dw.f32(w.o_norm), f.out_gate, b.d_normed_then_dg, b.d_o,
                             d_out_gate, grads.at(w.o_norm), b.partial, N * H, K, c.rms_eps, stream,
                             one_dx ? HK : 0, one_dx ? ld_joint : 0);

  // Output gate G x: the first contribution to dxn WRITES it (dx_beta = 0); with one_dx_product
  // its products run with the others' at the end.
  if (c.kda.full_rank_output_gate) {
    if (!one_dx)
      linear_backward(run, xn, dw.bf16(w.g_full), d_out_gate, N, d, HK, dxn, GemmOutType::F32, 0.0f,
                      grads, w.g_full);
  } else {
    linear_backward(run, f.out_gate_low, dw.bf16(w.g_b), d_out_gate, N, K, HK, b.d_small,
                    GemmOutType::Bf16, 0.0f, grads, w.g_b);
    linear_backward(run, xn, dw.bf16(w.g_a), b.d_small, N, d, K, dxn, GemmOutType::F32, 0.0f, grads,
                    w.g_a);
  }

  // The operator (zero initial state, final state unused) STORES its gradients (accumulate =
  // false: no zeroing pass over the five buffers). dg reuses d_normed, dead since the norm
  // backward.
  float* dg = b.d_normed_then_dg;
  const float scale = 1.0f / std::sqrt(float(K));  // as the forward
  // forward_steps above ran kda_chunk_forward on these inputs into operator_workspace: the
  // operator's backward skips its own recompute of the prepare and state stages.
  kda_chunk_backward(f.q, f.k, f.v, f.g, f.beta, /*s0=*/nullptr, b.d_o, /*dsT=*/nullptr, b.dq, b.dk,
                     b.dv, dg, b.dbeta, /*ds0=*/nullptr, shape, scale, f.operator_workspace,
                     doc_start, stream, kda_backward_default_path(),
                     /*workspace_holds_forward=*/true, b.operator_own, /*accumulate=*/false);

  // β = σ(b_proj x): dz = dβ·σ(1−σ) from the fp32 logits, into d_small's first H columns.
  const bool fused = fused_grad_gemms();
  const int64_t ld_small = one_dx ? ld_joint : fused ? H + K : H;
  uint16_t* dz_beta = one_dx ? b.d_proj + 4 * HK : b.d_small;
  uint16_t* d_fa = fused ? dz_beta + H : b.d_small;  // d(f_a x) [N, K], row stride ld_small
  kda_beta_sigmoid_backward(f.beta_logits, b.dbeta, dz_beta, N * H, stream, H, ld_small);
  if (!one_dx) weight_gradient(run, grads, w.b_proj, dz_beta, ld_small, xn, N, d, H);
  if (!fused)
    run.gemm.gemm_bf16(false, false, N, d, H, 1.0f, dz_beta, H, dw.bf16(w.b_proj), d, 1.0f, dxn,
                       GemmOutType::F32, d, stream);

  // g = gate(f_b (f_a x)): df [N, H·K] bf16 into d_proj (d out_gate is dead), or with
  // one_dx_product into d_o (the operator's backward, queued above, was its last reader).
  uint16_t* df = one_dx ? b.d_o : b.d_proj;
  kda_gate_backward(f.gate_raw, dw.f32(w.A_log), dw.f32(w.dt_bias), dg, df, grads.at(w.A_log),
                    grads.at(w.dt_bias), b.partial, N, H, K, c.kda.gate == KdaGateKind::Safe,
                    c.kda.gate_lower_bound, stream);
  linear_backward(run, f.gate_low, dw.bf16(w.f_b), df, N, K, HK, nullptr, GemmOutType::Bf16, 0.0f,
                  grads, w.f_b);  // d f_b only; d(f_a x) below
  const int64_t ld_fa = fused ? ld_small : K;
  run.gemm.gemm_bf16(false, false, N, K, HK, 1.0f, df, HK, dw.bf16(w.f_b), K, 0.0f, d_fa,
                     GemmOutType::Bf16, ld_fa, stream);
  if (!one_dx) weight_gradient(run, grads, w.f_a, d_fa, ld_fa, xn, N, d, K);
  if (fused && !one_dx) {
    // dxn += [dz_β | d(f_a x)]·[W_β; W_f_a]: the two weights copied into one [H + K, d] operand.
    copy_device_to_device_async(b.w_small, dw.bf16(w.b_proj), size_t(H * d) * 2, stream);
    copy_device_to_device_async(b.w_small + H * d, dw.bf16(w.f_a), size_t(K * d) * 2, stream);
    run.gemm.gemm_bf16(false, false, N, d, H + K, 1.0f, b.d_small, H + K, b.w_small, d, 1.0f, dxn,
                       GemmOutType::F32, d, stream);
  } else if (!fused) {
    run.gemm.gemm_bf16(false, false, N, d, K, 1.0f, d_fa, K, dw.bf16(w.f_a), d, 1.0f, dxn,
                       GemmOutType::F32, d, stream);
  }

  // q, k, v = SiLU(ShortConv(W x)): the branches' d raw [N, H·K] bf16 side by side in d_proj
  // when fused (else each in turn: the previous branch's GEMMs, already queued, are its last
  // readers).
  struct Branch {
    const uint16_t* raw;
    const float* conv;
    const float* proj;
    float* d_act;
  };
  const Branch branches[3] = {Branch{f.q_raw, w.q_conv, w.q_proj, b.dq},
                              Branch{f.k_raw, w.k_conv, w.k_proj, b.dk},
                              Branch{f.v_raw, w.v_conv, w.v_proj, b.dv}};
  const int64_t block = HK * d;  // one projection's elements
  const bool fused_qkv = fused && dw.bf16(w.k_proj) == dw.bf16(w.q_proj) + block &&
                         dw.bf16(w.v_proj) == dw.bf16(w.q_proj) + 2 * block &&
                         grads.at(w.k_proj) == grads.at(w.q_proj) + block &&
                         grads.at(w.v_proj) == grads.at(w.q_proj) + 2 * block;
  const int64_t ld_raw = one_dx ? ld_joint : fused_qkv ? 3 * HK : HK;
  for (int i = 0; i < 3; ++i) {
    const Branch& br = branches[i];
    uint16_t* d_raw = b.d_proj + (fused_qkv ? i * HK : 0);
    kda_short_conv_silu_backward(br.raw, dw.f32(br.conv), br.d_act, d_raw, grads.at(br.conv),
                                 b.partial, B, T, HK, dims.Kc, doc_start, stream, ld_raw);
    if (!fused_qkv)
      linear_backward(run, xn, dw.bf16(br.proj), d_raw, N, d, HK, dxn, GemmOutType::F32, 1.0f,
                      grads, br.proj);
  }
  if (one_dx) {
    // dxn = d_proj·[W_q; W_k; W_v; W_g; W_β; W_f_a] (WRITTEN: the layer's only dxn product);
    // the six weight gradients in one product (stacked_weight_gradients).
    run.gemm.gemm_bf16(false, false, N, d, ld_joint, 1.0f, b.d_proj, ld_joint, dw.bf16(w.q_proj), d,
                       0.0f, dxn, GemmOutType::F32, d, stream);
    const float* const stacked[] = {w.q_proj, w.k_proj, w.v_proj, w.g_full, w.b_proj, w.f_a};
    const int64_t rows[] = {HK, HK, HK, HK, H, K};
    stacked_weight_gradients(run, grads, stacked, rows, 6, b.d_proj, ld_joint, xn, N, d);
  } else if (fused_qkv) {
    // dxn += [dq | dk | dv]_raw·[W_q; W_k; W_v] in one product; the weight gradients in one
    // [3·H·K, d] product (stacked_weight_gradients).
    run.gemm.gemm_bf16(false, false, N, d, 3 * HK, 1.0f, b.d_proj, 3 * HK, dw.bf16(w.q_proj), d,
                       1.0f, dxn, GemmOutType::F32, d, stream);
    const float* const stacked[] = {w.q_proj, w.k_proj, w.v_proj};
    const int64_t rows[] = {HK, HK, HK};
    stacked_weight_gradients(run, grads, stacked, rows, 3, b.d_proj, 3 * HK, xn, N, d);
  }
}

}  // namespace dm::cuda
