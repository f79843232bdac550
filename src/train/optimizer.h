// Optimizers over the flat parameter layout (SPEC §2). Parameters, gradients and each moment
// buffer are separate ModelWeightsT<float> arenas with identical layouts, so one loop over the
// parameter table visits everything; the table's flags say which rules apply.
//   AdamW: β 0.9/0.95, decoupled weight decay 0.1 except norms, biases, A_log, dt_bias, routing
//          bias (not trainable at all: QB sets it) and AttnRes pseudo-queries.
//   Muon:  momentum + Newton–Schulz orthogonalised updates for hidden 2-D matrices, per head for
//          the Q/K/V projections (as K3); everything else (embedding, LM head, norms, vectors,
//          convs, router) falls back to AdamW.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/weights.h"

namespace dm {

enum class OptimizerKind : uint8_t { AdamW, Muon };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::AdamW;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;
  float muon_momentum = 0.95f;
  int muon_ns_steps = 5;
};

class Optimizer {
 public:
  Optimizer(const ModelConfig& cfg, const OptimizerConfig& oc);
  // One update with learning rate lr from the gradients in `grad` (not modified).
  void step(ModelWeights& w, const ModelWeights& grad, float lr);
  int64_t steps() const { return step_; }
  const OptimizerConfig& config() const { return oc_; }
  // Moments and step count, for checkpoints (bit-exact resume).
  void save(const std::string& path) const;
  void load(const std::string& path);
  size_t state_bytes() const;
  // The moments and the step count, for the GPU optimizer's checkpoints (same file format).
  ModelWeights& first_moment() { return *m_; }
  ModelWeights& second_moment() { return *v_; }
  void set_steps(int64_t steps) { step_ = steps; }

 private:
  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, bool decay);
  void muon_update(float* p, const float* g, float* m, int64_t rows, int64_t cols, int64_t heads,
                   float lr, bool decay);
  OptimizerConfig oc_;
  std::unique_ptr<ModelWeights> m_, v_;  // first / second moments (Muon uses m_ as momentum)
  int64_t step_ = 0;
  std::vector<float> ns_scratch_;        // Newton–Schulz workspace, sized once
  ModelConfig cfg_;
};

// Which rule updates a parameter, shared by the CPU optimizer and its GPU twin
// (train/cuda/optimizer_gpu.h): Muon takes the trainable hidden 2-D matrices, per head of
// muon_head_rows rows for Q/K/V blocks (0 = the whole matrix); everything else is AdamW.
bool is_muon_matrix(const ParamEntry& e);
int64_t muon_head_rows(const ParamEntry& e, const ModelConfig& c);

// Global L2 norm of all trainable gradients (double accumulation).
double grad_global_norm(const ModelWeights& grad);
void grad_scale(ModelWeights& grad, float s);
void grad_zero(ModelWeights& grad);

// Linear warmup then cosine decay to min_ratio·peak.
float lr_schedule(int64_t step, int64_t warmup, int64_t total, float peak, float min_ratio);

}  // namespace dm
