// Config reading: JSON parsing with duplicate-key detection, the typed field reader, dialect
// dispatch (kimi_k3 wrapper / kimi_linear / deepseek_v3) and the fields every dialect shares.
// The dialect-specific readers live in config_read_kimi.cpp and config_read_deepseek.cpp.
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <sys/stat.h>

#include "core/error.h"
#include "io/config.h"
#include "io/config_json_fields.h"

namespace dm::config_detail {

// ---------------------------------------------------------------------------------------------
// JsonFields

JsonFields::JsonFields(const Json& object, std::string origin, std::string prefix)
    : object_(object), origin_(std::move(origin)), prefix_(std::move(prefix)) {}

void JsonFields::fail(const std::string& key, const std::string& message) const {
  throw Error(str_cat(origin_, ": field '", path(key), "': ", message));
}

bool JsonFields::present(const std::string& key) { return raw(key) != nullptr; }

const Json* JsonFields::raw(const std::string& key) {
  known_.insert(key);
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

static std::string got_type(const Json& v) { return str_cat("got ", v.type_name()); }

std::optional<int64_t> JsonFields::opt_int(const std::string& key, int64_t lo, int64_t hi) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(key, str_cat("value ", u, " is out of range [", lo, ", ", hi, "]"));
    x = int64_t(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else {
    fail(key, str_cat("expected an integer, ", got_type(*v)));
  }
  if (x < lo || x > hi) fail(key, str_cat("value ", x, " is out of range [", lo, ", ", hi, "]"));
  return x;
}

int64_t JsonFields::req_int(const std::string& key, int64_t lo, int64_t hi) {
  auto x = opt_int(key, lo, hi);
  if (!x) throw Error(str_cat(origin_, ": missing required field '", path(key), "'"));
  return *x;
}

std::optional<double> JsonFields::opt_double(const std::string& key) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  if (!v->is_number()) fail(key, str_cat("expected a number, ", got_type(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x)) fail(key, "value is not finite");
  return x;
}

std::optional<float> JsonFields::opt_float(const std::string& key) {
  auto x = opt_double(key);
  if (!x) return std::nullopt;
  // Converting an out-of-range double to float is undefined behaviour, so check first.
  if (std::fabs(*x) > double(std::numeric_limits<float>::max()))
    fail(key, str_cat("value ", *x, " does not fit in a 32-bit float"));
  return float(*x);
}

std::optional<bool> JsonFields::opt_bool(const std::string& key) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) fail(key, str_cat("expected true or false, ", got_type(*v)));
  return v->get<bool>();
}

std::optional<std::string> JsonFields::opt_string(const std::string& key) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail(key, str_cat("expected a string, ", got_type(*v)));
  return v->get<std::string>();
}

std::optional<std::vector<int64_t>> JsonFields::opt_int_list(const std::string& key, int64_t lo,
                                                             int64_t hi, size_t max_len) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  if (!v->is_array()) fail(key, str_cat("expected a list of integers, ", got_type(*v)));
  if (v->size() > max_len) fail(key, str_cat("has ", v->size(), " entries (at most ", max_len, ")"));
  std::vector<int64_t> out;
  out.reserve(v->size());
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& e = (*v)[i];
    if (!e.is_number_integer())
      fail(key, str_cat("entry ", i, ": expected an integer, ", got_type(e)));
    // is_number_integer() is true for unsigned too; anything above int64 max is out of range.
    const int64_t x = e.is_number_unsigned() && e.get<uint64_t>() > uint64_t(hi) ? hi + 1
                                                                                   : e.get<int64_t>();
    if (x < lo || x > hi)
      fail(key, str_cat("entry ", i, ": value ", e.dump(), " is out of range [", lo, ", ", hi, "]"));
    out.push_back(x);
  }
  return out;
}

std::optional<std::vector<std::string>> JsonFields::opt_string_list(const std::string& key,
                                                                    size_t max_len) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  if (!v->is_array()) fail(key, str_cat("expected a list of strings, ", got_type(*v)));
  if (v->size() > max_len) fail(key, str_cat("has ", v->size(), " entries (at most ", max_len, ")"));
  std::vector<std::string> out;
  out.reserve(v->size());
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& e = (*v)[i];
    if (!e.is_string()) fail(key, str_cat("entry ", i, ": expected a string, ", got_type(e)));
    out.push_back(e.get<std::string>());
  }
  return out;
}

