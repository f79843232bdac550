// The optimizer step on the GPU (SPEC §2): the twin of train/optimizer.h on the device arenas of
// GpuTrainModel. AdamW (and Muon for the hidden matrices when configured) update the fp32 master
// weights from the fp32 gradients and keep the device mirrors current (the bf16 compute copy, the
// packed fp32 copies of the element-wise parameters); moments live on the device (8 B/param).
// Every AdamW parameter is updated by one launch (adamw_update_ranges over the arena's ranges)
// that writes both mirrors in the same pass. Global-norm clipping reads the gradient norm with one
// deterministic reduction.
// Checkpoints use the CPU optimizer's file (optimizer.safetensors), so a run can resume on either.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/cuda/gpu_run.h"
#include "ops/cuda/elementwise.h"
#include "train/optimizer.h"

namespace dm::cuda {

class GpuOptimizer {
 public:
  GpuOptimizer(const ModelWeights& host, const OptimizerConfig& oc);
  ~GpuOptimizer();
  // √(Σ g²) over the whole gradient arena (synchronises the stream).
  double grad_norm(GpuRun& run, const DeviceGrads& grads);
  // Multiplies the gradients by s, lazily: the next step() applies the factor as it reads them
  // (inside the AdamW pass; Muon's matrices are scaled just before their update), which saves a
  // read and a write of the whole gradient arena. Nothing else may read the gradients between.
  void scale_grads(float s) { pending_grad_scale_ *= s; }
  // One update with learning rate lr: master ← update(master, grads); weights' mirrors refreshed.
  void step(GpuRun& run, DeviceParamArena& master, DeviceWeights& weights,
            const DeviceGrads& grads, float lr);
  int64_t steps() const { return step_; }
  void save(const std::string& path);
  void load(const std::string& path);
  size_t state_bytes() const;

 private:
  const ModelWeights& host_;
  OptimizerConfig oc_;
  Optimizer host_format_;  // host moments: the checkpoint format (staging for save / load)
  DeviceParamArena m_, v_;
  std::vector<AdamWRange> adamw_ranges_;  // every AdamW-updated parameter
  // Their tiles with the fp32 copies of `plan_weights_` (built at the first step: one launch per
  // step).
  std::unique_ptr<AdamWRangePlan> plan_;
  const DeviceWeights* plan_weights_ = nullptr;
  float pending_grad_scale_ = 1.0f;
  DeviceArena scratch_;    // norm reduction + Newton–Schulz workspace
  int64_t step_ = 0;
};

}  // namespace dm::cuda
