// Internal to the config reader/writer (src/io/config*.cpp); not a public interface.
//
// JsonFields gives typed, origin-aware access to one JSON object of a config file. Every access
// marks the key as known; finish() then rejects any key that nobody read or declared ignorable,
// so a typo in a config is an error instead of a silently defaulted field. JSON null counts as
// "absent" for optional fields because HF configs write null for unset options (q_lora_rank,
// rope_scaling, problem_type, ...).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "io/config.h"

namespace dm::config_detail {

using Json = nlohmann::json;

// Upper bounds on what a config may ask for. No real model comes near them; they keep a
// corrupt or hostile config from requesting absurd allocations (vectors of num_layers) and keep
// every parameter-count product representable.
constexpr int64_t kMaxLayers = 1 << 16;
constexpr int64_t kMaxDim = 1 << 24;           // widths, ranks, vocabulary, heads
constexpr int64_t kMaxExperts = 1 << 20;
constexpr int64_t kMaxContext = int64_t(1) << 40;

class JsonFields {
 public:
  // `object` must outlive this reader. `prefix` is prepended to keys in messages
  // ("text_config." → "field 'text_config.num_experts'").
  JsonFields(const Json& object, std::string origin, std::string prefix);

  const std::string& origin() const { return origin_; }
  std::string path(const std::string& key) const { return prefix_ + key; }
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;

  // True when the key exists with a non-null value. Marks it known.
  bool present(const std::string& key);
  // Raw value or nullptr when absent/null. Marks it known.
  const Json* raw(const std::string& key);

  std::optional<int64_t> opt_int(const std::string& key, int64_t lo, int64_t hi);
  int64_t req_int(const std::string& key, int64_t lo, int64_t hi);
  std::optional<double> opt_double(const std::string& key);
  std::optional<float> opt_float(const std::string& key);  // also range-checked for float
  std::optional<bool> opt_bool(const std::string& key);
  std::optional<std::string> opt_string(const std::string& key);
  std::optional<std::vector<int64_t>> opt_int_list(const std::string& key, int64_t lo, int64_t hi,
                                                   size_t max_len);
  std::optional<std::vector<std::string>> opt_string_list(const std::string& key, size_t max_len);
  // Object value or nullptr when absent/null; any other type is an error.
  const Json* opt_object(const std::string& key);
  // A token id: an integer, or a list of integers (the first is used: several configs list
  // alternative end-of-sequence ids).
  std::optional<int> opt_token_id(const std::string& key);

  // Keys that are valid in this dialect but do not change the model we build.
  void ignore(std::initializer_list<const char*> keys);
  void ignore(const std::vector<std::string>& keys);
  // Throws "unknown field" for the first key that was neither read nor ignored.
  void finish() const;

 private:
  const Json& object_;
  std::string origin_, prefix_;
  std::set<std::string> known_;
};

// Keys that HF's PretrainedConfig.to_dict() may emit for any model and that never affect the
// network (generation defaults, bookkeeping). Shared by every dialect.
const std::vector<std::string>& hf_generic_ignored_keys();

// JSON names of the fields whose spelling differs between dialects, so that consistency errors
// found after parsing still name the field the user actually wrote.
struct ConfigFieldNames {
  std::string num_experts = "num_experts";
  std::string top_k = "num_experts_per_token";
  std::string num_shared = "num_shared_experts";
  std::string n_group = "num_expert_group";
  std::string topk_group = "topk_group";
  std::string kda_heads = "linear_attn_config.num_heads";
  std::string kda_head_dim = "linear_attn_config.head_dim";
  std::string kda_conv = "linear_attn_config.short_conv_kernel_size";
  std::string gate_lower_bound = "linear_attn_config.gate_lower_bound";
  std::string max_context = "max_position_embeddings";
  std::string prefix;  // "text_config." for the wrapped K3 form
};
void validate_config_named(const ModelConfig& cfg, const std::string& origin,
                           const ConfigFieldNames& names);

// Spellings used in the K3 schema we write (and read back).
const char* weight_naming_json_name(WeightNaming n);
bool weight_naming_from_json_name(const std::string& s, WeightNaming* out);

// Dialect readers (config_read_kimi.cpp, config_read_deepseek.cpp). `declared_k3`: the config
// says it is K3 (top-level kimi_k3) even if no K3-only feature is switched on. Each reader calls
// finish() on `f`; `names` receives the spellings it read (for validation messages).
ModelConfig read_kimi_family_config(JsonFields& f, bool declared_k3, ConfigFieldNames* names);
ModelConfig read_deepseek_v3_config(JsonFields& f, ConfigFieldNames* names);

// Pieces shared by the dialect readers (config_read.cpp).
// vocab_size, hidden_size, num_hidden_layers, rms_norm_eps, initializer_range,
// tie_word_embeddings, bos/eos/pad ids, intermediate_size, routed_scaling_factor.
void read_common_fields(JsonFields& f, ModelConfig& cfg, float default_rms_eps);
// num_attention_heads, q_lora_rank, kv_lora_rank, qk_{nope,rope}_head_dim, v_head_dim,
// qk_head_dim (checked), rope_theta / rope_parameters / rope_scaling (YaRN).
// `need_mla` makes the dimension fields required.
void read_mla_fields(JsonFields& f, ModelConfig& cfg, bool need_mla);
// hidden_act → Activation ("silu" = SwiGLU, "situ" = SiTU-GLU).
void read_hidden_act(JsonFields& f, ModelConfig& cfg);
// DeepSeek/Kimi rule: layer i is MoE iff experts exist, i ≥ first_k_dense and i % freq == 0.
std::vector<FfnKind> ffn_kinds_from_first_k_dense(int num_layers, bool have_experts,
                                                  int64_t first_k_dense, int64_t moe_layer_freq);

}  // namespace dm::config_detail