const Json* JsonFields::opt_object(const std::string& key) {
  const Json* v = raw(key);
  if (v && !v->is_object()) fail(key, str_cat("expected an object, ", got_type(*v)));
  return v;
}

std::optional<int> JsonFields::opt_token_id(const std::string& key) {
  const Json* v = raw(key);
  if (!v) return std::nullopt;
  const Json* id = v;
  if (v->is_array()) {
    if (v->empty()) return std::nullopt;
    id = &(*v)[0];
  }
  if (!id->is_number_integer()) fail(key, str_cat("expected an integer token id, ", got_type(*id)));
  if (id->is_number_unsigned() ? id->get<uint64_t>() > uint64_t(kMaxDim)
                               : (id->get<int64_t>() < -1 || id->get<int64_t>() > kMaxDim))
    fail(key, str_cat("token id ", id->dump(), " is out of range [-1, ", kMaxDim, "]"));
  return int(id->get<int64_t>());
}

void JsonFields::ignore(std::initializer_list<const char*> keys) {
  for (const char* k : keys) known_.insert(k);
}
void JsonFields::ignore(const std::vector<std::string>& keys) {
  for (const auto& k : keys) known_.insert(k);
}

void JsonFields::finish() const {
  for (auto it = object_.begin(); it != object_.end(); ++it) {
    if (known_.count(it.key())) continue;
    // HF writes every flag of the output_* family (output_attentions, output_hidden_states,
    // output_router_logits, ...); none changes the network.
    if (it.key().rfind("output_", 0) == 0) continue;
    throw Error(str_cat(origin_, ": unknown field '", path(it.key()), "'"));
  }
}

const std::vector<std::string>& hf_generic_ignored_keys() {
  static const std::vector<std::string> keys = {
      // bookkeeping
      "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
      "_commit_hash", "_attn_implementation_autoset", "quantization_config",
      // classification / seq2seq heads we do not build
      "id2label", "label2id", "problem_type", "finetuning_task", "num_labels", "is_encoder_decoder",
      "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
      "decoder_start_token_id", "sep_token_id", "task_specific_params", "prefix", "tokenizer_class",
      // runtime switches
      "use_cache", "return_dict", "torchscript", "use_bfloat16", "pruned_heads",
      "chunk_size_feed_forward", "tf_legacy_loss", "attention_dropout", "pretraining_tp",
      // generation defaults (transformers 4.x to_dict() writes them into every config)
      "bad_words_ids", "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
      "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "forced_bos_token_id",
      "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
      "num_beam_groups", "num_beams", "num_return_sequences", "remove_invalid_values",
      "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "temperature", "top_k",
      "top_p", "typical_p"};
  return keys;
}

const char* weight_naming_json_name(WeightNaming n) {
  switch (n) {
    case WeightNaming::KimiLinear: return "kimi_linear";
    case WeightNaming::DeepseekV3: return "deepseek_v3";
    case WeightNaming::K3: return "k3";
  }
  return "k3";
}

