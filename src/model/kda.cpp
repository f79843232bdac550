#include "model/kda.h"

#include <cmath>

#include "core/gemm.h"
#include "ops/cpu/kda.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cpu/norm.h"

namespace dm {

size_t kda_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk) {
  const int64_t N = B * T, H = cfg.kda.num_heads, K = cfg.kda.head_dim, HK = H * K;
  SizeCounter c;
  c.add<float>(N * HK);   // raw projection (reused for q, k, v)
  c.add<float>(N * HK);   // q
  c.add<float>(N * HK);   // k
  c.add<float>(N * HK);   // v
  c.add<float>(N * K);    // low-rank bottleneck (f_a x, g_a x)
  c.add<float>(N * HK);   // g (log decay), later the output gate
  c.add<float>(N * H);    // beta
  c.add<float>(N * HK);   // o
  KdaShape s{B, T, H, K, K};
  return c.bytes + (chunk > 0 ? kda_chunk_workspace_bytes<float>(s, chunk) : 0) + 4096;
}

void kda_layer_forward(const ModelConfig& cfg, const KdaWeights& w, const float* x, float* y,
                       int64_t B, int64_t T, Arena& ws, const KdaRunOptions& opt) {
  ArenaScope scope(ws);
  const int64_t N = B * T, d = cfg.hidden, H = cfg.kda.num_heads, K = cfg.kda.head_dim, HK = H * K;
  const int Kc = cfg.kda.conv_kernel;
  float* raw = ws.alloc<float>(N * HK);
  float* q = ws.alloc<float>(N * HK);
  float* k = ws.alloc<float>(N * HK);
  float* v = ws.alloc<float>(N * HK);
  float* low = ws.alloc<float>(N * K);
  float* g = ws.alloc<float>(N * HK);
  float* beta = ws.alloc<float>(N * H);
  float* o = ws.alloc<float>(N * HK);

  // q, k, v = SiLU(ShortConv(W x)) — [B, T, H·K], i.e. the operator's [B, T, H, K] layout.
  linear(raw, x, w.q_proj, N, d, HK);
  short_conv_silu_forward(raw, w.q_conv, nullptr, q, B, T, HK, Kc);
  linear(raw, x, w.k_proj, N, d, HK);
  short_conv_silu_forward(raw, w.k_conv, nullptr, k, B, T, HK, Kc);
  linear(raw, x, w.v_proj, N, d, HK);
  short_conv_silu_forward(raw, w.v_conv, nullptr, v, B, T, HK, Kc);

  // Per-channel log decay g = gate(W_f↑ W_f↓ x) and per-head β = sigmoid(W_β x).
  linear(low, x, w.f_a, N, d, K);
  linear(raw, low, w.f_b, N, K, HK);
  kda_gate_forward(raw, w.A_log, w.dt_bias, g, N, H, K, cfg.kda.gate, cfg.kda.gate_lower_bound);
  linear(beta, x, w.b_proj, N, d, H);
  sigmoid_inplace(beta, N * H);

  const KdaShape s{B, T, H, K, K};
  const float scale = 1.0f / std::sqrt(float(K));
  if (opt.chunk > 0)
    kda_chunk_forward<float>(q, k, v, g, beta, nullptr, o, nullptr, s, scale, opt.chunk, ws);
  else
    kda_recurrent_forward<float>(q, k, v, g, beta, nullptr, o, nullptr, s, scale);

  // Output gate (low-rank or full-rank), per-head RMSNorm ⊙ sigmoid(gate), then W_o.
  if (w.g_full) {
    linear(g, x, w.g_full, N, d, HK);
  } else {
    linear(low, x, w.g_a, N, d, K);
    linear(g, low, w.g_b, N, K, HK);
  }
  rmsnorm_gated_forward(o, w.o_norm, g, o, N * H, K, cfg.rms_eps);
  linear(y, o, w.o_proj, N, HK, d);
}

}  // namespace dm
