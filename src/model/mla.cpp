#include "model/mla.h"

#include <cmath>
#include <cstring>

#include "core/gemm.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/norm.h"

namespace dm {

namespace {
RopeParams rope_params(const MlaConfig& m) {
  RopeParams p;
  p.dim = m.qk_rope_dim;
  p.theta = m.rope_theta;
  p.yarn = m.yarn.enabled;
  p.factor = m.yarn.factor;
  p.original_max_position = m.yarn.original_max_position;
  p.beta_fast = m.yarn.beta_fast;
  p.beta_slow = m.yarn.beta_slow;
  p.mscale = m.yarn.mscale;
  p.mscale_all_dim = m.yarn.mscale_all_dim;
  return p;
}
constexpr int kAttnBlock = 64;
}  // namespace

float mla_softmax_scale(const MlaConfig& m) {
  const double base = 1.0 / std::sqrt(double(m.qk_nope_dim + m.qk_rope_dim));
  return float(base * (m.use_rope ? rope_softmax_scale_factor(rope_params(m)) : 1.0));
}

size_t mla_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T) {
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim;
  SizeCounter c;
  c.add<float>(N * std::max(m.q_lora_rank, 1));
  c.add<float>(N * H * dq);                          // q
  c.add<float>(N * (m.kv_lora_rank + m.qk_rope_dim)); // kv_a
  c.add<float>(N * m.kv_lora_rank);                  // c
  c.add<float>(N * H * (m.qk_nope_dim + m.v_head_dim));  // kv
  c.add<float>(N * H * dq);                          // k
  c.add<float>(N * H * m.v_head_dim);                // v
  c.add<float>(N * H * m.v_head_dim);                // o
  c.add<float>(N * H * m.v_head_dim);                // gate
  c.add<float>(T * std::max(m.qk_rope_dim / 2, 1) * 2);  // rope tables
  c.add<int64_t>(N);                                 // positions
  c.add<int64_t>(N * H);                             // positions per (token, head)
  return c.bytes + attention_causal_workspace_bytes(AttnShape{B, T, H, dq, m.v_head_dim}, kAttnBlock) +
         4096;
}

void mla_layer_forward(const ModelConfig& cfg, const MlaWeights& w, const float* x, float* y,
                       int64_t B, int64_t T, Arena& ws) {
  ArenaScope scope(ws);
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, d = cfg.hidden, H = m.num_heads;
  const int64_t nope = m.qk_nope_dim, rope = m.qk_rope_dim, dq = nope + rope, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank;

  // q [N, H, nope+rope]
  float* qa = ws.alloc<float>(N * std::max(m.q_lora_rank, 1));
  float* q = ws.alloc<float>(N * H * dq);
  if (m.q_lora_rank > 0) {
    linear(qa, x, w.q_a, N, d, m.q_lora_rank);
    rmsnorm_forward(qa, w.q_a_norm, qa, N, m.q_lora_rank, m.latent_norm_eps);
    linear(q, qa, w.q_b, N, m.q_lora_rank, H * dq);
  } else {
    linear(q, x, w.q_proj, N, d, H * dq);
  }
  // [c ; kr] = W_kva x;  c = RMSNorm(c);  [k_nope | v]_h = W_kvb c
  float* kva = ws.alloc<float>(N * (kvl + rope));
  float* c = ws.alloc<float>(N * kvl);
  float* kv = ws.alloc<float>(N * H * (nope + dv));
  linear(kva, x, w.kv_a, N, d, kvl + rope);
  for (int64_t n = 0; n < N; ++n) std::memcpy(c + n * kvl, kva + n * (kvl + rope), kvl * sizeof(float));
  rmsnorm_forward(c, w.kv_a_norm, c, N, kvl, m.latent_norm_eps);
  linear(kv, c, w.kv_b, N, kvl, H * (nope + dv));

  if (m.use_rope && rope > 0) {
    float* cosv = ws.alloc<float>(T * (rope / 2));
    float* sinv = ws.alloc<float>(T * (rope / 2));
    int64_t* pos = ws.alloc<int64_t>(N);
    const RopeParams rp = rope_params(m);
    rope_build_tables(rp, T, cosv, sinv);
    for (int64_t n = 0; n < N; ++n) pos[n] = n % T;
    // q_rope of every head: rows [N·H] of stride dq, rotary slice at offset nope.
    int64_t* pos_h = ws.alloc<int64_t>(N * H);
    for (int64_t n = 0; n < N * H; ++n) pos_h[n] = pos[n / H];
    rope_apply_interleaved(q, N * H, dq, nope, int(rope), pos_h, cosv, sinv);
    rope_apply_interleaved(kva, N, kvl + rope, kvl, int(rope), pos, cosv, sinv);
  }
  // Expanded keys/values: k_h = [k_nope_h | kr] (kr shared by all heads), v_h.
  float* k = ws.alloc<float>(N * H * dq);
  float* v = ws.alloc<float>(N * H * dv);
#pragma omp parallel for schedule(static) if (N * H * dq > 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kv + (n * H + h) * (nope + dv);
      float* kd = k + (n * H + h) * dq;
      std::memcpy(kd, src, nope * sizeof(float));
      std::memcpy(kd + nope, kva + n * (kvl + rope) + kvl, rope * sizeof(float));
      std::memcpy(v + (n * H + h) * dv, src + nope, dv * sizeof(float));
    }
  float* o = ws.alloc<float>(N * H * dv);
  const AttnShape as{B, T, H, dq, dv};
  attention_causal_forward(q, k, v, o, nullptr, as, mla_softmax_scale(m), ws, kAttnBlock);
  if (m.output_gate) {
    float* gate = ws.alloc<float>(N * H * dv);
    linear(gate, x, w.gate, N, d, H * dv);
#pragma omp parallel for schedule(static) if (N * H * dv > 65536)
    for (int64_t i = 0; i < N * H * dv; ++i) o[i] *= sigmoidf_stable(gate[i]);
  }
  linear(y, o, w.o_proj, N, H * dv, d);
}

}  // namespace dm