bool weight_naming_from_json_name(const std::string& s, WeightNaming* out) {
  if (s == "kimi_linear") *out = WeightNaming::KimiLinear;
  else if (s == "deepseek_v3") *out = WeightNaming::DeepseekV3;
  else if (s == "k3") *out = WeightNaming::K3;
  else return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Fields shared by the dialects

void read_common_fields(JsonFields& f, ModelConfig& cfg, float default_rms_eps) {
  cfg.vocab_size = int(f.req_int("vocab_size", 1, kMaxDim));
  cfg.hidden = int(f.req_int("hidden_size", 1, kMaxDim));
  cfg.num_layers = int(f.req_int("num_hidden_layers", 1, kMaxLayers));
  cfg.rms_eps = f.opt_float("rms_norm_eps").value_or(default_rms_eps);
  cfg.init_std = f.opt_float("initializer_range").value_or(0.02f);
  cfg.tie_embeddings = f.opt_bool("tie_word_embeddings").value_or(false);
  if (auto v = f.opt_token_id("bos_token_id")) cfg.bos_id = *v;
  if (auto v = f.opt_token_id("eos_token_id")) cfg.eos_id = *v;
  if (auto v = f.opt_token_id("pad_token_id")) cfg.pad_id = *v;
  cfg.moe.routed_scaling = f.opt_float("routed_scaling_factor").value_or(1.0f);
  // Attention projections of this family carry no bias; a config asking for one describes a
  // network this engine does not build.
  if (f.opt_bool("attention_bias").value_or(false))
    f.fail("attention_bias", "true is not supported (MLA/KDA projections have no bias)");
  // Multi-token-prediction layers are not built; their weights, if present, are skipped.
  f.opt_int("num_nextn_predict_layers", 0, kMaxLayers);
}

void read_hidden_act(JsonFields& f, ModelConfig& cfg) {
  const std::string act = f.opt_string("hidden_act").value_or("silu");
  if (act == "silu" || act == "swiglu") cfg.activation = Activation::SwiGLU;
  else if (act == "situ") cfg.activation = Activation::SiTU;
  else f.fail("hidden_act", str_cat("unsupported activation '", act, "' (expected silu or situ)"));
}

namespace {

// One rope description: rope_scaling (HF 4.x) or rope_parameters (HF 5.x) object.
struct RopeSpec {
  bool yarn = false;
  std::optional<double> theta;
  YarnConfig yarn_cfg;
};

RopeSpec read_rope_object(JsonFields& parent, const std::string& key, const Json& obj,
                          std::optional<int64_t> max_position) {
  JsonFields r(obj, parent.origin(), parent.path(key + "."));
  RopeSpec spec;
  std::optional<std::string> type = r.opt_string("rope_type");
  if (auto t2 = r.opt_string("type")) {
    if (type && *type != *t2) r.fail("type", str_cat("'", *t2, "' disagrees with rope_type '", *type, "'"));
    type = t2;
  }
  spec.theta = r.opt_double("rope_theta");
  const std::string t = type.value_or("default");
  if (t == "yarn") {
    spec.yarn = true;
    YarnConfig& y = spec.yarn_cfg;
    y.enabled = true;
    y.factor = r.opt_double("factor").value_or(1.0);
    // HF falls back to max_position_embeddings when the original length is not given.
    if (auto o = r.opt_double("original_max_position_embeddings")) y.original_max_position = *o;
    else if (max_position) y.original_max_position = double(*max_position);
    else r.fail("original_max_position_embeddings", "required for YaRN (no max_position_embeddings either)");
    y.beta_fast = r.opt_double("beta_fast").value_or(32.0);
    y.beta_slow = r.opt_double("beta_slow").value_or(1.0);
    y.mscale = r.opt_double("mscale").value_or(1.0);
    y.mscale_all_dim = r.opt_double("mscale_all_dim").value_or(0.0);
    // SPEC §1.2 YaRN rounds the correction range outward (floor/ceil), i.e. truncate = true.
    if (!r.opt_bool("truncate").value_or(true))
      r.fail("truncate", "false is not supported (the correction range is floor/ceil-rounded)");
  } else if (t != "default") {
    r.fail(type && r.present("rope_type") ? "rope_type" : "type",
           str_cat("unsupported rope type '", t, "' (expected default or yarn)"));
  }
  r.finish();
  return spec;
}

}  // namespace

void read_mla_fields(JsonFields& f, ModelConfig& cfg, bool need_mla) {
  MlaConfig& m = cfg.mla;
  auto dim = [&](const char* key) {
    return int(need_mla ? f.req_int(key, 0, kMaxDim) : f.opt_int(key, 0, kMaxDim).value_or(0));
  };
  m.num_heads = dim("num_attention_heads");
  m.q_lora_rank = int(f.opt_int("q_lora_rank", 0, kMaxDim).value_or(0));  // null = no q LoRA
  m.kv_lora_rank = dim("kv_lora_rank");
  m.qk_nope_dim = dim("qk_nope_head_dim");
  m.qk_rope_dim = dim("qk_rope_head_dim");
  m.v_head_dim = dim("v_head_dim");
  if (auto qk = f.opt_int("qk_head_dim", 0, 2 * kMaxDim); qk && *qk != m.qk_nope_dim + m.qk_rope_dim)
    f.fail("qk_head_dim", str_cat(*qk, " != qk_nope_head_dim + qk_rope_head_dim = ",
                                  m.qk_nope_dim + m.qk_rope_dim));

  // Rope: rope_theta at top level, and/or inside rope_parameters (HF 5) / rope_scaling (HF 4).
  const std::optional<int64_t> max_position = f.opt_int("max_position_embeddings", 1, kMaxContext);
  std::optional<double> theta = f.opt_double("rope_theta");
  std::optional<RopeSpec> yarn;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    const Json* obj = f.opt_object(key);
    if (!obj) continue;
    RopeSpec spec = read_rope_object(f, key, *obj, max_position);
    if (spec.theta) {
      if (theta && *theta != *spec.theta)
        f.fail(key, str_cat("rope_theta ", *spec.theta, " disagrees with rope_theta ", *theta));
      theta = spec.theta;
    }
    if (spec.yarn) {
      if (yarn && !(yarn->yarn_cfg == spec.yarn_cfg))
        f.fail(key, "YaRN parameters disagree between rope_parameters and rope_scaling");
      yarn = spec;
    }
  }
  m.rope_theta = theta.value_or(10000.0);
  if (yarn) m.yarn = yarn->yarn_cfg;
}

