// Reader of the deepseek_v3 config.json dialect (HF transformers DeepseekV3Config): every layer
// is MLA with RoPE on interleaved pairs (optionally YaRN), the MoE uses a grouped sigmoid router
// with a score-correction bias, SwiGLU experts, plain pre-norm residual.
#include "core/error.h"
#include "io/config.h"
#include "io/config_json_fields.h"

namespace dm::config_detail {

ModelConfig read_deepseek_v3_config(JsonFields& f, ConfigFieldNames* names) {
  ModelConfig cfg;
  cfg.source_type = "deepseek_v3";
  cfg.naming = WeightNaming::DeepseekV3;
  names->num_experts = "n_routed_experts";
  names->top_k = "num_experts_per_tok";
  names->num_shared = "n_shared_experts";
  names->n_group = "n_group";

  // DeepseekV3Config's own default eps is 1e-6.
  read_common_fields(f, cfg, 1e-6f);
  read_hidden_act(f, cfg);
  if (cfg.activation != Activation::SwiGLU)
    f.fail("hidden_act", "DeepSeek-V3 uses silu (SwiGLU)");
  const int L = cfg.num_layers;
  cfg.mixers.assign(size_t(L), MixerKind::MLA);

  const int64_t num_experts = f.opt_int("n_routed_experts", 0, kMaxExperts).value_or(0);
  cfg.ffns = ffn_kinds_from_first_k_dense(L, num_experts > 0,
                                          f.opt_int("first_k_dense_replace", 0, kMaxLayers).value_or(0),
                                          f.opt_int("moe_layer_freq", 1, kMaxLayers).value_or(1));
  const bool need_moe = cfg.num_moe_layers() > 0;
  const bool need_dense = cfg.num_moe_layers() < L;
  cfg.dense_ffn = int(need_dense ? f.req_int("intermediate_size", 0, kMaxDim)
                                 : f.opt_int("intermediate_size", 0, kMaxDim).value_or(0));

  MoeConfig& moe = cfg.moe;
  auto moe_int = [&](const char* key, int64_t hi) {
    return int(need_moe ? f.req_int(key, 0, hi) : f.opt_int(key, 0, hi).value_or(0));
  };
  moe.num_experts = int(num_experts);
  moe.top_k = moe_int("num_experts_per_tok", kMaxExperts);
  moe.expert_ffn = moe_int("moe_intermediate_size", kMaxDim);
  moe.num_shared = int(f.opt_int("n_shared_experts", 0, kMaxExperts).value_or(0));
  moe.shared_ffn = moe.expert_ffn;  // DeepSeek sizes its (fused) shared experts the same way
  moe.n_group = int(f.opt_int("n_group", 0, kMaxExperts).value_or(1));
  moe.topk_group = int(f.opt_int("topk_group", 0, kMaxExperts).value_or(1));
  moe.renormalize = f.opt_bool("norm_topk_prob").value_or(true);
  if (auto sf = f.opt_string("scoring_func"); sf && *sf != "sigmoid")
    f.fail("scoring_func", str_cat("'", *sf, "' is not supported (only sigmoid, as DeepSeek-V3)"));

  read_mla_fields(f, cfg, true);
  cfg.mla.use_rope = true;
  // The engine's RoPE rotates adjacent pairs (the checkpoint's layout); the half-split layout
  // would need the weights permuted first.
  if (!f.opt_bool("rope_interleave").value_or(true))
    f.fail("rope_interleave", "false is not supported (DeepSeek-V3 checkpoints rotate interleaved pairs)");
  if (auto n = f.opt_int("max_position_embeddings", 1, kMaxContext)) cfg.max_context = *n;

  // Valid DeepSeek fields without effect here: selection method and EP/aux-loss training knobs
  // of the reference (we balance with Quantile Balancing, SPEC §1.6), per-head dims derived
  // from the MLA fields.
  f.ignore({"topk_method", "ep_size", "aux_loss_alpha", "seq_aux", "head_dim", "qk_head_dim",
            "num_key_value_heads"});
  f.ignore(hf_generic_ignored_keys());
  f.finish();
  return cfg;
}

}  // namespace dm::config_detail
