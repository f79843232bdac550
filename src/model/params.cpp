// Parameter counting (see params.h). Each component mirrors the tensors the weight table builds
// (model/weights.cpp) and the public checkpoints store; shapes are in the comments.
#include "model/params.h"

#include <cstdio>
#include <initializer_list>

#include "core/error.h"

namespace dm {
namespace {

// Products of config dimensions can exceed int64 only for nonsense configs; report those instead
// of wrapping around.
int64_t checked_mul(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors)
    if (__builtin_mul_overflow(r, f, &r)) throw Error("parameter count overflows int64 (config too large)");
  return r;
}
int64_t checked_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Error("parameter count overflows int64 (config too large)");
  return r;
}

// Parameters of one KDA layer.
int64_t kda_layer_params(const ModelConfig& c) {
  const int64_t d = c.hidden, H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  int64_t n = 0;
  n = checked_add(n, checked_mul({3, HK, d}));                 // q/k/v_proj [HK, d]
  n = checked_add(n, checked_mul({3, HK, c.kda.conv_kernel}));  // q/k/v_conv1d [HK, 1, kernel]
  n = checked_add(n, checked_mul({K, d}));                     // f_a_proj [K, d]
  n = checked_add(n, checked_mul({HK, K}));                    // f_b_proj [HK, K]
  n = checked_add(n, checked_mul({H, d}));                     // b_proj [H, d]
  n = checked_add(n, H);                                       // A_log [H] (unpadded)
  n = checked_add(n, HK);                                      // dt_bias [HK]
  if (c.kda.full_rank_output_gate)
    n = checked_add(n, checked_mul({HK, d}));                  // g_proj [HK, d]
  else
    n = checked_add(n, checked_add(checked_mul({K, d}), checked_mul({HK, K})));  // g_a [K,d], g_b [HK,K]
  n = checked_add(n, K);                                       // o_norm [K] (shared by heads)
  n = checked_add(n, checked_mul({d, HK}));                    // o_proj [d, HK]
  return n;
}

// Parameters of one MLA layer.
int64_t mla_layer_params(const ModelConfig& c) {
  const MlaConfig& m = c.mla;
  const int64_t d = c.hidden, H = m.num_heads, dq = int64_t(m.qk_nope_dim) + m.qk_rope_dim;
  int64_t n = 0;
  if (m.q_lora_rank > 0) {
    n = checked_add(n, checked_mul({m.q_lora_rank, d}));      // q_a_proj [q_lora, d]
    n = checked_add(n, m.q_lora_rank);                         // q_a_layernorm
    n = checked_add(n, checked_mul({H, dq, m.q_lora_rank}));   // q_b_proj [H·dq, q_lora]
  } else {
    n = checked_add(n, checked_mul({H, dq, d}));               // q_proj [H·dq, d]
  }
  n = checked_add(n, checked_mul({int64_t(m.kv_lora_rank) + m.qk_rope_dim, d}));  // kv_a_proj_with_mqa
  n = checked_add(n, m.kv_lora_rank);                                              // kv_a_layernorm
  n = checked_add(n, checked_mul({H, int64_t(m.qk_nope_dim) + m.v_head_dim, m.kv_lora_rank}));  // kv_b_proj
  n = checked_add(n, checked_mul({d, H, m.v_head_dim}));       // o_proj [d, H·v]
  if (m.output_gate) n = checked_add(n, checked_mul({H, m.v_head_dim, d}));  // g_proj [H·v, d]
  return n;
}

// Accumulates named components in a fixed order.
struct Breakdown {
  ParamCount pc;
  void add(const char* name, int64_t total, int64_t active) {
    if (total == 0 && active == 0) return;
    pc.breakdown_total.emplace_back(name, total);
    pc.breakdown_active.emplace_back(name, active);
    pc.total = checked_add(pc.total, total);
    pc.active = checked_add(pc.active, active);
  }
};

}  // namespace

ParamCount count_params(const ModelConfig& c) {
  validate_config(c, "count_params");
  const int64_t d = c.hidden, V = c.vocab_size, L = c.num_layers;
  const int64_t n_kda = c.num_kda_layers(), n_mla = c.num_mla_layers(), n_moe = c.num_moe_layers();
  const int64_t n_dense = L - n_moe;
  Breakdown b;

  // embed_tokens [V, d]: a row lookup per token, so not active. A tied lm_head reuses it.
  const int64_t embedding = checked_mul({V, d});
  b.add("embedding", embedding, 0);

  b.add("kda_attention", checked_mul({n_kda, kda_layer_params(c)}), checked_mul({n_kda, kda_layer_params(c)}));
  if (n_mla > 0) {
    const int64_t mla = checked_mul({n_mla, mla_layer_params(c)});
    b.add("mla_attention", mla, mla);
  }
  // input_layernorm + post_attention_layernorm per layer, final norm.
  const int64_t norms = checked_add(checked_mul({2, L, d}), d);
  b.add("norms", norms, norms);
  if (c.residual == ResidualKind::AttnRes) {
    // Per layer two sites (attention, FFN), each a pseudo-query [d] and a key norm [d]; plus the
    // output site before the final norm.
    const int64_t attn_res = checked_add(checked_mul({L, 4, d}), 2 * d);
    b.add("attn_res", attn_res, attn_res);
  }
  const int64_t dense = checked_mul({n_dense, 3, c.dense_ffn, d});  // gate/up [F, d], down [d, F]
  b.add("dense_ffn", dense, dense);

  if (n_moe > 0) {
    const MoeConfig& m = c.moe;
    const int64_t router = checked_mul({n_moe, checked_add(checked_mul({m.num_experts, d}), m.num_experts)});
    b.add("moe_router", router, router);  // gate.weight [E, d] + e_score_correction_bias [E]
    // Each routed expert: w1/w3 [F, ℓ], w2 [ℓ, F] with ℓ = latent width (d without latent).
    const int64_t width = m.latent_dim > 0 ? m.latent_dim : d;
    const int64_t expert = checked_mul({3, m.expert_ffn, width});
    b.add("moe_routed_experts", checked_mul({n_moe, m.num_experts, expert}), checked_mul({n_moe, m.top_k, expert}));
    // Shared experts, stored fused as one FFN of num_shared × shared_ffn at full width.
    const int64_t shared = checked_mul({n_moe, 3, m.num_shared, m.shared_ffn, d});
    b.add("moe_shared_experts", shared, shared);
    if (m.latent_dim > 0) {
      // routed_expert_down_proj [ℓ, d], routed_expert_up_proj [d, ℓ], routed_expert_norm [ℓ].
      const int64_t latent = checked_mul({n_moe, checked_add(checked_mul({2, m.latent_dim, d}),
                                                             m.latent_norm ? m.latent_dim : 0)});
      b.add("moe_latent_proj", latent, latent);
    }
  }

  // lm_head [V, d]: its own tensor unless tied; active either way (every token multiplies it).
  b.add("lm_head", c.tie_embeddings ? 0 : embedding, embedding);
  return b.pc;
}

std::string format_param_count(int64_t n) {
  char buf[32];
  const double x = double(n);
  if (x >= 1e12) std::snprintf(buf, sizeof(buf), "%.2fT", x / 1e12);
  else if (x >= 1e9) std::snprintf(buf, sizeof(buf), "%.1fB", x / 1e9);
  else if (x >= 1e6) std::snprintf(buf, sizeof(buf), "%.1fM", x / 1e6);
  else if (x >= 1e3) std::snprintf(buf, sizeof(buf), "%.1fK", x / 1e3);
  else std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(n));
  return buf;
}

}  // namespace dm