std::vector<FfnKind> ffn_kinds_from_first_k_dense(int num_layers, bool have_experts,
                                                  int64_t first_k_dense, int64_t moe_layer_freq) {
  std::vector<FfnKind> ffns(size_t(num_layers), FfnKind::Dense);
  for (int i = 0; i < num_layers; ++i)
    if (have_experts && i >= first_k_dense && i % moe_layer_freq == 0) ffns[size_t(i)] = FfnKind::MoE;
  return ffns;
}

namespace {

// nlohmann keeps the last of duplicated keys silently; a config that says a thing twice is
// ambiguous, so it is rejected. One key set per open object, tracked through the parse callback.
Json parse_json_rejecting_duplicates(const std::string& text, const std::string& origin) {
  std::vector<std::set<std::string>> open_objects;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second)
          throw Error(str_cat(origin, ": duplicate field '", parsed.get<std::string>(), "'"));
        break;
      default: break;
    }
    return true;
  };
  try {
    return Json::parse(text, callback);
  } catch (const Json::exception& e) {
    throw Error(str_cat(origin, ": invalid JSON: ", e.what()));
  }
}

ModelConfig parse_config_object(const Json& root, const std::string& origin) {
  if (!root.is_object())
    throw Error(str_cat(origin, ": a config must be a JSON object, got ", root.type_name()));
  JsonFields top(root, origin, "");
  const std::optional<std::string> model_type = top.opt_string("model_type");
  if (!model_type) throw Error(str_cat(origin, ": missing required field 'model_type'"));

  ConfigFieldNames names;
  ModelConfig cfg;
  if (*model_type == "kimi_k3" && top.present("text_config")) {
    // Multimodal wrapper: the language model is described by text_config; the vision tower
    // (vision_config) is built from its own settings elsewhere and ignored here.
    const Json* text = top.opt_object("text_config");
    top.ignore({"ignore_index", "media_placeholder_token_id", "vision_config", "bos_token_id",
                "eos_token_id", "pad_token_id", "use_cache"});
    top.ignore(hf_generic_ignored_keys());
    const std::optional<bool> top_tie = top.opt_bool("tie_word_embeddings");
    top.finish();
    JsonFields text_fields(*text, origin, "text_config.");
    names.prefix = "text_config.";
    cfg = read_kimi_family_config(text_fields, /*declared_k3=*/true, &names);
    if (top_tie && *top_tie != cfg.tie_embeddings)
      top.fail("tie_word_embeddings", "disagrees with text_config.tie_word_embeddings");
  } else if (*model_type == "kimi_k3" || *model_type == "kimi_linear") {
    cfg = read_kimi_family_config(top, *model_type == "kimi_k3", &names);
  } else if (*model_type == "deepseek_v3") {
    cfg = read_deepseek_v3_config(top, &names);
  } else {
    top.fail("model_type", str_cat("unsupported model type '", *model_type,
                                   "' (expected kimi_linear, deepseek_v3 or kimi_k3)"));
  }
  validate_config_named(cfg, origin, names);
  return cfg;
}

}  // namespace
}  // namespace dm::config_detail

namespace dm {

ModelConfig parse_config(const std::string& json_text, const std::string& origin) {
  using namespace config_detail;
  const Json root = parse_json_rejecting_duplicates(json_text, origin);
  try {
    return parse_config_object(root, origin);
  } catch (const Json::exception& e) {
    // Every type is checked before a value is read; this is a safety net, not a code path.
    throw Error(str_cat(origin, ": ", e.what()));
  }
}

ModelConfig load_config(const std::string& path) {
  std::string file = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/config.json";
  std::ifstream in(file, std::ios::binary);
  DM_CHECK(in.good(), file, ": cannot open config file");
  std::ostringstream ss;
  ss << in.rdbuf();
  DM_CHECK(!in.bad(), file, ": error reading config file");
  return parse_config(ss.str(), file);
}

}  // namespace dm
