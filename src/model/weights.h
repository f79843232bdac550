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

// Real = float for the engine, double for finite-difference reference checks.
template <typename Real>
struct ParamEntryT {
  std::string name;        // checkpoint tensor name
  Real* data = nullptr;    // view into the weights arena
  Shape shape;             // our shape
  Shape file_shape;        // shape as stored in the checkpoint (A_log, conv weights differ)
  int64_t file_pad = 0;    // extra zero entries the checkpoint stores (K3 pads A_log to 128)
  ParamInit init = ParamInit::Normal;
  bool decay = true;       // AdamW weight decay applies
  bool trainable = true;   // false for the routing bias (set by QB, not by gradients)
  int64_t numel() const { return shape.numel(); }
};

template <typename Real>
struct KdaWeightsT {
  Real *q_proj, *k_proj, *v_proj;     // [H·K, d]
  Real *q_conv, *k_conv, *v_conv;     // [H·K, Kc]
  Real *f_a, *f_b;                    // [K, d], [H·K, K]
  Real* b_proj;                       // [H, d]
  Real *A_log, *dt_bias;              // [H], [H·K]
  Real *g_a, *g_b;                    // low-rank output gate [K, d], [H·K, K]
  Real* g_full;                       // full-rank output gate [H·K, d]
  Real* o_norm;                       // [K]
  Real* o_proj;                       // [d, H·K]
};

template <typename Real>
struct MlaWeightsT {
  Real *q_a, *q_a_norm, *q_b;         // [ql, d], [ql], [H·(nope+rope), ql]  (q LoRA)
  Real* q_proj;                       // [H·(nope+rope), d]                   (no q LoRA)
  Real *kv_a, *kv_a_norm, *kv_b;      // [kvl+rope, d], [kvl], [H·(nope+v), kvl]
  Real* gate;                         // [H·v, d] (output gate)
  Real* o_proj;                       // [d, H·v]
};

template <typename Real>
struct FfnWeightsT {
  Real *gate, *up, *down;             // [F, din], [F, din], [din, F]
};

template <typename Real>
struct MoeWeightsT {
  Real *router, *router_bias;         // [E, d], [E]
  Real *expert_gate, *expert_up;      // [E, F, ℓ] stacked
  Real* expert_down;                  // [E, ℓ, F]
  FfnWeightsT<Real> shared;                   // F = num_shared · shared_ffn, din = d
  Real *latent_down, *latent_up, *latent_norm;  // [ℓ, d], [d, ℓ], [ℓ]
};

template <typename Real>
struct AttnResSiteWeightsT {
  Real *query, *norm;                 // [d], [d]
};

template <typename Real>
struct LayerWeightsT {
  Real *input_norm, *post_norm;       // [d]
  KdaWeightsT<Real> kda{};
  MlaWeightsT<Real> mla{};
  FfnWeightsT<Real> dense{};
  MoeWeightsT<Real> moe{};
  AttnResSiteWeightsT<Real> attn_site{}, ffn_site{};
};

template <typename Real>
struct ModelWeightsT {
  ModelConfig cfg;
  Arena arena;                          // every parameter lives here
  std::vector<ParamEntryT<Real>> params;       // in a fixed order; names per cfg.naming
  Real *embed, *final_norm, *lm_head;  // [V, d], [d], [V, d]
  AttnResSiteWeightsT<Real> output_site{};
  std::vector<LayerWeightsT<Real>> layers;

  const ParamEntryT<Real>* find(const std::string& name) const {
    for (const auto& e : params)
      if (e.name == name) return &e;
    return nullptr;
  }
  // Offset of a parameter view from the start of the arena, in elements. Gradients and optimizer
  // state mirror the layout, so the same offset addresses a parameter's gradient.
  int64_t offset_of(const Real* p) const { return p - static_cast<const Real*>(arena_base()); }
  const void* arena_base() const { return params.empty() ? nullptr : params.front().data; }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& e : params) n += e.numel();
    return n;
  }
};

using ParamEntry = ParamEntryT<float>;
using KdaWeights = KdaWeightsT<float>;
using MlaWeights = MlaWeightsT<float>;
using FfnWeights = FfnWeightsT<float>;
using MoeWeights = MoeWeightsT<float>;
using AttnResSiteWeights = AttnResSiteWeightsT<float>;
using LayerWeights = LayerWeightsT<float>;
using ModelWeights = ModelWeightsT<float>;

// Lays out all parameters of `cfg` (zero-filled) in one arena. The layout depends only on the
// config, so a second call gives a gradient (or optimizer-moment) arena with identical offsets.
template <typename Real = float>
std::unique_ptr<ModelWeightsT<Real>> weights_allocate(const ModelConfig& cfg);
// Loads a checkpoint folder (config.json + safetensors, possibly sharded). Every parameter must be
// present with the right shape; unexpected model tensors are an error naming them.
template <typename Real = float>
std::unique_ptr<ModelWeightsT<Real>> weights_load(const std::string& dir);
// Random initialisation per SPEC rules (deterministic for a seed; the same values for any Real
// and any thread count; parallel over chunks of the parameters).
template <typename Real>
void weights_init(ModelWeightsT<Real>& w, uint64_t seed);
// True for the N(0,σ)-initialised matrices (Normal, NormalOut, Router); false for the
// element-wise parameters (norm weights, biases, A_log, dt_bias, conv kernels, AttnRes queries).
inline bool param_init_is_matrix(ParamInit init) {
  return init == ParamInit::Normal || init == ParamInit::NormalOut || init == ParamInit::Router;
}
// σ weights_init draws a Normal / NormalOut / Router / ConvNormal parameter of `shape` with
// (0 for the other kinds): init_std, init_std/sqrt(2·L), router_init_std, 1/sqrt(kernel).
float param_init_std(const ModelConfig& cfg, ParamInit init, const Shape& shape);
// Initialises ONLY the element-wise parameters (!param_init_is_matrix), touching no matrix memory
// (for DeviceWeights' device-side random init of models larger than the host): exactly the values
// weights_init gives them (every chunk of 2^20 values of a parameter has its own generator,
// seeded from (seed, parameter index, chunk)). Deterministic for a seed.
template <typename Real>
void weights_init_elementwise(ModelWeightsT<Real>& w, uint64_t seed);

// A float weights layout whose storage is reserved address space (one anonymous mmap with
// MAP_NORESERVE) instead of an Arena: pages get host memory only where written. It lends its
// views and offsets to a device mirror of a model larger than the host (Kimi-Linear-48B is
// 196 GB in fp32; weights_allocate cannot hold it: Arena::reserve zero-fills, i.e. touches, the
// whole arena). Matrices read as zeros; write only small parameters (weights_init_elementwise).
class ReservedWeights {
 public:
  explicit ReservedWeights(const ModelConfig& cfg);
  ~ReservedWeights();
  ReservedWeights(const ReservedWeights&) = delete;
  ReservedWeights& operator=(const ReservedWeights&) = delete;
  ModelWeightsT<float>& get() { return *w_; }
  const ModelWeightsT<float>& get() const { return *w_; }
  size_t reserved_bytes() const { return bytes_; }

 private:
  std::unique_ptr<ModelWeightsT<float>> w_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// Copies values between layouts of the same config (e.g. float → double for reference checks).
template <typename To, typename From>
void weights_copy(const ModelWeightsT<From>& src, ModelWeightsT<To>& dst);
// Writes config.json (K3 schema) + model.safetensors (f32) atomically into dir.
template <typename Real>
void weights_save(const ModelWeightsT<Real>& w, const std::string& dir);

}  // namespace dm
