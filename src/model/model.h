// The whole network: embedding → L × (mixer, FFN) with plain or Block-AttnRes residuals → final
// norm → LM head (SPEC §1). One code path for every checkpoint family; the config decides.
#pragma once
#include <cstdint>
#include <memory>
#include <map>
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

struct ForwardOptions {
  int kda_chunk = 64;  // 16/32/64, or 0 for the recurrent reference
};

class Model {
 public:
  explicit Model(std::unique_ptr<ModelWeights> w);
  static std::unique_ptr<Model> load(const std::string& dir);

  const ModelConfig& config() const { return w_->cfg; }
  ModelWeights& weights() { return *w_; }
  const ModelWeights& weights() const { return *w_; }

  // tokens [B, T] (ids checked against the vocabulary) → logits [B, T, V].
  void forward(const int64_t* tokens, int64_t B, int64_t T, float* logits,
               ForwardObserver* obs = nullptr, const ForwardOptions& opt = {});

  // Bytes of the activation arena for a batch of B×T tokens.
  size_t activation_bytes(int64_t B, int64_t T) const;
  size_t activation_peak() const { return act_.peak(); }

 private:
  void ensure_activations(int64_t B, int64_t T);
  std::unique_ptr<ModelWeights> w_;
  Arena act_;
  int64_t act_B_ = 0, act_T_ = 0;
};

// Checks every id is in [0, vocab); throws naming the position.
void check_token_ids(const int64_t* tokens, int64_t n, int64_t vocab, const std::string& origin);

}  // namespace dm
