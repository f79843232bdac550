// Where a training step's arithmetic runs: the CPU model and optimizer, or their GPU twins
// (train/cuda/train_engine_gpu.cpp). The training loop (trainer.cpp) owns the data, the schedule,
// Quantile Balancing (on the host, from the routing the engine reports) and the checkpoints; an
// engine owns the gradients, the optimizer state and, on the GPU, the device weights.
//
// Host weights: the CPU engine trains the host arena in place. The GPU engine keeps the fp32
// master weights on the device; sync_host_weights() copies them into the host arena (before an
// evaluation or a checkpoint), and after_bias_update() uploads routing biases QB set on the host.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/model.h"
#include "train/optimizer.h"

namespace dm {

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  virtual void zero_grads() = 0;
  // Accumulates the gradients of Σ CE · loss_scale over one micro-batch.
  virtual TrainStepResult forward_backward(const int64_t* tokens, const int64_t* targets,
                                           const int32_t* doc_start, int64_t B, int64_t T,
                                           double loss_scale, const TrainOptions& opt,
                                           RoutingSink* sink) = 0;
  virtual double grad_norm() = 0;
  virtual void scale_grads(float s) = 0;
  virtual void optimizer_step(float lr) = 0;
  virtual void after_bias_update() {}
  virtual void sync_host_weights() {}
  virtual void save_optimizer(const std::string& path) = 0;
  virtual void load_optimizer(const std::string& path) = 0;
  virtual size_t optimizer_bytes() const = 0;
  virtual size_t activation_peak() const = 0;
  // Waits for the engine's queued work (the GPU's; the CPU engine's is done on return): timing.
  virtual void synchronize() {}
};

// device: "cpu" or "cuda". The model's host weights must outlive the engine. A "cuda" engine in a
// build without the CUDA backend, or on a machine without a GPU, throws dm::Error saying so.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, Model& model,
                                               const OptimizerConfig& oc);
// The GPU engine (train/cuda/train_engine_gpu.cpp; only in CUDA builds).
std::unique_ptr<TrainEngine> make_cuda_train_engine(Model& model, const OptimizerConfig& oc);

}  // namespace dm
