// ModelConfig consistency checks and layer counts. Reading is in config_read*.cpp, writing in
// config_write.cpp.
#include "io/config.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "io/config_json_fields.h"

namespace dm {

int ModelConfig::num_kda_layers() const {
  return int(std::count(mixers.begin(), mixers.end(), MixerKind::KDA));
}
int ModelConfig::num_mla_layers() const {
  return int(std::count(mixers.begin(), mixers.end(), MixerKind::MLA));
}
int ModelConfig::num_moe_layers() const {
  return int(std::count(ffns.begin(), ffns.end(), FfnKind::MoE));
}

namespace config_detail {

void validate_config_named(const ModelConfig& c, const std::string& origin,
                           const ConfigFieldNames& names) {
  auto bad = [&](const std::string& field, const auto&... msg) {
    throw Error(str_cat(origin, ": field '", names.prefix, field, "': ", msg...));
  };
  auto positive = [&](const std::string& field, int64_t v, int64_t hi) {
    if (v < 1 || v > hi) bad(field, "must be in [1, ", hi, "] (got ", v, ")");
  };
  auto finite_positive = [&](const std::string& field, double v) {
    if (!std::isfinite(v) || v <= 0) bad(field, "must be a finite number > 0 (got ", v, ")");
  };

  positive("vocab_size", c.vocab_size, kMaxDim);
  positive("hidden_size", c.hidden, kMaxDim);
  positive("num_hidden_layers", c.num_layers, kMaxLayers);
  if (int64_t(c.mixers.size()) != c.num_layers)
    bad("linear_attn_config", "describes ", c.mixers.size(), " layers but num_hidden_layers = ", c.num_layers);
  if (int64_t(c.ffns.size()) != c.num_layers)
    bad("mlp_layer_types", "describes ", c.ffns.size(), " layers but num_hidden_layers = ", c.num_layers);
  if (c.source_type != "kimi_linear" && c.source_type != "kimi_k3" && c.source_type != "deepseek_v3")
    bad("source_model_type", "'", c.source_type, "' (expected kimi_linear, kimi_k3 or deepseek_v3)");
  finite_positive("rms_norm_eps", c.rms_eps);
  if (!std::isfinite(c.init_std) || c.init_std < 0) bad("initializer_range", "must be finite and >= 0");
  positive(names.max_context, c.max_context, kMaxContext);

  if (c.activation == Activation::SiTU) {
    finite_positive("activation_situ_beta", c.situ_beta1);
    finite_positive("activation_situ_linear_beta", c.situ_beta2);
  }
  if (c.residual == ResidualKind::AttnRes) positive("attn_res_block_size", c.attn_res_block, kMaxLayers);
  else if (c.attn_res_block != 0) bad("attn_res_block_size", "must be 0 with the plain residual");

  if (c.num_kda_layers() > 0) {
    const KdaConfig& k = c.kda;
    positive(names.kda_heads, k.num_heads, kMaxDim);
    positive(names.kda_head_dim, k.head_dim, kMaxDim);
    positive(names.kda_conv, k.conv_kernel, 64);
    // SPEC §1.1: the safe gate's lower bound lies in [-5, 0).
    if (k.gate == KdaGateKind::Safe && !(k.gate_lower_bound >= -5.0f && k.gate_lower_bound < 0.0f))
      bad(names.gate_lower_bound, "must be in [-5, 0) (got ", k.gate_lower_bound, ")");
  }

  if (c.num_mla_layers() > 0) {
    const MlaConfig& m = c.mla;
    positive("num_attention_heads", m.num_heads, kMaxDim);
    if (m.q_lora_rank < 0 || m.q_lora_rank > kMaxDim) bad("q_lora_rank", "must be >= 0 (0/null = none)");
    positive("kv_lora_rank", m.kv_lora_rank, kMaxDim);
    if (m.qk_nope_dim < 0 || m.qk_nope_dim > kMaxDim) bad("qk_nope_head_dim", "must be >= 0");
    if (m.qk_rope_dim < 0 || m.qk_rope_dim > kMaxDim) bad("qk_rope_head_dim", "must be >= 0");
    if (m.qk_nope_dim + m.qk_rope_dim < 1)
      bad("qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be > 0");
    positive("v_head_dim", m.v_head_dim, kMaxDim);
    finite_positive("mla_latent_norm_eps", m.latent_norm_eps);
    if (m.use_rope) {
      if (m.qk_rope_dim < 2 || m.qk_rope_dim % 2 != 0)
        bad("qk_rope_head_dim", "RoPE rotates pairs: must be even and >= 2 (got ", m.qk_rope_dim, ")");
      if (!std::isfinite(m.rope_theta) || m.rope_theta <= 1.0)
        bad("rope_theta", "must be a finite number > 1 (got ", m.rope_theta, ")");
    }
    if (m.yarn.enabled) {
      const YarnConfig& y = m.yarn;
      if (!std::isfinite(y.factor) || y.factor <= 0) bad("rope_scaling", "YaRN factor must be > 0");
      if (!std::isfinite(y.original_max_position) || y.original_max_position < 1)
        bad("rope_scaling", "YaRN original_max_position_embeddings must be >= 1");
      if (!std::isfinite(y.beta_fast) || !std::isfinite(y.beta_slow) || y.beta_fast <= 0 || y.beta_slow <= 0)
        bad("rope_scaling", "YaRN beta_fast/beta_slow must be > 0");
      if (!std::isfinite(y.mscale) || !std::isfinite(y.mscale_all_dim))
        bad("rope_scaling", "YaRN mscale/mscale_all_dim must be finite");
    }
  }

  if (c.num_moe_layers() < c.num_layers) positive("intermediate_size", c.dense_ffn, kMaxDim);

  if (c.num_moe_layers() > 0) {
    const MoeConfig& m = c.moe;
    positive(names.num_experts, m.num_experts, kMaxExperts);
    if (m.top_k < 1 || m.top_k > m.num_experts)
      bad(names.top_k, "must be in [1, ", names.num_experts, " = ", m.num_experts, "] (got ", m.top_k, ")");
    positive("moe_intermediate_size", m.expert_ffn, kMaxDim);
    if (m.num_shared < 0 || m.num_shared > kMaxExperts) bad(names.num_shared, "must be >= 0");
    if (m.num_shared > 0) positive("shared_expert_intermediate_size", m.shared_ffn, kMaxDim);
    if (m.latent_dim < 0 || m.latent_dim > kMaxDim) bad("routed_expert_hidden_size", "must be >= 0");
    if (m.latent_norm && m.latent_dim == 0)
      bad("latent_moe_use_norm", "needs a latent projection (routed_expert_hidden_size > 0)");
    positive(names.n_group, m.n_group, kMaxExperts);
    if (m.num_experts % m.n_group != 0)
      bad(names.n_group, m.n_group, " does not divide ", names.num_experts, " = ", m.num_experts);
    // Group scores are the sum of each group's top-2 biased scores (SPEC §1.5).
    if (m.n_group > 1 && m.num_experts / m.n_group < 2)
      bad(names.n_group, "groups need at least 2 experts each (", m.num_experts, " experts in ",
          m.n_group, " groups)");
    if (m.topk_group < 1 || m.topk_group > m.n_group)
      bad(names.topk_group, "must be in [1, ", names.n_group, " = ", m.n_group, "] (got ", m.topk_group, ")");
    if (int64_t(m.top_k) > int64_t(m.topk_group) * (m.num_experts / m.n_group))
      bad(names.top_k, m.top_k, " exceeds the ", int64_t(m.topk_group) * (m.num_experts / m.n_group),
          " experts of the ", m.topk_group, " selected groups");
    finite_positive("routed_scaling_factor", m.routed_scaling);
    if (!std::isfinite(m.router_init_std) || m.router_init_std < 0)
      bad("router_initializer_range", "must be finite and >= 0");
  }
}

}  // namespace config_detail

void validate_config(const ModelConfig& cfg, const std::string& origin) {
  config_detail::validate_config_named(cfg, origin, config_detail::ConfigFieldNames{});
}

}  // namespace dm
