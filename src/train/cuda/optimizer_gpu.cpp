#include "train/cuda/optimizer_gpu.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/muon.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {
namespace {

// Newton–Schulz workspace of the largest Muon block (0 without Muon).
size_t muon_scratch_bytes(const ModelWeights& w, const OptimizerConfig& oc) {
  if (oc.kind != OptimizerKind::Muon) return 0;
  size_t bytes = 0;
  for (const ParamEntry& e : w.params)
    if (is_muon_matrix(e))
      bytes = std::max(bytes, muon_workspace_bytes(e.shape[0], e.shape[1],
                                                   muon_head_rows(e, w.cfg)));
  return bytes;
}

// The AdamW-updated parameters as arena ranges (adjacent ones with the same decay merged).
std::vector<AdamWRange> adamw_ranges(const ModelWeights& w, const OptimizerConfig& oc) {
  std::vector<AdamWRange> ranges;
  for (const ParamEntry& e : w.params) {
    if (!e.trainable || (oc.kind == OptimizerKind::Muon && is_muon_matrix(e))) continue;
    const int64_t begin = w.offset_of(e.data);
    ranges.push_back({begin, begin + e.numel(), e.decay});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const AdamWRange& a, const AdamWRange& b) { return a.begin < b.begin; });
  std::vector<AdamWRange> merged;
  for (const AdamWRange& r : ranges) {
    if (!merged.empty() && merged.back().end == r.begin && merged.back().decay == r.decay)
      merged.back().end = r.end;
    else
      merged.push_back(r);
  }
  return merged;
}

}  // namespace

GpuOptimizer::GpuOptimizer(const ModelWeights& host, const OptimizerConfig& oc)
    : host_(host),
      oc_(oc),
      host_format_(host.cfg, oc),
      m_(host),
      v_(host),
      adamw_ranges_(adamw_ranges(host, oc)),
      scratch_(std::max(sum_squares_workspace_bytes(m_.numel()), muon_scratch_bytes(host, oc)) +
               4096) {}

GpuOptimizer::~GpuOptimizer() = default;

size_t GpuOptimizer::state_bytes() const {
  return size_t(m_.numel() + v_.numel()) * sizeof(float);
}

double GpuOptimizer::grad_norm(GpuRun& run, const DeviceGrads& grads) {
  DeviceArenaScope scope(scratch_);
  double* result = scratch_.alloc<double>(1);
  void* ws = scratch_.alloc_bytes(sum_squares_workspace_bytes(grads.numel()));
  sum_squares(grads.data(), grads.numel(), result, ws, run.stream);
  double s = 0;
  copy_to_host_async(&s, result, sizeof s, run.stream);
  stream_synchronize(run.stream);
  return std::sqrt(s);
}

void GpuOptimizer::step(GpuRun& run, DeviceParamArena& master, DeviceWeights& weights,
                        const DeviceGrads& grads, float lr) {
  ++step_;
  const float grad_scale = pending_grad_scale_;
  pending_grad_scale_ = 1.0f;
  uint16_t* bf16 = weights.bf16_data();
  if (oc_.kind == OptimizerKind::Muon) {
    for (const ParamEntry& e : host_.params) {
      if (!e.trainable || !is_muon_matrix(e)) continue;
      const int64_t off = host_.offset_of(e.data);
      float* g = grads.at(e.data);
      if (grad_scale != 1.0f) scale_inplace(g, e.numel(), grad_scale, run.stream);
      MuonStep ms;
      ms.lr = lr;
      ms.momentum = oc_.muon_momentum;
      ms.weight_decay = e.decay ? oc_.weight_decay : 0.0f;
      ms.ns_steps = oc_.muon_ns_steps;
      DeviceArenaScope scope(scratch_);
      void* ws = scratch_.alloc_bytes(
          muon_workspace_bytes(e.shape[0], e.shape[1], muon_head_rows(e, host_.cfg)));
      muon_update(run.gemm, master.at(e.data), g, m_.at(e.data), bf16 + off, e.shape[0],
                  e.shape[1], muon_head_rows(e, host_.cfg), ms, ws, run.stream);
    }
  }
  AdamWStep s;
  s.lr = lr;
  s.beta1 = oc_.beta1;
  s.beta2 = oc_.beta2;
  s.eps = oc_.eps;
  s.weight_decay = oc_.weight_decay;
  s.step = step_;
  if (!plan_ || plan_weights_ != &weights) {
    std::vector<AdamWMirror> mirrors;
    for (const DeviceWeights::F32Range& r : weights.f32_ranges())
      mirrors.push_back({r.begin, r.end, r.packed});
    plan_ = std::make_unique<AdamWRangePlan>(adamw_ranges_, mirrors);
    plan_weights_ = &weights;
  }
  // AdamW writes the fp32 copies of what it updates; what else has one (the routing biases QB
  // sets: uploaded to both copies) does not change here, and Muon's matrices have none in the
  // bf16 mode, but the fp32 mode mirrors every parameter, so Muon steps refresh them all.
  adamw_update_ranges(*plan_, master.data(), grads.data(), m_.data(), v_.data(), bf16,
                      weights.f32_data(), s, grad_scale, run.stream);
  if (oc_.kind == OptimizerKind::Muon) weights.refresh_f32_from_master(master.data(), run.stream);
}

void GpuOptimizer::save(const std::string& path) {
  m_.download(host_format_.first_moment());
  v_.download(host_format_.second_moment());
  host_format_.set_steps(step_);
  host_format_.save(path);
}

void GpuOptimizer::load(const std::string& path) {
  host_format_.load(path);
  m_.upload(host_format_.first_moment());
  v_.upload(host_format_.second_moment());
  step_ = host_format_.steps();
}

}  // namespace dm::cuda
