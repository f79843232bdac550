// Writes a ModelConfig in the K3 schema, our own config format (SPEC §4):
//   {"model_type": "kimi_k3", "text_config": {...K3 text fields...}}
// The text_config is what the K3 reference's config class reads, plus the few fields of our own
// that make every ModelConfig field round-trip (parse_config(config_to_k3_json(c)) == c):
//   source_model_type, weight_naming     which model family / checkpoint tensor names
//   mla_latent_norm_eps                  eps of the MLA q_a/kv_a RMSNorms
//   router_initializer_range             router init std (SPEC §1.5)
//   shared_expert_intermediate_size      only when it differs from moe_intermediate_size
//   mlp_layer_types                      only when first_k_dense_replace cannot express the layout
// Settings that are inert in the written model are not carried: gate_lower_bound under the
// softplus gate, YaRN parameters while YaRN is off (parsing always yields their defaults).
#include <charconv>
#include <cmath>
#include <limits>
#include <cstdlib>

#include "io/config.h"
#include "io/config_json_fields.h"

namespace dm {
namespace {

using config_detail::Json;

// The shortest decimal that reads back as the same float (1e-05, not 9.999999747378752e-06),
// so written configs stay readable; falls back to the exact double if double rounding differs.
Json json_float(float v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  *res.ptr = '\0';
  const double shortest = std::strtod(buf, nullptr);
  // The reader rejects magnitudes above FLT_MAX, which the shortest form of FLT_MAX itself exceeds.
  const bool exact = float(shortest) == v && std::fabs(shortest) <= double(std::numeric_limits<float>::max());
  return exact ? Json(shortest) : Json(double(v));
}

Json one_based_layers(const std::vector<MixerKind>& mixers, MixerKind kind) {
  Json list = Json::array();
  for (size_t i = 0; i < mixers.size(); ++i)
    if (mixers[i] == kind) list.push_back(int64_t(i) + 1);
  return list;
}

Json nullable_int(int v) { return v > 0 ? Json(v) : Json(nullptr); }

}  // namespace

std::string config_to_k3_json(const ModelConfig& c) {
  Json t = Json::object();
  t["model_type"] = "kimi_linear";  // the K3 text config's own model_type, as the reference writes it
  t["source_model_type"] = c.source_type;
  t["weight_naming"] = config_detail::weight_naming_json_name(c.naming);
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.hidden;
  t["num_hidden_layers"] = c.num_layers;
  t["rms_norm_eps"] = json_float(c.rms_eps);
  t["initializer_range"] = json_float(c.init_std);
  t["tie_word_embeddings"] = c.tie_embeddings;
  t["bos_token_id"] = c.bos_id;
  t["eos_token_id"] = c.eos_id;
  t["pad_token_id"] = c.pad_id;
  t["max_position_embeddings"] = c.max_context;
  t["hidden_act"] = c.activation == Activation::SiTU ? "situ" : "silu";
  t["activation_situ_beta"] = json_float(c.situ_beta1);
  t["activation_situ_linear_beta"] = json_float(c.situ_beta2);
  t["attn_res_block_size"] = c.residual == ResidualKind::AttnRes ? c.attn_res_block : 0;

  // Token mixers: KDA settings and the (1-indexed) layer lists.
  Json lac = Json::object();
  lac["kda_layers"] = one_based_layers(c.mixers, MixerKind::KDA);
  lac["full_attn_layers"] = one_based_layers(c.mixers, MixerKind::MLA);
  lac["num_heads"] = c.kda.num_heads;
  lac["head_dim"] = c.kda.head_dim;
  lac["short_conv_kernel_size"] = c.kda.conv_kernel;
  lac["use_full_rank_gate"] = c.kda.full_rank_output_gate;
  // Presence of gate_lower_bound is what selects the safe gate (as in the K3 reference).
  if (c.kda.gate == KdaGateKind::Safe) lac["gate_lower_bound"] = json_float(c.kda.gate_lower_bound);
  t["linear_attn_config"] = lac;

  // MLA.
  t["num_attention_heads"] = c.mla.num_heads;
  t["q_lora_rank"] = nullable_int(c.mla.q_lora_rank);
  t["kv_lora_rank"] = c.mla.kv_lora_rank;
  t["qk_nope_head_dim"] = c.mla.qk_nope_dim;
  t["qk_rope_head_dim"] = c.mla.qk_rope_dim;
  t["v_head_dim"] = c.mla.v_head_dim;
  t["mla_use_nope"] = !c.mla.use_rope;
  t["mla_use_output_gate"] = c.mla.output_gate;
  t["mla_latent_norm_eps"] = json_float(c.mla.latent_norm_eps);
  t["rope_theta"] = c.mla.rope_theta;
  if (c.mla.yarn.enabled) {
    const YarnConfig& y = c.mla.yarn;
    t["rope_scaling"] = {{"type", "yarn"},
                         {"factor", y.factor},
                         {"original_max_position_embeddings", y.original_max_position},
                         {"beta_fast", y.beta_fast},
                         {"beta_slow", y.beta_slow},
                         {"mscale", y.mscale},
                         {"mscale_all_dim", y.mscale_all_dim}};
  } else {
    t["rope_scaling"] = nullptr;
  }

  // Channel mixers: first_k_dense_replace when it describes the layout, else the explicit list.
  t["intermediate_size"] = c.dense_ffn;
  int leading_dense = 0;
  while (leading_dense < int(c.ffns.size()) && c.ffns[size_t(leading_dense)] == FfnKind::Dense) ++leading_dense;
  if (c.ffns == config_detail::ffn_kinds_from_first_k_dense(c.num_layers, c.moe.num_experts > 0,
                                                            leading_dense, 1)) {
    t["first_k_dense_replace"] = leading_dense;
    t["moe_layer_freq"] = 1;
  } else {
    Json kinds = Json::array();
    for (FfnKind k : c.ffns) kinds.push_back(k == FfnKind::MoE ? "sparse" : "dense");
    t["mlp_layer_types"] = kinds;
  }
  const MoeConfig& m = c.moe;
  t["num_experts"] = m.num_experts;
  t["num_experts_per_token"] = m.top_k;
  t["moe_intermediate_size"] = m.expert_ffn;
  t["num_shared_experts"] = m.num_shared;
  if (m.shared_ffn != m.expert_ffn) t["shared_expert_intermediate_size"] = m.shared_ffn;
  t["routed_expert_hidden_size"] = nullable_int(m.latent_dim);
  t["latent_moe_use_norm"] = m.latent_norm;
  t["num_expert_group"] = m.n_group;
  t["topk_group"] = m.topk_group;
  t["moe_renormalize"] = m.renormalize;
  t["routed_scaling_factor"] = json_float(m.routed_scaling);
  t["router_initializer_range"] = json_float(m.router_init_std);
  t["moe_router_activation_func"] = "sigmoid";

  Json top = Json::object();
  top["model_type"] = "kimi_k3";
  top["text_config"] = t;
  return top.dump(2) + "\n";
}

}  // namespace dm
