// Config reading/writing (io/config.h) and parameter counting (model/params.h):
//   - the three golden configs parse to the fields their README/checkpoints describe;
//   - the released kimi_linear spelling gives the same ModelConfig as the HF spelling;
//   - parse(config_to_k3_json(c)) == c for the goldens and configs/*.json;
//   - count_params equals the element count of every golden checkpoint, and the K3 shape gives
//     ≈2.78T total / ≈104.2B active (SPEC §1.8);
//   - malformed configs fail with a dm::Error naming the file and the field.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "test_util.h"

namespace fs = std::filesystem;
using dm::ModelConfig;
using Json = nlohmann::json;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string golden_config_path(const std::string& model) {
  return dm::test::goldens_dir() + "/" + model + "/config.json";
}

std::string repo_config_path(const std::string& name) {
  return dm::test::source_dir() + "/configs/" + name + ".json";
}

// Field-by-field comparison with readable failure messages (operator== says only "differs").
void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.source_type, b.source_type);
  EXPECT_EQ(a.naming, b.naming);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.mixers, b.mixers);
  EXPECT_EQ(a.ffns, b.ffns);
  EXPECT_EQ(a.dense_ffn, b.dense_ffn);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.situ_beta1, b.situ_beta1);
  EXPECT_EQ(a.situ_beta2, b.situ_beta2);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.residual, b.residual);
  EXPECT_EQ(a.attn_res_block, b.attn_res_block);
  EXPECT_EQ(a.max_context, b.max_context);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.bos_id, b.bos_id);
  EXPECT_EQ(a.eos_id, b.eos_id);
  EXPECT_EQ(a.pad_id, b.pad_id);
  EXPECT_EQ(a.init_std, b.init_std);
  EXPECT_TRUE(a.kda == b.kda) << "kda differs";
  EXPECT_TRUE(a.mla == b.mla) << "mla differs";
  EXPECT_TRUE(a.mla.yarn == b.mla.yarn) << "mla.yarn differs";
  EXPECT_TRUE(a.moe == b.moe) << "moe differs";
  EXPECT_TRUE(a == b) << "ModelConfig differs";
}

// Expects parse_config(text) to throw a dm::Error whose message names `origin` and `field`.
void expect_config_error(const std::string& text, const std::string& field) {
  const std::string origin = "bad_config.json";
  try {
    dm::parse_config(text, origin);
    ADD_FAILURE() << "no error; expected one naming '" << field << "'";
  } catch (const dm::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(origin), std::string::npos) << msg;
    EXPECT_NE(msg.find(field), std::string::npos) << "expected '" << field << "' in: " << msg;
  }
}

Json golden_json(const std::string& model) { return Json::parse(read_text(golden_config_path(model))); }

#define SKIP_WITHOUT_GOLDENS() \
  if (!dm::test::goldens_available()) GTEST_SKIP() << "goldens not found"

}  // namespace

