// Reader of the Kimi family of config.json dialects. They share one text schema:
//   - kimi_linear as HF transformers writes it: layer_types, mlp_layer_types, linear_num_heads,
//     linear_head_dim, linear_conv_kernel_dim;
//   - kimi_linear as released: linear_attn_config{kda_layers, full_attn_layers (1-indexed),
//     num_heads, head_dim, short_conv_kernel_size}, first_k_dense_replace, moe_layer_freq;
//   - the K3 text config (the text_config of a kimi_k3 config, itself model_type kimi_linear):
//     the released form plus gate_lower_bound, use_full_rank_gate, attn_res_block_size,
//     activation_situ_*, routed_expert_hidden_size, latent_moe_use_norm, mla_use_output_gate;
//   - the K3 schema we write (config_write.cpp): the K3 text config plus a few fields of our own
//     (source_model_type, weight_naming, mla_latent_norm_eps, router_initializer_range,
//     shared_expert_intermediate_size) so that every ModelConfig field round-trips.
// Both spellings of a setting may appear together only if they agree.
#include "core/error.h"
#include "io/config.h"
#include "io/config_json_fields.h"

namespace dm::config_detail {
namespace {

// SPEC §1 default when linear_attn_config names no layers: MLA at every 4th layer (1-based) and
// at the last, KDA elsewhere.
std::vector<MixerKind> default_mixers(int num_layers) {
  std::vector<MixerKind> m(size_t(num_layers), MixerKind::KDA);
  for (int i = 0; i < num_layers; ++i)
    if ((i + 1) % 4 == 0 || i + 1 == num_layers) m[size_t(i)] = MixerKind::MLA;
  return m;
}

// kda_layers / full_attn_layers (1-indexed) → per-layer kinds; together they must cover 1..L
// exactly once. nullopt when neither list is given.
std::optional<std::vector<MixerKind>> mixers_from_layer_lists(JsonFields& lac, int num_layers) {
  auto kda = lac.opt_int_list("kda_layers", 1, num_layers, size_t(kMaxLayers));
  auto full = lac.opt_int_list("full_attn_layers", 1, num_layers, size_t(kMaxLayers));
  if (!kda && !full) return std::nullopt;
  if (!kda) throw Error(str_cat(lac.origin(), ": missing required field '", lac.path("kda_layers"),
                                "' (full_attn_layers is given)"));
  if (!full) throw Error(str_cat(lac.origin(), ": missing required field '",
                                 lac.path("full_attn_layers"), "' (kda_layers is given)"));
  std::vector<int> seen(size_t(num_layers), 0);  // 0 = unassigned, 1 = KDA, 2 = MLA
  std::vector<MixerKind> mixers(size_t(num_layers), MixerKind::KDA);
  auto assign = [&](const std::vector<int64_t>& layers, const char* key, int kind) {
    for (int64_t one_based : layers) {
      int& s = seen[size_t(one_based - 1)];
      if (s != 0)
        lac.fail(key, str_cat("layer ", one_based, " is listed twice (layers are 1-indexed)"));
      s = kind;
      mixers[size_t(one_based - 1)] = kind == 1 ? MixerKind::KDA : MixerKind::MLA;
    }
  };
  assign(*kda, "kda_layers", 1);
  assign(*full, "full_attn_layers", 2);
  for (int i = 0; i < num_layers; ++i)
    if (seen[size_t(i)] == 0)
      lac.fail("full_attn_layers",
               str_cat("layer ", i + 1, " is in neither kda_layers nor full_attn_layers (they must "
                       "cover 1..", num_layers, ")"));
  return mixers;
}

// Reads a setting that has an HF-style spelling at top level and a released spelling inside
// linear_attn_config; both may be given only if they agree.
std::optional<int64_t> read_kda_int(JsonFields& f, const char* hf_key, JsonFields* lac,
                                    const char* lac_key, int64_t lo, int64_t hi,
                                    std::string* name_used) {
  std::optional<int64_t> hf = f.opt_int(hf_key, lo, hi);
  std::optional<int64_t> rel = lac ? lac->opt_int(lac_key, lo, hi) : std::nullopt;
  if (hf && rel && *hf != *rel)
    f.fail(hf_key, str_cat(*hf, " disagrees with ", lac->path(lac_key), " = ", *rel));
  if (rel) *name_used = lac->path(lac_key);
  else if (hf) *name_used = f.path(hf_key);
  return rel ? rel : hf;
}

}  // namespace

ModelConfig read_kimi_family_config(JsonFields& f, bool declared_k3, ConfigFieldNames* names) {
  ModelConfig cfg;
  if (auto mt = f.opt_string("model_type")) {
    if (*mt == "kimi_k3") declared_k3 = true;
    else if (*mt != "kimi_linear")
      f.fail("model_type", str_cat("'", *mt, "' in a Kimi config (expected kimi_linear or kimi_k3)"));
  }
  read_common_fields(f, cfg, 1e-5f);
  read_hidden_act(f, cfg);
  const int L = cfg.num_layers;
  // ConfigFieldNames holds names relative to the config's top object (names->prefix is added).
  auto relative = [&](const std::string& full) { return full.substr(names->prefix.size()); };

  // ---- token mixers: layer_types (HF) and/or linear_attn_config (released / K3)
  std::optional<std::vector<MixerKind>> mixers;
  if (auto lt = f.opt_string_list("layer_types", size_t(kMaxLayers))) {
    if (int64_t(lt->size()) != L)
      f.fail("layer_types", str_cat("has ", lt->size(), " entries but num_hidden_layers = ", L));
    mixers.emplace();
    for (size_t i = 0; i < lt->size(); ++i) {
      if ((*lt)[i] == "linear_attention") mixers->push_back(MixerKind::KDA);
      else if ((*lt)[i] == "full_attention") mixers->push_back(MixerKind::MLA);
      else f.fail("layer_types", str_cat("entry ", i, ": '", (*lt)[i],
                                         "' (expected linear_attention or full_attention)"));
    }
  }
  const Json* lac_json = f.opt_object("linear_attn_config");
  std::optional<JsonFields> lac;
  if (lac_json) lac.emplace(*lac_json, f.origin(), f.path("linear_attn_config."));
  if (lac) {
    if (auto from_lists = mixers_from_layer_lists(*lac, L)) {
      if (mixers && *mixers != *from_lists)
        f.fail("layer_types", "disagrees with linear_attn_config.kda_layers/full_attn_layers");
      mixers = from_lists;
    } else if (!mixers) {
      mixers = default_mixers(L);
    }
  }
  // Without either, every layer is full attention (the released config class's reading of an
  // absent linear_attn_config).
  cfg.mixers = mixers ? *mixers : std::vector<MixerKind>(size_t(L), MixerKind::MLA);
  const bool need_kda = cfg.num_kda_layers() > 0;

  JsonFields* lacp = lac ? &*lac : nullptr;
  std::string used;
  auto kda_int = [&](const char* hf_key, const char* lac_key, int64_t lo, int64_t hi,
                     std::string* name_field) -> std::optional<int64_t> {
    used.clear();
    auto v = read_kda_int(f, hf_key, lacp, lac_key, lo, hi, &used);
    if (!used.empty()) *name_field = relative(used);
    return v;
  };
  auto kda_required = [&](std::optional<int64_t> v, const char* lac_key) -> int {
    if (v) return int(*v);
    if (need_kda)
      throw Error(str_cat(f.origin(), ": missing required field '", f.path("linear_attn_config."),
                          lac_key, "' (there are KDA layers)"));
    return 0;
  };
  cfg.kda.num_heads = kda_required(kda_int("linear_num_heads", "num_heads", 0, kMaxDim,
                                           &names->kda_heads), "num_heads");
  cfg.kda.head_dim = kda_required(kda_int("linear_head_dim", "head_dim", 0, kMaxDim,
                                          &names->kda_head_dim), "head_dim");
  if (auto conv = kda_int("linear_conv_kernel_dim", "short_conv_kernel_size", 0, 64, &names->kda_conv))
    cfg.kda.conv_kernel = int(*conv);
  if (lac) {
    if (auto lb = lac->opt_float("gate_lower_bound")) {
      cfg.kda.gate = KdaGateKind::Safe;
      cfg.kda.gate_lower_bound = *lb;
    }
    cfg.kda.full_rank_output_gate = lac->opt_bool("use_full_rank_gate").value_or(false);
    lac->finish();
  }

  // ---- channel mixers: mlp_layer_types (HF) and/or first_k_dense_replace + moe_layer_freq
  const int64_t num_experts = f.opt_int("num_experts", 0, kMaxExperts).value_or(0);
  const std::optional<int64_t> first_k = f.opt_int("first_k_dense_replace", 0, kMaxLayers);
  const std::optional<int64_t> freq = f.opt_int("moe_layer_freq", 1, kMaxLayers);
  if (auto mt = f.opt_string_list("mlp_layer_types", size_t(kMaxLayers))) {
    if (int64_t(mt->size()) != L)
      f.fail("mlp_layer_types", str_cat("has ", mt->size(), " entries but num_hidden_layers = ", L));
    for (size_t i = 0; i < mt->size(); ++i) {
      if ((*mt)[i] == "dense") cfg.ffns.push_back(FfnKind::Dense);
      else if ((*mt)[i] == "sparse") cfg.ffns.push_back(FfnKind::MoE);
      else f.fail("mlp_layer_types", str_cat("entry ", i, ": '", (*mt)[i], "' (expected dense or sparse)"));
    }
    if ((first_k || freq) &&
        cfg.ffns != ffn_kinds_from_first_k_dense(L, true, first_k.value_or(0), freq.value_or(1)))
      f.fail("mlp_layer_types", "disagrees with first_k_dense_replace/moe_layer_freq");
  } else {
    cfg.ffns = ffn_kinds_from_first_k_dense(L, num_experts > 0, first_k.value_or(0), freq.value_or(1));
  }
  const bool need_moe = cfg.num_moe_layers() > 0;
  const bool need_dense = cfg.num_moe_layers() < L;
  cfg.dense_ffn = int(need_dense ? f.req_int("intermediate_size", 0, kMaxDim)
                                 : f.opt_int("intermediate_size", 0, kMaxDim).value_or(0));

  MoeConfig& moe = cfg.moe;
  auto moe_int = [&](const char* key, int64_t hi) {
    return int(need_moe ? f.req_int(key, 0, hi) : f.opt_int(key, 0, hi).value_or(0));
  };
  moe.num_experts = int(need_moe ? f.req_int("num_experts", 0, kMaxExperts) : num_experts);
  moe.top_k = moe_int("num_experts_per_token", kMaxExperts);
  moe.expert_ffn = moe_int("moe_intermediate_size", kMaxDim);
  moe.num_shared = int(f.opt_int("num_shared_experts", 0, kMaxExperts).value_or(0));
  // The K3 schema sizes shared experts with moe_intermediate_size each (the checkpoint fuses
  // them into one FFN of num_shared × that width); our own field overrides it.
  moe.shared_ffn = int(f.opt_int("shared_expert_intermediate_size", 0, kMaxDim).value_or(moe.expert_ffn));
  moe.latent_dim = int(f.opt_int("routed_expert_hidden_size", 0, kMaxDim).value_or(0));
  moe.latent_norm = f.opt_bool("latent_moe_use_norm").value_or(false);
  moe.n_group = int(f.opt_int("num_expert_group", 0, kMaxExperts).value_or(1));
  moe.topk_group = int(f.opt_int("topk_group", 0, kMaxExperts).value_or(1));
  moe.renormalize = f.opt_bool("moe_renormalize").value_or(true);
  moe.router_init_std = f.opt_float("router_initializer_range").value_or(0.006f);
  if (auto fn = f.opt_string("moe_router_activation_func"); fn && *fn != "sigmoid")
    f.fail("moe_router_activation_func", str_cat("'", *fn, "' is not supported (only sigmoid)"));

  // ---- MLA
  read_mla_fields(f, cfg, cfg.num_mla_layers() > 0);
  // Kimi-Linear's MLA is NoPE, and its HF-style config has no mla_use_nope field at all, so an
  // absent field means NoPE (the released config class would default to false; its released
  // config.json always says true).
  cfg.mla.use_rope = !f.opt_bool("mla_use_nope").value_or(true);
  cfg.mla.output_gate = f.opt_bool("mla_use_output_gate").value_or(false);
  // The q_a / kv_a RMSNorms of the reference checkpoints use 1e-6 whatever rms_norm_eps says.
  cfg.mla.latent_norm_eps = f.opt_float("mla_latent_norm_eps").value_or(1e-6f);

  // ---- K3 features
  cfg.attn_res_block = int(f.opt_int("attn_res_block_size", 0, kMaxLayers).value_or(0));
  cfg.residual = cfg.attn_res_block > 0 ? ResidualKind::AttnRes : ResidualKind::Plain;
  cfg.situ_beta1 = f.opt_float("activation_situ_beta").value_or(4.0f);
  cfg.situ_beta2 = f.opt_float("activation_situ_linear_beta").value_or(25.0f);

  // ---- context length: Kimi-Linear calls it model_max_length, the K3 class max_position_embeddings.
  if (auto n = f.opt_int("model_max_length", 1, kMaxContext)) {
    cfg.max_context = *n;
    names->max_context = "model_max_length";
  } else if (auto n2 = f.opt_int("max_position_embeddings", 1, kMaxContext)) {
    cfg.max_context = *n2;
  }

  // ---- which model this is, and so which checkpoint tensor names it uses
  const bool k3_features = cfg.residual == ResidualKind::AttnRes ||
                           cfg.activation == Activation::SiTU || moe.latent_dim > 0 ||
                           moe.latent_norm || cfg.mla.output_gate ||
                           cfg.kda.gate == KdaGateKind::Safe || cfg.kda.full_rank_output_gate;
  cfg.source_type = (declared_k3 || k3_features) ? "kimi_k3" : "kimi_linear";
  if (auto st = f.opt_string("source_model_type")) {
    if (*st != "kimi_linear" && *st != "kimi_k3" && *st != "deepseek_v3")
      f.fail("source_model_type", str_cat("'", *st, "' (expected kimi_linear, kimi_k3 or deepseek_v3)"));
    cfg.source_type = *st;
  }
  cfg.naming = cfg.source_type == "kimi_linear"   ? WeightNaming::KimiLinear
               : cfg.source_type == "deepseek_v3" ? WeightNaming::DeepseekV3
                                                  : WeightNaming::K3;
  if (auto wn = f.opt_string("weight_naming"); wn && !weight_naming_from_json_name(*wn, &cfg.naming))
    f.fail("weight_naming", str_cat("'", *wn, "' (expected kimi_linear, deepseek_v3 or k3)"));

  // Valid in this dialect, no effect on the network we build: kernel selection switches, the
  // router's selection method (always bias-corrected sigmoid top-k here), per-head dims that
  // MLA derives from the fields above.
  f.ignore({"kda_mode", "kda_unpad_inputs", "kda_use_fused_gate", "kda_use_qk_l2norm_in_kernel",
            "topk_method", "use_grouped_topk", "head_dim", "num_key_value_heads"});
  f.ignore(hf_generic_ignored_keys());
  f.finish();
  return cfg;
}

}  // namespace dm::config_detail
