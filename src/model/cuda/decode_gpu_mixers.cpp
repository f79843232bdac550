// The KDA and MLA sub-layers of one GpuDecoder step (decode_gpu.h; the per-step algebra is in
// decode_gpu.cpp's header comment) and the scratch each carves.
#include <cmath>

#include "core/error.h"
#include "model/cuda/decode_gpu_internal.h"
#include "model/cuda/layers.h"
#include "model/mla.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/mla_layer_ops.h"

namespace dm::cuda {
namespace decode_detail {

KdaStepBuffers carve_kda(Carver& cv, const ModelConfig& c, int64_t n) {
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  KdaStepBuffers b;
  for (auto*& r : b.raw) r = cv.take<uint16_t>(n * HK);
  for (auto*& q : b.qkv) q = cv.take<uint16_t>(n * HK);
  b.low = cv.take<uint16_t>(n * K);
  b.low_gate = cv.take<uint16_t>(n * K);
  b.out_gate = cv.take<uint16_t>(n * HK);
  b.beta_logits = cv.take<float>(n * H);
  b.o = cv.take<uint16_t>(n * HK);
  return b;
}

MlaStepBuffers carve_mla(Carver& cv, const ModelConfig& c, int64_t n, size_t attention_ws) {
  const MlaConfig& m = c.mla;
  const int64_t H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, Wd = kvl + m.qk_rope_dim;
  MlaStepBuffers b;
  if (m.q_lora_rank > 0) {
    b.q_a = cv.take<float>(n * m.q_lora_rank);
    b.q_a_normed = cv.take<uint16_t>(n * m.q_lora_rank);
  }
  b.q = cv.take<uint16_t>(n * H * dq);
  b.kv_a = cv.take<float>(n * Wd);
  b.q_abs = cv.take<uint16_t>(n * H * Wd);
  b.latent = cv.take<uint16_t>(n * H * kvl);
  b.attention_ws = cv.take_bytes(attention_ws);
  b.o = cv.take<uint16_t>(n * H * dv);
  if (m.output_gate) b.gate = cv.take<uint16_t>(n * H * dv);
  return b;
}

MlaDecodePlan plan_for(const ModelConfig& c, int64_t n, int64_t P, int num_sms) {
  return mla_decode_plan(int(n), c.mla.num_heads, int(P), num_sms);
}

size_t attention_ws_bytes(const ModelConfig& c, int64_t n, int64_t P, int num_sms) {
  return mla_decode_workspace_bytes(plan_for(c, n, P, num_sms), int(n), c.mla.num_heads,
                                    c.mla.kv_lora_rank);
}

}  // namespace decode_detail

using namespace decode_detail;

void GpuDecoder::kda_step(int layer, const uint16_t* xn, float* y, const Rows& rows) {
  const ModelConfig& c = config();
  const KdaWeights& w = dw_->host().layers[size_t(layer)].kda;
  const DeviceWeights& dw = *dw_;
  GpuRun& run = *run_;
  CUstream_st* stream = run.stream;
  const int64_t n = rows.n, d = c.hidden, H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  DeviceArenaScope scope(run.scratch);
  Carver cv{&run.scratch};
  const KdaStepBuffers b = carve_kda(cv, c, n);

  // Every projection of x in one pass over the weights (one GEMV launch at decode sizes):
  // raw q, k, v; the gate's and the output gate's low-rank inputs (or the full-rank output
  // gate); β's logits in fp32.
  const bool full_gate = c.kda.full_rank_output_gate;
  const LinearOut projections[] = {
      {dw.bf16(w.q_proj), HK, b.raw[0], GemmOutType::Bf16},
      {dw.bf16(w.k_proj), HK, b.raw[1], GemmOutType::Bf16},
      {dw.bf16(w.v_proj), HK, b.raw[2], GemmOutType::Bf16},
      {dw.bf16(w.f_a), K, b.low, GemmOutType::Bf16},
      {dw.bf16(w.b_proj), H, b.beta_logits, GemmOutType::F32},
      full_gate ? LinearOut{dw.bf16(w.g_full), HK, b.out_gate, GemmOutType::Bf16}
                : LinearOut{dw.bf16(w.g_a), K, b.low_gate, GemmOutType::Bf16}};
  linear_many(run, xn, n, d, projections, 6);

  const float* conv[3] = {w.q_conv, w.k_conv, w.v_conv};
  uint16_t* tails[3] = {kda_tail_q_[size_t(layer)], kda_tail_k_[size_t(layer)],
                        kda_tail_v_[size_t(layer)]};
  const float scale = 1.0f / std::sqrt(float(K));
  if (options_.fused_kda && kda_decode_fused_applies(n, K, K, c.kda.conv_kernel)) {
    // Conv, gates, recurrent step and gated norm in one launch (decode_ops.h), then W_o.
    KdaFusedStepArgs f;
    f.H = H;
    f.conv_kernel = c.kda.conv_kernel;
    f.scale = scale;
    f.eps = c.rms_eps;
    f.lower_bound = c.kda.gate_lower_bound;
    f.safe_gate = c.kda.gate == KdaGateKind::Safe;
    for (int br = 0; br < 3; ++br) {
      f.raw[br] = b.raw[br];
      f.conv_weight[br] = dw.f32(conv[br]);
      f.tail[br] = tails[br];
    }
    f.low = b.low;
    f.f_up = dw.bf16(w.f_b);
    f.A_log = dw.f32(w.A_log);
    f.dt_bias = dw.f32(w.dt_bias);
    f.beta_logits = b.beta_logits;
    if (full_gate) {
      f.gate = b.out_gate;
    } else {
      f.low_gate = b.low_gate;
      f.g_up = dw.bf16(w.g_b);
    }
    f.norm_weight = dw.f32(w.o_norm);
    f.state = kda_state_[size_t(layer)];
    f.slots = rows.slots;
    f.out = b.o;
    decode_kda_fused_step(f, n, stream);
    linear(run, b.o, dw.bf16(w.o_proj), n, HK, d, y, GemmOutType::F32);
    return;
  }

  // q, k, v = SiLU(conv(tail ; raw)), the tails advancing by this token's raw projections.
  KdaConvStepArgs args;
  for (int br = 0; br < 3; ++br) {
    args.raw[br] = b.raw[br];
    args.weight[br] = dw.f32(conv[br]);
    args.tail[br] = tails[br];
    args.out[br] = b.qkv[br];
  }
  decode_kda_conv_step(args, rows.slots, n, HK, c.kda.conv_kernel, stream);

  // The gate's input W_f↑ W_f↓ x in raw[0] (free after the conv).
  uint16_t* f = b.raw[0];
  linear(run, b.low, dw.bf16(w.f_b), n, K, HK, f, GemmOutType::Bf16);

  // The recurrent operator, T = 1, row r against slot slots[r]'s state in place; it applies
  // the decay gate to f and β = sigmoid(logits) itself.
  KdaStepGates gates;
  gates.f = f;
  gates.A_log = dw.f32(w.A_log);
  gates.dt_bias = dw.f32(w.dt_bias);
  gates.beta_logits = b.beta_logits;
  gates.safe_gate = c.kda.gate == KdaGateKind::Safe;
  gates.lower_bound = c.kda.gate_lower_bound;
  decode_kda_recurrent_step(b.qkv[0], b.qkv[1], b.qkv[2], gates, kda_state_[size_t(layer)],
                            rows.slots, b.o, n, H, K, K, scale, stream);

  // Per-head RMSNorm ⊙ sigmoid(output gate) in place, then W_o (fp32 out).
  uint16_t* out_gate = b.out_gate;
  if (!full_gate) linear(run, b.low_gate, dw.bf16(w.g_b), n, K, HK, out_gate, GemmOutType::Bf16);
  kda_rmsnorm_gated_forward(b.o, dw.f32(w.o_norm), out_gate, b.o, n * H, K, c.rms_eps, stream);
  linear(run, b.o, dw.bf16(w.o_proj), n, HK, d, y, GemmOutType::F32);
}

void GpuDecoder::mla_step(GpuRun& run, int layer, const uint16_t* xn, float* y, const Rows& rows) {
  const ModelConfig& c = config();
  const MlaConfig& m = c.mla;
  const MlaWeights& w = dw_->host().layers[size_t(layer)].mla;
  const DeviceWeights& dw = *dw_;
  CUstream_st* stream = run.stream;
  const int64_t n = rows.n, d = c.hidden, H = m.num_heads, nope = m.qk_nope_dim;
  const int64_t rope = m.qk_rope_dim, dq = nope + rope, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, ql = m.q_lora_rank, Wd = kvl + rope, P = pages_per_slot_;
  const int64_t kvb_rows_per_head = nope + dv;  // W_kvb [H·(nope + dv), kvl]
  const MlaDecodePlan plan = plan_for(c, n, P, num_sms_);
  DeviceArenaScope scope(run.scratch);
  Carver cv{&run.scratch};
  const MlaStepBuffers b =
      carve_mla(cv, c, n, mla_decode_workspace_bytes(plan, int(n), int(H), int(kvl)));
  const float* cos = rope_on(m) ? rope_cos_ : nullptr;
  const float* sin = rope_on(m) ? rope_sin_ : nullptr;

  // The projections of x in one pass (one GEMV launch at decode sizes): q (through the q LoRA,
  // whose GEMM writes fp32 so its norm sees unrounded values), [c ; kr] = W_kva x (fp32), and
  // the output gate.
  LinearOut projections[3];
  int count = 0;
  projections[count++] = ql > 0 ? LinearOut{dw.bf16(w.q_a), ql, b.q_a, GemmOutType::F32}
                                : LinearOut{dw.bf16(w.q_proj), H * dq, b.q, GemmOutType::Bf16};
  projections[count++] = LinearOut{dw.bf16(w.kv_a), Wd, b.kv_a, GemmOutType::F32};
  if (m.output_gate)
    projections[count++] = LinearOut{dw.bf16(w.gate), H * dv, b.gate, GemmOutType::Bf16};
  linear_many(run, xn, n, d, projections, count);
  if (ql > 0) {
    mla_rmsnorm_rows(b.q_a, ql, dw.f32(w.q_a_norm), b.q_a_normed, n, ql, m.latent_norm_eps,
                     stream);
    linear(run, b.q_a_normed, dw.bf16(w.q_b), n, ql, H * dq, b.q, GemmOutType::Bf16);
  }
  // The slot's cache row [RMSNorm(c) ; RoPE(kr)] at its position.
  decode_mla_write_latent(b.kv_a, dw.f32(w.kv_a_norm), n, kvl, rope, m.latent_norm_eps, cos, sin,
                          rows.positions, rows.row_table, P, kPageTokens,
                          mla_pages_[size_t(layer)], stream);

  // Absorbed queries: q_abs[:, h, :kvl] = q_nope_h · W_k,h (W_k,h = W_kvb's key rows of head h,
  // [nope, kvl]); q_abs[:, h, kvl:] = RoPE(q_rope_h).
  const uint16_t* kv_b = dw.bf16(w.kv_b);
  // Few rows: our per-head kernels (PDL, weights loaded before the wait); else one
  // strided-batched GEMM over the heads (batch h: columns h·dq of q, rows h·(nope+dv) of W).
  const bool own_products =
      options_.mla_own_products && decode_mla_projections_apply(n, kvl, kv_b, b.latent);
  if (own_products) {
    decode_mla_absorb_query(b.q, kv_b, n, H, nope, rope, kvl, dv, cos, sin, rows.positions, b.q_abs,
                            stream);
  } else {
    run.gemm.gemm_bf16_strided_batched(false, false, n, kvl, nope, 1.0f, b.q, H * dq, dq, kv_b, kvl,
                                       kvb_rows_per_head * kvl, 0.0f, b.q_abs, GemmOutType::Bf16,
                                       H * Wd, Wd, H, stream);
    decode_mla_query_rope(b.q, n, H, nope, rope, kvl, cos, sin, rows.positions, b.q_abs, stream);
  }

  MlaDecodeArgs args;
  args.q = b.q_abs;
  args.cache = mla_pages_[size_t(layer)];
  args.page_table = rows.row_table;
  args.seq_len = rows.seq_len;
  args.out = b.latent;
  args.S = int(n);
  args.H = int(H);
  args.Dk = int(Wd);
  args.Dv = int(kvl);
  args.scale = double(mla_softmax_scale(m));  // the CPU decode's float scale (× mscale² YaRN)
  mla_decode_absorbed(args, plan, b.attention_ws, stream);

  // o_h = W_v,h · latent_h (W_v,h = W_kvb's value rows of head h, [dv, kvl]), output gate, W_o.
  if (own_products)
    decode_mla_value_projection(b.latent, kv_b, n, H, nope, kvl, dv, b.o, stream);
  else
    run.gemm.gemm_bf16_strided_batched(false, true, n, dv, kvl, 1.0f, b.latent, H * kvl, kvl,
                                       kv_b + nope * kvl, kvl, kvb_rows_per_head * kvl, 0.0f, b.o,
                                       GemmOutType::Bf16, H * dv, dv, H, stream);
  if (m.output_gate) mla_gate_multiply(b.o, b.gate, n * H * dv, stream);
  linear(run, b.o, dw.bf16(w.o_proj), n, H * dv, d, y, GemmOutType::F32);
}

}  // namespace dm::cuda