TEST(ConfigGolden, KimiLinearTinyFields) {
  SKIP_WITHOUT_GOLDENS();
  const ModelConfig c = dm::load_config(dm::test::goldens_dir() + "/kimi_linear_tiny");  // directory form
  EXPECT_EQ(c.source_type, "kimi_linear");
  EXPECT_EQ(c.naming, dm::WeightNaming::KimiLinear);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.num_layers, 4);
  using M = dm::MixerKind;
  using F = dm::FfnKind;
  EXPECT_EQ(c.mixers, (std::vector<M>{M::KDA, M::KDA, M::KDA, M::MLA}));
  EXPECT_EQ(c.ffns, (std::vector<F>{F::Dense, F::MoE, F::MoE, F::MoE}));
  EXPECT_EQ(c.dense_ffn, 256);
  EXPECT_EQ(c.activation, dm::Activation::SwiGLU);
  EXPECT_EQ(c.residual, dm::ResidualKind::Plain);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_EQ(c.max_context, 1048576);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
  EXPECT_EQ(c.pad_id, 0);
  EXPECT_EQ(c.kda.num_heads, 2);
  EXPECT_EQ(c.kda.head_dim, 32);
  EXPECT_EQ(c.kda.conv_kernel, 4);
  EXPECT_EQ(c.kda.gate, dm::KdaGateKind::Softplus);
  EXPECT_FALSE(c.kda.full_rank_output_gate);
  EXPECT_EQ(c.mla.num_heads, 4);
  EXPECT_EQ(c.mla.q_lora_rank, 0);
  EXPECT_EQ(c.mla.kv_lora_rank, 32);
  EXPECT_EQ(c.mla.qk_nope_dim, 32);
  EXPECT_EQ(c.mla.qk_rope_dim, 16);
  EXPECT_EQ(c.mla.v_head_dim, 32);
  EXPECT_FALSE(c.mla.use_rope);
  EXPECT_FALSE(c.mla.output_gate);
  EXPECT_FLOAT_EQ(c.mla.latent_norm_eps, 1e-6f);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.expert_ffn, 64);
  EXPECT_EQ(c.moe.num_shared, 1);
  EXPECT_EQ(c.moe.shared_ffn, 64);
  EXPECT_EQ(c.moe.latent_dim, 0);
  EXPECT_FALSE(c.moe.latent_norm);
  EXPECT_EQ(c.moe.n_group, 1);
  EXPECT_EQ(c.moe.topk_group, 1);
  EXPECT_TRUE(c.moe.renormalize);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling, 2.0f);
  EXPECT_EQ(c.num_kda_layers(), 3);
  EXPECT_EQ(c.num_mla_layers(), 1);
  EXPECT_EQ(c.num_moe_layers(), 3);
}

TEST(ConfigGolden, DeepseekV3TinyFields) {
  SKIP_WITHOUT_GOLDENS();
  const ModelConfig c = dm::load_config(golden_config_path("deepseek_v3_tiny"));
  EXPECT_EQ(c.source_type, "deepseek_v3");
  EXPECT_EQ(c.naming, dm::WeightNaming::DeepseekV3);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.mixers, std::vector<dm::MixerKind>(3, dm::MixerKind::MLA));
  EXPECT_EQ(c.ffns, (std::vector<dm::FfnKind>{dm::FfnKind::Dense, dm::FfnKind::MoE, dm::FfnKind::MoE}));
  EXPECT_EQ(c.dense_ffn, 256);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
  EXPECT_EQ(c.max_context, 4096);
  EXPECT_EQ(c.residual, dm::ResidualKind::Plain);
  EXPECT_EQ(c.activation, dm::Activation::SwiGLU);
  EXPECT_EQ(c.mla.num_heads, 4);
  EXPECT_EQ(c.mla.q_lora_rank, 48);
  EXPECT_EQ(c.mla.kv_lora_rank, 32);
  EXPECT_EQ(c.mla.qk_nope_dim, 32);
  EXPECT_EQ(c.mla.qk_rope_dim, 16);
  EXPECT_EQ(c.mla.v_head_dim, 32);
  EXPECT_TRUE(c.mla.use_rope);
  EXPECT_FALSE(c.mla.output_gate);
  EXPECT_DOUBLE_EQ(c.mla.rope_theta, 10000.0);
  EXPECT_FALSE(c.mla.yarn.enabled);
  EXPECT_EQ(c.moe.num_experts, 16);
  EXPECT_EQ(c.moe.top_k, 4);
  EXPECT_EQ(c.moe.expert_ffn, 64);
  EXPECT_EQ(c.moe.num_shared, 1);
  EXPECT_EQ(c.moe.shared_ffn, 64);
  EXPECT_EQ(c.moe.n_group, 4);
  EXPECT_EQ(c.moe.topk_group, 2);
  EXPECT_TRUE(c.moe.renormalize);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling, 2.5f);
  EXPECT_EQ(c.moe.latent_dim, 0);
}

