// The whole network: embedding → L × (mixer, FFN) with plain or Block-AttnRes residuals → final
// norm → LM head (SPEC §1). One code path for every checkpoint family; the config decides.
// Templated on the scalar: float is the engine, double the finite-difference reference.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/weights.h"

namespace dm {

// Receives intermediate tensors during forward (tests, `deltamoe forward`). Names:
//   embeddings, attn_in_i, attn_out_i, mlp_in_i, mlp_out_i, layer_out_i (what layer i returns:
//   the residual stream, or the AttnRes partial block sum p), final_norm_in, final_hidden.
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  virtual void on_tensor(const std::string& name, const float* x, int64_t rows, int64_t cols) {}
  // idx/weight: [N, k] for MoE layer `layer`.
  virtual void on_router(int layer, const int32_t* idx, const float* weight, int64_t N, int k) {}
};

// Keeps copies of everything it observes (tests, `deltamoe forward --all`).
class ForwardCollector : public ForwardObserver {
 public:
  struct Routing {
    std::vector<int32_t> idx;
    std::vector<float> weight;
    int k = 0;
  };
  void on_tensor(const std::string& name, const float* x, int64_t rows, int64_t cols) override {
    tensors[name].assign(x, x + rows * cols);
  }
  void on_router(int layer, const int32_t* idx, const float* weight, int64_t N, int k) override {
    routers[layer] = Routing{{idx, idx + N * k}, {weight, weight + N * k}, k};
  }
  std::map<std::string, std::vector<float>> tensors;
  std::map<int, Routing> routers;
};

// Routing of one MoE layer during a training forward (for Quantile Balancing and balance
// metrics): scores [N, E] sigmoid router scores, cutoff [N] (k+1)-th biased score, idx [N, k].
class RoutingSink {
 public:
  virtual ~RoutingSink() = default;
  virtual void on_routing(int layer, const float* scores, const float* cutoff, const int32_t* idx,
                          int64_t N, int E, int k) = 0;
  // Statistics built where the routing is (the GPU trainer): a sink that returns true here, with
  // the QB histogram it wants for this layer (`bins` bins over [low, high), train/balance.h
  // QbHistogramRange), gets on_routing_histogram INSTEAD of on_routing, so the [N, E] scores
  // never leave the device. Callers that cannot build them ignore this (the CPU model).
  virtual bool routing_histogram_range(int layer, double* low, double* high, int* bins) {
    (void)layer, (void)low, (void)high, (void)bins;
    return false;
  }
  // counts [E, bins]: this micro-batch's histogram of α_i − s_ij per expert, the bins of the CPU
  // histogram estimator exactly (train/balance.h qb_histogram_accumulate); loads [E]: its routed
  // (token, slot) pairs per expert; N tokens.
  virtual void on_routing_histogram(int layer, const int64_t* counts, const int64_t* loads,
                                    int64_t N, int E, int k) {
    (void)layer, (void)counts, (void)loads, (void)N, (void)E, (void)k;
  }
};

struct ForwardOptions {
  int kda_chunk = 64;  // 16/32/64, or 0 for the recurrent reference
};

struct TrainOptions {
  int kda_chunk = 64;
  bool recompute = true;  // keep only each layer's input; recompute its internals in backward
  int64_t lm_head_rows = 256;  // rows per fused LM-head + cross-entropy tile
};

struct TrainStepResult {
  double loss_sum = 0;     // Σ cross-entropy over counted target positions
  int64_t count = 0;       // counted target positions
  int64_t correct = 0;     // positions whose argmax equals the target
};

template <typename Real>
class ModelT {
 public:
  explicit ModelT(std::unique_ptr<ModelWeightsT<Real>> w);
  ~ModelT();
  static std::unique_ptr<ModelT> load(const std::string& dir);

  const ModelConfig& config() const { return w_->cfg; }
  ModelWeightsT<Real>& weights() { return *w_; }
  const ModelWeightsT<Real>& weights() const { return *w_; }

  // tokens [B, T] (ids checked against the vocabulary) → logits [B, T, V]. doc_start [B·T]
  // (optional): packed documents (docs/backward.md).
  void forward(const int64_t* tokens, int64_t B, int64_t T, Real* logits,
               ForwardObserver* obs = nullptr, const ForwardOptions& opt = {},
               const int32_t* doc_start = nullptr);

  // Training: forward + backward of Σ CE(targets)·loss_scale over one micro-batch; parameter
  // gradients accumulate into `grad` (same layout as the weights). targets [B, T] (−1 = no
  // loss), doc_start [B·T] (nullptr = one document per row).
  TrainStepResult forward_backward(const int64_t* tokens, const int64_t* targets,
                                   const int32_t* doc_start, int64_t B, int64_t T,
                                   ModelWeightsT<Real>& grad, double loss_scale,
                                   const TrainOptions& opt = {}, RoutingSink* sink = nullptr);

  // Bytes of the activation arenas for a batch of B×T tokens (inference / training).
  size_t activation_bytes(int64_t B, int64_t T) const;
  size_t train_activation_bytes(int64_t B, int64_t T, const TrainOptions& opt) const;
  size_t activation_peak() const;

 private:
  struct Train;
  void ensure_activations(int64_t B, int64_t T);
  std::unique_ptr<ModelWeightsT<Real>> w_;
  Arena act_;
  int64_t act_B_ = 0, act_T_ = 0;
  std::unique_ptr<Train> train_;
};

using Model = ModelT<float>;

// Checks every id is in [0, vocab); throws naming the position.
void check_token_ids(const int64_t* tokens, int64_t n, int64_t vocab, const std::string& origin);

}  // namespace dm
