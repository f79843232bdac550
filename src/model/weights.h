// Model parameters: named views into one weights arena, laid out from a ModelConfig.
// The parameter table (one ParamEntry per tensor, in checkpoint naming) drives allocation,
// loading, saving, initialisation and the optimizer's decay rules, so a new checkpoint family is
// a name table (weight_names.cpp), not a new code path.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "io/config.h"

namespace dm {

// How a parameter is initialised (SPEC §1, §2) and whether AdamW decays it.
enum class ParamInit : uint8_t {
  Normal,         // N(0, init_std)
  NormalOut,      // N(0, init_std / sqrt(2·L)) for output projections
  Router,         // N(0, router_init_std)
  Ones,           // norm weights
  Zeros,          // AttnRes pseudo-queries, routing bias
  KdaALog,        // log U(1, 16)
  KdaDtBias,      // inverse-softplus of dt ~ logU(1e-3, 0.1)
  ConvNormal,     // N(0, 1/sqrt(kernel))
};

struct ParamEntry {
  std::string name;        // checkpoint tensor name
  float* data = nullptr;   // view into the weights arena
  Shape shape;             // our shape
  Shape file_shape;        // shape as stored in the checkpoint (A_log, conv weights differ)
  int64_t file_pad = 0;    // extra zero entries the checkpoint stores (K3 pads A_log to 128)
  ParamInit init = ParamInit::Normal;
  bool decay = true;       // AdamW weight decay applies
  bool trainable = true;   // false for the routing bias (set by QB, not by gradients)
  int64_t numel() const { return shape.numel(); }
};

struct KdaWeights {
  float *q_proj, *k_proj, *v_proj;     // [H·K, d]
  float *q_conv, *k_conv, *v_conv;     // [H·K, Kc]
  float *f_a, *f_b;                    // [K, d], [H·K, K]
  float* b_proj;                       // [H, d]
  float *A_log, *dt_bias;              // [H], [H·K]
  float *g_a, *g_b;                    // low-rank output gate [K, d], [H·K, K]
  float* g_full;                       // full-rank output gate [H·K, d]
  float* o_norm;                       // [K]
  float* o_proj;                       // [d, H·K]
};

struct MlaWeights {
  float *q_a, *q_a_norm, *q_b;         // [ql, d], [ql], [H·(nope+rope), ql]  (q LoRA)
  float* q_proj;                       // [H·(nope+rope), d]                   (no q LoRA)
  float *kv_a, *kv_a_norm, *kv_b;      // [kvl+rope, d], [kvl], [H·(nope+v), kvl]
  float* gate;                         // [H·v, d] (output gate)
  float* o_proj;                       // [d, H·v]
};

struct FfnWeights {
  float *gate, *up, *down;             // [F, din], [F, din], [din, F]
};

struct MoeWeights {
  float *router, *router_bias;         // [E, d], [E]
  float *expert_gate, *expert_up;      // [E, F, ℓ] stacked
  float* expert_down;                  // [E, ℓ, F]
  FfnWeights shared;                   // F = num_shared · shared_ffn, din = d
  float *latent_down, *latent_up, *latent_norm;  // [ℓ, d], [d, ℓ], [ℓ]
};

struct AttnResSiteWeights {
  float *query, *norm;                 // [d], [d]
};

struct LayerWeights {
  float *input_norm, *post_norm;       // [d]
  KdaWeights kda{};
  MlaWeights mla{};
  FfnWeights dense{};
  MoeWeights moe{};
  AttnResSiteWeights attn_site{}, ffn_site{};
};

struct ModelWeights {
  ModelConfig cfg;
  Arena arena;                          // every parameter lives here
  std::vector<ParamEntry> params;       // in a fixed order; names per cfg.naming
  float *embed, *final_norm, *lm_head;  // [V, d], [d], [V, d]
  AttnResSiteWeights output_site{};
  std::vector<LayerWeights> layers;

  const ParamEntry* find(const std::string& name) const;
  int64_t numel() const;
};

// Lays out all parameters of `cfg` (zero-filled) in one arena.
std::unique_ptr<ModelWeights> weights_allocate(const ModelConfig& cfg);
// Loads a checkpoint folder (config.json + safetensors, possibly sharded). Every parameter must be
// present with the right shape; unexpected model tensors are an error naming them.
std::unique_ptr<ModelWeights> weights_load(const std::string& dir);
// Random initialisation per SPEC rules (deterministic for a seed).
void weights_init(ModelWeights& w, uint64_t seed);
// Writes config.json (K3 schema) + model.safetensors atomically into dir (created if needed).
void weights_save(const ModelWeights& w, const std::string& dir);

}  // namespace dm