TEST(ConfigGolden, KimiK3TinyFields) {
  SKIP_WITHOUT_GOLDENS();
  const ModelConfig c = dm::load_config(golden_config_path("kimi_k3_tiny"));
  EXPECT_EQ(c.source_type, "kimi_k3");
  EXPECT_EQ(c.naming, dm::WeightNaming::K3);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.num_layers, 8);
  using M = dm::MixerKind;
  EXPECT_EQ(c.mixers, (std::vector<M>{M::KDA, M::KDA, M::KDA, M::MLA, M::KDA, M::KDA, M::KDA, M::MLA}));
  std::vector<dm::FfnKind> ffns(8, dm::FfnKind::MoE);
  ffns[0] = dm::FfnKind::Dense;
  EXPECT_EQ(c.ffns, ffns);
  EXPECT_EQ(c.dense_ffn, 256);
  EXPECT_EQ(c.activation, dm::Activation::SiTU);
  EXPECT_FLOAT_EQ(c.situ_beta1, 4.0f);
  EXPECT_FLOAT_EQ(c.situ_beta2, 25.0f);
  EXPECT_EQ(c.residual, dm::ResidualKind::AttnRes);
  EXPECT_EQ(c.attn_res_block, 3);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_EQ(c.max_context, 4096);
  EXPECT_EQ(c.kda.num_heads, 4);
  EXPECT_EQ(c.kda.head_dim, 32);
  EXPECT_EQ(c.kda.gate, dm::KdaGateKind::Safe);
  EXPECT_FLOAT_EQ(c.kda.gate_lower_bound, -5.0f);
  EXPECT_TRUE(c.kda.full_rank_output_gate);
  EXPECT_EQ(c.mla.num_heads, 4);
  EXPECT_EQ(c.mla.q_lora_rank, 48);
  EXPECT_EQ(c.mla.kv_lora_rank, 32);
  EXPECT_EQ(c.mla.qk_nope_dim, 32);
  EXPECT_EQ(c.mla.qk_rope_dim, 16);
  EXPECT_EQ(c.mla.v_head_dim, 32);
  EXPECT_FALSE(c.mla.use_rope);
  EXPECT_TRUE(c.mla.output_gate);
  EXPECT_FLOAT_EQ(c.mla.latent_norm_eps, 1e-6f);  // README: MLA q_a/kv_a norms use 1e-6
  EXPECT_EQ(c.moe.num_experts, 16);
  EXPECT_EQ(c.moe.top_k, 4);
  EXPECT_EQ(c.moe.expert_ffn, 64);
  EXPECT_EQ(c.moe.num_shared, 2);
  EXPECT_EQ(c.moe.shared_ffn, 64);  // stored fused: shared_experts.*_proj [128, 128]
  EXPECT_EQ(c.moe.latent_dim, 64);
  EXPECT_TRUE(c.moe.latent_norm);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling, 2.5f);
  EXPECT_TRUE(c.moe.renormalize);
}

