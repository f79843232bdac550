// ModelConfig: the one in-memory description of a model of this family, read from any of the
// supported config.json dialects and written back in the K3 schema (our own format).
//
// Dialects read:
//   - "kimi_linear" with HF transformers field names (layer_types, mlp_layer_types,
//     linear_num_heads, linear_head_dim, linear_conv_kernel_dim, num_experts,
//     num_experts_per_token, num_shared_experts, moe_renormalize, ...)
//   - "kimi_linear" as released (linear_attn_config{kda_layers, full_attn_layers (1-indexed),
//     num_heads, head_dim, short_conv_kernel_size}, first_k_dense_replace, ...)
//   - "deepseek_v3" (n_routed_experts, n_group, topk_group, rope_interleave, rope_scaling/YaRN)
//   - "kimi_k3": a top-level config whose "text_config" is the K3 text schema
//     (linear_attn_config incl. gate_lower_bound/use_full_rank_gate, attn_res_block_size,
//     activation_situ_beta, activation_situ_linear_beta, routed_expert_hidden_size,
//     latent_moe_use_norm, mla_use_nope, mla_use_output_gate, ...). Also accepted bare.
// Unknown fields are errors unless they are in the dialect's list of known-but-ignored fields
// (e.g. "dtype", "id2label", "use_cache"); inconsistent values are errors naming the field and
// the file ("<file>: field 'text_config.num_experts_per_token': ...", "<file>: unknown field
// 'x'"). Duplicated keys are errors too.
//
// Written (config_to_k3_json): {"model_type": "kimi_k3", "text_config": {...}} where text_config
// is the K3 reference's text schema plus our own fields that make every ModelConfig field
// round-trip: source_model_type, weight_naming ("kimi_linear" | "deepseek_v3" | "k3"),
// mla_latent_norm_eps, router_initializer_range, shared_expert_intermediate_size (only when it
// differs from moe_intermediate_size) and mlp_layer_types (only when first_k_dense_replace
// cannot express the dense/MoE layout). Implementation: config_read*.cpp, config_write.cpp,
// config.cpp (validation).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dm {

enum class MixerKind : uint8_t { KDA, MLA };
enum class FfnKind : uint8_t { Dense, MoE };
enum class Activation : uint8_t { SwiGLU, SiTU };
enum class KdaGateKind : uint8_t { Softplus, Safe };
enum class ResidualKind : uint8_t { Plain, AttnRes };
// Which checkpoint tensor-name table the weights use (see model/weight_names.h).
enum class WeightNaming : uint8_t { KimiLinear, DeepseekV3, K3 };

struct KdaConfig {
  int num_heads = 0;
  int head_dim = 0;          // K = V
  int conv_kernel = 4;
  KdaGateKind gate = KdaGateKind::Softplus;
  float gate_lower_bound = -5.0f;  // safe gate only
  bool full_rank_output_gate = false;  // g_proj [H*K, d] instead of g_a/g_b low rank (rank = K)
  bool operator==(const KdaConfig&) const = default;
};

struct YarnConfig {
  bool enabled = false;
  double factor = 1.0;
  double original_max_position = 4096;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;
  bool operator==(const YarnConfig&) const = default;
};

struct MlaConfig {
  int num_heads = 0;
  int q_lora_rank = 0;       // 0 = no q LoRA (W_q x directly)
  int kv_lora_rank = 0;
  int qk_nope_dim = 0;
  int qk_rope_dim = 0;
  int v_head_dim = 0;
  bool use_rope = false;     // NoPE default; DeepSeek-V3 = true with interleaved pairs
  bool output_gate = false;  // K3: o_h ⊙ sigmoid(W_gate x)
  double rope_theta = 10000.0;
  YarnConfig yarn;
  float latent_norm_eps = 1e-6f;  // q_a / kv_a RMSNorms
  bool operator==(const MlaConfig&) const = default;
};

struct MoeConfig {
  int num_experts = 0;
  int top_k = 0;
  int expert_ffn = 0;        // routed expert intermediate size
  int num_shared = 0;
  int shared_ffn = 0;        // per shared expert intermediate size (shared experts are stored fused)
  int latent_dim = 0;        // 0 = no latent projection (Kimi-Linear/DeepSeek)
  bool latent_norm = false;  // RMSNorm on the combined latent output
  int n_group = 1, topk_group = 1;
  bool renormalize = true;
  float routed_scaling = 1.0f;
  float router_init_std = 0.006f;
  bool operator==(const MoeConfig&) const = default;
};

struct ModelConfig {
  std::string source_type;   // "kimi_linear", "deepseek_v3", "kimi_k3"
  WeightNaming naming = WeightNaming::K3;
  int vocab_size = 0;
  int hidden = 0;
  int num_layers = 0;
  std::vector<MixerKind> mixers;   // [num_layers]
  std::vector<FfnKind> ffns;       // [num_layers]
  int dense_ffn = 0;               // intermediate size of dense FFN layers
  Activation activation = Activation::SwiGLU;
  float situ_beta1 = 4.0f, situ_beta2 = 25.0f;
  float rms_eps = 1e-5f;
  ResidualKind residual = ResidualKind::Plain;
  int attn_res_block = 0;          // layers per AttnRes block
  int64_t max_context = 1 << 20;
  bool tie_embeddings = false;
  int bos_id = 1, eos_id = 2, pad_id = 0;
  float init_std = 0.02f;
  KdaConfig kda;
  MlaConfig mla;
  MoeConfig moe;

  int num_kda_layers() const;
  int num_mla_layers() const;
  int num_moe_layers() const;
  // Field-by-field equality (round-trip tests: parse_config(config_to_k3_json(c)) == c).
  bool operator==(const ModelConfig&) const = default;
};

// Reads config.json (path to the file or to its directory). Throws dm::Error naming file+field.
ModelConfig load_config(const std::string& path);
// Parses JSON text; `origin` names the source in errors. The result is validated.
ModelConfig parse_config(const std::string& json_text, const std::string& origin);
// Serialises in the K3 schema (top-level kimi_k3 with text_config); parse_config(dump) == cfg.
std::string config_to_k3_json(const ModelConfig& cfg);
// Checks internal consistency (sizes > 0, layer lists of length num_layers, top_k ≤ experts,
// groups divide experts, ...). Throws naming the field.
void validate_config(const ModelConfig& cfg, const std::string& origin);

}  // namespace dm
