#include "train/train_engine.h"

#include "core/error.h"

namespace dm {
namespace {

class CpuTrainEngine final : public TrainEngine {
 public:
  CpuTrainEngine(Model& model, const OptimizerConfig& oc)
      : model_(model), grads_(weights_allocate<float>(model.config())), opt_(model.config(), oc) {}
  void zero_grads() override { grad_zero(*grads_); }
  TrainStepResult forward_backward(const int64_t* tokens, const int64_t* targets,
                                   const int32_t* doc_start, int64_t B, int64_t T,
                                   double loss_scale, const TrainOptions& opt,
                                   RoutingSink* sink) override {
    return model_.forward_backward(tokens, targets, doc_start, B, T, *grads_, loss_scale, opt, sink);
  }
  double grad_norm() override { return grad_global_norm(*grads_); }
  void scale_grads(float s) override { grad_scale(*grads_, s); }
  void optimizer_step(float lr) override { opt_.step(model_.weights(), *grads_, lr); }
  void save_optimizer(const std::string& path) override { opt_.save(path); }
  void load_optimizer(const std::string& path) override { opt_.load(path); }
  size_t optimizer_bytes() const override { return opt_.state_bytes(); }
  size_t activation_peak() const override { return model_.activation_peak(); }

 private:
  Model& model_;
  std::unique_ptr<ModelWeights> grads_;
  Optimizer opt_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, Model& model,
                                               const OptimizerConfig& oc) {
  if (device == "cpu") return std::make_unique<CpuTrainEngine>(model, oc);
  DM_CHECK(device == "cuda", "train: unknown device '", device, "' (cpu or cuda)");
#if DELTAMOE_HAVE_CUDA
  return make_cuda_train_engine(model, oc);
#else
  throw Error("train --device cuda: this build has no CUDA backend (configure with nvcc present "
              "or -DDELTAMOE_CUDA=ON)");
#endif
}

}  // namespace dm