TEST(ConfigDialects, ReleasedKimiLinearEqualsHfStyle) {
  SKIP_WITHOUT_GOLDENS();
  const ModelConfig hf = dm::load_config(golden_config_path("kimi_linear_tiny"));
  // The same model as the released Kimi-Linear checkpoints spell it.
  Json j = golden_json("kimi_linear_tiny");
  for (const char* k : {"layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                        "linear_conv_kernel_dim"})
    j.erase(k);
  j["linear_attn_config"] = {{"kda_layers", {1, 2, 3}}, {"full_attn_layers", {4}}, {"num_heads", 2},
                             {"head_dim", 32}, {"short_conv_kernel_size", 4}};
  j["first_k_dense_replace"] = 1;
  j["moe_layer_freq"] = 1;
  j["mla_use_nope"] = true;
  j["num_nextn_predict_layers"] = 0;
  j["moe_router_activation_func"] = "sigmoid";
  j["use_grouped_topk"] = true;
  j["rope_theta"] = 10000.0;
  j["rope_scaling"] = nullptr;
  j["torch_dtype"] = "bfloat16";
  j["auto_map"] = {{"AutoConfig", "configuration_kimi.KimiLinearConfig"}};
  const ModelConfig released = dm::parse_config(j.dump(), "released_kimi_linear.json");
  expect_same_config(released, hf);

  // Both spellings at once are accepted when they agree.
  Json both = golden_json("kimi_linear_tiny");
  both["linear_attn_config"] = j["linear_attn_config"];
  both["first_k_dense_replace"] = 1;
  expect_same_config(dm::parse_config(both.dump(), "both.json"), hf);
}

TEST(ConfigDialects, BareK3TextConfigEqualsWrapped) {
  SKIP_WITHOUT_GOLDENS();
  const ModelConfig wrapped = dm::load_config(golden_config_path("kimi_k3_tiny"));
  const Json text = golden_json("kimi_k3_tiny")["text_config"];  // model_type kimi_linear + K3 fields
  expect_same_config(dm::parse_config(text.dump(), "bare_text_config.json"), wrapped);
  Json text_k3 = text;
  text_k3["model_type"] = "kimi_k3";
  expect_same_config(dm::parse_config(text_k3.dump(), "bare_k3.json"), wrapped);
}

TEST(ConfigRoundTrip, GoldensAndRepoConfigs) {
  std::vector<std::string> paths;
  if (dm::test::goldens_available())
    for (const char* m : {"kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"})
      paths.push_back(golden_config_path(m));
  for (const char* n : {"k3", "kimi_linear_48b", "demo", "test"}) paths.push_back(repo_config_path(n));
  for (const std::string& p : paths) {
    SCOPED_TRACE(p);
    const ModelConfig c = dm::load_config(p);
    const std::string dumped = dm::config_to_k3_json(c);
    const ModelConfig back = dm::parse_config(dumped, p + " (dumped)");
    expect_same_config(back, c);
    EXPECT_EQ(dm::config_to_k3_json(back), dumped);  // the dump is a fixed point
  }
}

TEST(ConfigRoundTrip, RepoConfigsAreInOurSchemaVerbatim) {
  // configs/*.json are written exactly as config_to_k3_json writes them (same fields, order).
  for (const char* n : {"k3", "kimi_linear_48b", "demo", "test"}) {
    SCOPED_TRACE(n);
    const std::string text = read_text(repo_config_path(n));
    EXPECT_EQ(Json::parse(dm::config_to_k3_json(dm::parse_config(text, n))), Json::parse(text));
  }
}

TEST(ConfigRoundTrip, UnusualSettings) {
  // YaRN, RoPE, tied embeddings, a non-prefix dense/MoE layout, separate shared width, groups.
  ModelConfig c = dm::parse_config(read_text(repo_config_path("test")), "test.json");
  c.mla.use_rope = true;
  c.mla.rope_theta = 50000.0;
  c.mla.yarn = {true, 40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  c.tie_embeddings = true;
  c.ffns = {dm::FfnKind::Dense, dm::FfnKind::MoE, dm::FfnKind::Dense, dm::FfnKind::MoE};
  c.moe.shared_ffn = 48;
  c.moe.n_group = 4;
  c.moe.topk_group = 2;
  c.kda.gate = dm::KdaGateKind::Softplus;
  c.kda.full_rank_output_gate = false;
  c.activation = dm::Activation::SwiGLU;
  c.residual = dm::ResidualKind::Plain;
  c.attn_res_block = 0;
  c.source_type = "deepseek_v3";
  c.naming = dm::WeightNaming::DeepseekV3;
  c.rms_eps = 1e-6f;
  c.moe.routed_scaling = 2.446f;
  dm::validate_config(c, "unusual");
  expect_same_config(dm::parse_config(dm::config_to_k3_json(c), "unusual.json"), c);
}

TEST(ConfigDialects, DeepseekYarnFromRopeScalingOrRopeParameters) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("deepseek_v3_tiny");
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                       {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  const ModelConfig a = dm::parse_config(j.dump(), "yarn_scaling.json");
  EXPECT_TRUE(a.mla.yarn.enabled);
  EXPECT_DOUBLE_EQ(a.mla.yarn.factor, 40.0);
  EXPECT_DOUBLE_EQ(a.mla.yarn.original_max_position, 4096.0);
  EXPECT_DOUBLE_EQ(a.mla.yarn.mscale_all_dim, 1.0);
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40},
                          {"original_max_position_embeddings", 4096}, {"beta_fast", 32},
                          {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  expect_same_config(dm::parse_config(j.dump(), "yarn_parameters.json"), a);
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the file and the field.

TEST(ConfigErrors, UnknownField) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("kimi_linear_tiny");
  j["num_experts_per_tok_typo"] = 2;
  expect_config_error(j.dump(), "unknown field 'num_experts_per_tok_typo'");
  Json k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["gate_upper_bound"] = 1.0;
  expect_config_error(k3.dump(), "text_config.linear_attn_config.gate_upper_bound");
  Json top = golden_json("kimi_k3_tiny");
  top["vision_tokens"] = 3;
  expect_config_error(top.dump(), "unknown field 'vision_tokens'");
  Json ds = golden_json("deepseek_v3_tiny");
  ds["rope_parameters"]["attention_factor"] = 1.0;
  expect_config_error(ds.dump(), "rope_parameters.attention_factor");
}

TEST(ConfigErrors, WrongType) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("kimi_linear_tiny");
  j["hidden_size"] = "128";
  expect_config_error(j.dump(), "hidden_size");
  j = golden_json("kimi_linear_tiny");
  j["moe_renormalize"] = 1;
  expect_config_error(j.dump(), "moe_renormalize");
  j = golden_json("kimi_linear_tiny");
  j["num_experts"] = 8.5;
  expect_config_error(j.dump(), "num_experts");
  Json k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"] = {1, 2};
  expect_config_error(k3.dump(), "text_config.linear_attn_config");
  k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["kda_layers"] = {1, "2", 3};
  expect_config_error(k3.dump(), "kda_layers");
  expect_config_error("[1, 2]", "JSON object");
}

TEST(ConfigErrors, InconsistentLayerLists) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("kimi_linear_tiny");
  j["layer_types"].erase(3);
  expect_config_error(j.dump(), "layer_types");
  j = golden_json("kimi_linear_tiny");
  j["num_hidden_layers"] = 5;
  expect_config_error(j.dump(), "layer_types");
  j = golden_json("kimi_linear_tiny");
  j["mlp_layer_types"][1] = "moe";
  expect_config_error(j.dump(), "mlp_layer_types");
  Json k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["full_attn_layers"] = {4};  // layer 8 in neither list
  expect_config_error(k3.dump(), "full_attn_layers");
  k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["full_attn_layers"] = {3, 4, 8};  // 3 twice
  expect_config_error(k3.dump(), "full_attn_layers");
  k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["kda_layers"] = {0, 1, 2, 3, 5, 6, 7};  // 0-indexed by mistake
  expect_config_error(k3.dump(), "kda_layers");
  Json both = golden_json("kimi_linear_tiny");
  both["linear_attn_config"] = {{"kda_layers", {1, 2, 4}}, {"full_attn_layers", {3}}};
  expect_config_error(both.dump(), "layer_types");
}

TEST(ConfigErrors, InconsistentMoe) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("kimi_linear_tiny");
  j["num_experts_per_token"] = 9;
  expect_config_error(j.dump(), "num_experts_per_token");
  Json ds = golden_json("deepseek_v3_tiny");
  ds["n_group"] = 3;
  expect_config_error(ds.dump(), "n_group");
  ds = golden_json("deepseek_v3_tiny");
  ds["topk_group"] = 5;
  expect_config_error(ds.dump(), "topk_group");
  ds = golden_json("deepseek_v3_tiny");
  ds["num_experts_per_tok"] = 16;  // more than the 2 selected groups of 4 hold
  expect_config_error(ds.dump(), "num_experts_per_tok");
  Json k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["moe_router_activation_func"] = "softmax";
  expect_config_error(k3.dump(), "moe_router_activation_func");
  k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"]["gate_lower_bound"] = 0.5;
  expect_config_error(k3.dump(), "gate_lower_bound");
  j = golden_json("kimi_linear_tiny");
  j["qk_head_dim"] = 40;
  expect_config_error(j.dump(), "qk_head_dim");
}

