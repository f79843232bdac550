// The GPU training engine: GpuTrainModel (forward + backward on the device) + GpuOptimizer.
#include <cstdlib>
#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/model_train_gpu.h"
#include "ops/cuda/device.h"
#include "train/cuda/optimizer_gpu.h"
#include "train/train_engine.h"

namespace dm {
namespace {

class GpuTrainEngine final : public TrainEngine {
 public:
  GpuTrainEngine(Model& model, const OptimizerConfig& oc)
      : gpu_(model.weights()), opt_(model.weights(), oc) {}
  // The experts' and the matrices' gradients are left to their first product
  // (DeviceParamArena::zero_deferred; GpuTrainModel registers the ranges);
  // settle() zeroes any a micro-batch did not reach before the norm or the optimizer reads them.
  // DM_STORE_FIRST_GRADS=0 (read once) zeroes the whole arena instead, to compare.
  void zero_grads() override {
    static const bool deferred = env_flag("DM_STORE_FIRST_GRADS", true);
    if (deferred)
      gpu_.grads().zero_deferred(stream());
    else
      gpu_.grads().zero(stream());
  }
  TrainStepResult forward_backward(const int64_t* tokens, const int64_t* targets,
                                   const int32_t* doc_start, int64_t B, int64_t T,
                                   double loss_scale, const TrainOptions& to,
                                   RoutingSink* sink) override {
    // The GPU step runs the chunked KDA operator (C = 64); without recompute the KDA, MLA and
    // MoE layers keep their internals (GpuTrainModel::forward_backward).
    TrainStepResult r =
        gpu_.forward_backward(tokens, targets, doc_start, B, T, loss_scale, sink, to.recompute);
    peak_ = std::max(peak_, gpu_.activation_bytes());
    return r;
  }
  double grad_norm() override {
    gpu_.grads().settle(stream());
    return opt_.grad_norm(gpu_.run(), gpu_.grads());
  }
  void scale_grads(float s) override { opt_.scale_grads(s); }  // applied by the next step
  void optimizer_step(float lr) override {
    gpu_.grads().settle(stream());
    opt_.step(gpu_.run(), gpu_.master(), gpu_.weights(), gpu_.grads(), lr);
  }
  void after_bias_update() override { gpu_.upload_router_biases(); }
  void sync_host_weights() override { gpu_.download_weights(); }
  void save_optimizer(const std::string& path) override { opt_.save(path); }
  void load_optimizer(const std::string& path) override { opt_.load(path); }
  size_t optimizer_bytes() const override { return opt_.state_bytes(); }
  size_t activation_peak() const override { return peak_; }
  void synchronize() override { cuda::synchronize(); }

 private:
  CUstream_st* stream() { return nullptr; }
  cuda::GpuTrainModel gpu_;
  cuda::GpuOptimizer opt_;
  size_t peak_ = 0;
};

}  // namespace

std::unique_ptr<TrainEngine> make_cuda_train_engine(Model& model, const OptimizerConfig& oc) {
  DM_CHECK(cuda::device_available(), "train --device cuda: ", cuda::device_description());
  return std::make_unique<GpuTrainEngine>(model, oc);
}

}  // namespace dm