TEST(ConfigErrors, MissingField) {
  SKIP_WITHOUT_GOLDENS();
  Json j = golden_json("kimi_linear_tiny");
  j.erase("hidden_size");
  expect_config_error(j.dump(), "missing required field 'hidden_size'");
  j = golden_json("kimi_linear_tiny");
  j.erase("moe_intermediate_size");
  expect_config_error(j.dump(), "moe_intermediate_size");
  j = golden_json("kimi_linear_tiny");
  j.erase("linear_num_heads");
  expect_config_error(j.dump(), "num_heads");
  Json k3 = golden_json("kimi_k3_tiny");
  k3["text_config"].erase("kv_lora_rank");
  expect_config_error(k3.dump(), "text_config.kv_lora_rank");
  k3 = golden_json("kimi_k3_tiny");
  k3["text_config"]["linear_attn_config"].erase("kda_layers");
  expect_config_error(k3.dump(), "kda_layers");
  j = golden_json("kimi_linear_tiny");
  j.erase("model_type");
  expect_config_error(j.dump(), "model_type");
}

TEST(ConfigErrors, MalformedJsonDuplicatesAndFiles) {
  expect_config_error("{\"model_type\": \"kimi_linear\",", "invalid JSON");
  expect_config_error("{\"model_type\": \"kimi_linear\", \"model_type\": \"kimi_k3\"}", "duplicate field 'model_type'");
  expect_config_error("{\"model_type\": \"llama\"}", "model_type");
  try {
    dm::load_config("/nonexistent/dir/config.json");
    ADD_FAILURE() << "no error for a missing file";
  } catch (const dm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/config.json"), std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------------
// Parameter counts

// Sum of element counts of every tensor in a checkpoint, minus K3's zero padding of A_log.
static int64_t checkpoint_param_count(const std::string& dir, const ModelConfig& c) {
  const dm::SafetensorsReader r = dm::SafetensorsReader::open(dir);
  int64_t n = 0;
  for (const std::string& name : r.names()) {
    const int64_t numel = r.get(name).numel();
    const bool a_log = name.size() >= 5 && name.compare(name.size() - 5, 5, "A_log") == 0;
    n += a_log ? std::min<int64_t>(numel, c.kda.num_heads) : numel;
  }
  return n;
}

TEST(ParamsGolden, CountsEqualCheckpointTensors) {
  SKIP_WITHOUT_GOLDENS();
  for (const char* m : {"kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"}) {
    SCOPED_TRACE(m);
    const std::string dir = dm::test::goldens_dir() + "/" + m;
    const ModelConfig c = dm::load_config(dir);
    const dm::ParamCount pc = dm::count_params(c);
    EXPECT_EQ(pc.total, checkpoint_param_count(dir, c));
    int64_t sum_total = 0, sum_active = 0;
    ASSERT_EQ(pc.breakdown_total.size(), pc.breakdown_active.size());
    for (size_t i = 0; i < pc.breakdown_total.size(); ++i) {
      EXPECT_EQ(pc.breakdown_total[i].first, pc.breakdown_active[i].first);
      sum_total += pc.breakdown_total[i].second;
      sum_active += pc.breakdown_active[i].second;
    }
    EXPECT_EQ(sum_total, pc.total);
    EXPECT_EQ(sum_active, pc.active);
    EXPECT_LT(pc.active, pc.total);
  }
  // Hand-checked totals of the three checkpoints (python over the safetensors headers).
  EXPECT_EQ(dm::count_params(dm::load_config(golden_config_path("kimi_linear_tiny"))).total, 1091038);
  EXPECT_EQ(dm::count_params(dm::load_config(golden_config_path("deepseek_v3_tiny"))).total, 1208464);
  EXPECT_EQ(dm::count_params(dm::load_config(golden_config_path("kimi_k3_tiny"))).total, 2765584 - 6 * 124);
}

TEST(ParamsShapes, K3FullSizeMatchesSpec) {
  const ModelConfig c = dm::load_config(repo_config_path("k3"));
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.num_kda_layers(), 69);
  EXPECT_EQ(c.num_mla_layers(), 24);
  EXPECT_EQ(c.mixers[92], dm::MixerKind::MLA);
  EXPECT_EQ(c.mixers[3], dm::MixerKind::MLA);
  EXPECT_EQ(c.mixers[88], dm::MixerKind::KDA);
  const dm::ParamCount pc = dm::count_params(c);
  EXPECT_NEAR(double(pc.total), 2.78e12, 0.01 * 2.78e12);
  EXPECT_NEAR(double(pc.active), 104.2e9, 0.01 * 104.2e9);
  EXPECT_EQ(dm::format_param_count(pc.total), "2.78T");
  EXPECT_EQ(dm::format_param_count(pc.active), "104.2B");
}

TEST(ParamsShapes, ReleasedDeepseekV3ConfigCounts671B) {
  // DeepSeek-V3's released config.json (every field it has, incl. FP8 quantization_config and
  // YaRN rope_scaling). The report's 671B total excludes the MTP module, which is not built here.
  const char* text = R"json(
{
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
  "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
}
)json";
  const ModelConfig c = dm::parse_config(text, "deepseek_v3_671b.json");
  EXPECT_EQ(c.num_moe_layers(), 58);
  EXPECT_TRUE(c.mla.yarn.enabled);
  EXPECT_DOUBLE_EQ(c.mla.yarn.factor, 40.0);
  EXPECT_EQ(c.moe.n_group, 8);
  EXPECT_EQ(c.moe.topk_group, 4);
  const dm::ParamCount pc = dm::count_params(c);
  EXPECT_NEAR(double(pc.total), 671e9, 0.005 * 671e9);
  EXPECT_NEAR(double(pc.active), 37e9, 0.03 * 37e9);  // "37B activated"
  expect_same_config(dm::parse_config(dm::config_to_k3_json(c), "dumped"), c);
}

TEST(ParamsShapes, OtherRepoConfigs) {
  const dm::ParamCount kl = dm::count_params(dm::load_config(repo_config_path("kimi_linear_48b")));
  EXPECT_NEAR(double(kl.total), 48e9, 0.05 * 48e9);  // "48B-A3B" (49.1B counted)
  EXPECT_NEAR(double(kl.active), 3e9, 0.2 * 3e9);
  const dm::ParamCount demo = dm::count_params(dm::load_config(repo_config_path("demo")));
  EXPECT_GE(demo.total, 10'000'000);
  EXPECT_LE(demo.total, 30'000'000);
  const dm::ParamCount test = dm::count_params(dm::load_config(repo_config_path("test")));
  EXPECT_LT(test.total, 2'000'000);
}

TEST(ParamsCli, TableAndJson) {
  const auto table = dm::test::run_cli("params --config " + repo_config_path("k3"));
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("2.78T"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("104.2B"), std::string::npos) << table.output;
  const auto js = dm::test::run_cli("params --json --config " + repo_config_path("test"));
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const Json j = Json::parse(js.output);
  const ModelConfig tc = dm::load_config(repo_config_path("test"));
  const dm::ParamCount pc = dm::count_params(tc);
  EXPECT_EQ(j["total"].get<int64_t>(), pc.total);
  EXPECT_EQ(j["active"].get<int64_t>(), pc.active);
  EXPECT_EQ(j["breakdown"]["lm_head"]["total"].get<int64_t>(), int64_t(tc.vocab_size) * tc.hidden);
  EXPECT_EQ(j["breakdown"]["embedding"]["active"].get<int64_t>(), 0);
}
