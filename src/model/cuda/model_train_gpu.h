// The whole-model training step on one GPU (SPEC §2, §5): forward + backward of the summed
// cross-entropy over one micro-batch, the twin of ModelT<float>::forward_backward (model/model.h)
// with per-layer recompute: the forward keeps each layer's input and the stream after its mixer
// (both fp32 [N, d]; a sealed AttnRes block sum is the input of the layer that sealed it); the
// backward rebuilds one layer's record from those (the AttnRes mixes and norms only: neither the
// mixer nor the FFN runs again there), then back-propagates through its FFN and token mixer
// (layers.h *_backward_gpu, which recompute their own internals from the normed rows). So each
// sub-layer's forward runs twice per step. Without recompute every layer keeps its record (and
// its KDA and MoE internals), and the backward rebuilds nothing.
//
// Precision: bf16 GEMM operands and activations inside the sub-layers, fp32 residual stream,
// fp32 stream gradients, fp32 parameter gradients (DeviceGrads, accumulated across micro-batches
// until the optimizer consumes them). The LM head + softmax cross-entropy run tile by tile
// (rows × V fp32 logits per tile), so no [N, V] tensor is kept.
//
// Memory: DeviceWeights (bf16 + fp32 mirrors), DeviceGrads (4 B/param), one activation arena
// (layer inputs, blocks, the current layer's record, stream gradients, LM-head tile) and one
// scratch arena sized for the largest sub-layer forward/backward; both grow only when a larger
// batch arrives.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/cuda/gpu_run.h"
#include "model/cuda/layers.h"
#include "model/model.h"
#include "ops/cuda/graph.h"

namespace dm {
struct QbHistogramRange;  // train/balance.h
}  // namespace dm

namespace dm::cuda {

// Device bytes a GpuTrainModel takes for steps of B × T tokens beyond the weights, gradients and
// optimizer state: the activation arena, the step's scratch and, without recompute, every KDA,
// MLA and MoE layer's kept forward internals (what activation_bytes() reports after such a step).
// Host arithmetic: no device needed (`deltamoe plan`).
size_t train_activation_plan_bytes(const ModelConfig& c, int64_t B, int64_t T, bool recompute);

class GpuTrainModel {
 public:
  // `host` holds the starting weights and must outlive this object; the device copies are made
  // here. The host arena is NOT kept current by training: download_weights() refreshes it.
  explicit GpuTrainModel(ModelWeights& host);
  ~GpuTrainModel();
  const ModelConfig& config() const { return dw_.config(); }

  // tokens, targets [B, T] (host; −1 = no loss), doc_start [B·T] (host, nullable) → the loss sums
  // of this micro-batch; gradients of Σ CE · loss_scale ACCUMULATE into grads(). `sink` receives
  // each MoE layer's routing (host copies: scores [N, E], cutoff [N], idx [N, k]) for Quantile
  // Balancing, or, when it asks for them (RoutingSink::routing_histogram_range), the layer's QB
  // histogram and expert loads built on the device. Synchronises the stream before returning.
  // recompute = false: each KDA layer's forward keeps its internals (q, k, v, g, β, the operator's
  // chunk states, …: ~0.5 GB per layer at T = 4096, d = 2048) and each MoE layer its routing,
  // dispatch plan and expert intermediates (~0.25 GB per layer there), so their backwards skip the
  // recompute (and the MoE backward its stream synchronisation), and every layer its residual
  // record (its AttnRes mixes and normed rows, 0.1 GB per layer there), so the backward rebuilds
  // none; MLA and dense FFN sub-layers recompute their internals either way.
  TrainStepResult forward_backward(const int64_t* tokens, const int64_t* targets,
                                   const int32_t* doc_start, int64_t B, int64_t T,
                                   double loss_scale, RoutingSink* sink = nullptr,
                                   bool recompute = true);

  DeviceWeights& weights() { return dw_; }
  DeviceGrads& grads() { return grads_; }
  DeviceParamArena& master() { return master_; }  // fp32 master weights (the optimizer's)
  // The run the step uses (cuBLAS handles, stream); exists before the first batch too.
  GpuRun& run();
  ModelWeights& host() { return host_; }

  // master → host arena (checkpoints, evaluation on the CPU). Synchronous.
  void download_weights();
  // The routing biases QB set in the host arena → master weights and both mirrors.
  void upload_router_biases();
  size_t activation_bytes() const;

 private:
  void ensure_capacity(int64_t B, int64_t T);
  // The QB histogram and expert loads of one MoE layer's routing r, built on the device, copied
  // to the host and handed to the sink (synchronises the stream).
  void report_routing_histogram(int layer, const MoeRoutingDevice& r, int64_t N, int64_t E,
                                int64_t k, const QbHistogramRange& range, RoutingSink& sink);
  void ensure_kept(int64_t B, int64_t T);
  ModelWeights& host_;
  DeviceWeights dw_;
  DeviceGrads grads_;
  DeviceParamArena master_;
  std::unique_ptr<GpuRun> run_;
  std::unique_ptr<DeviceArena> act_;
  std::unique_ptr<DeviceArena> kept_;  // KDA, MLA, MoE internals, layer records (no recompute)
  std::vector<MoeKept> moe_kept_;      // per layer (views into kept_; host offsets)
  int64_t capacity_B_ = 0, capacity_T_ = 0;
  // Host staging of one MoE layer's routing for the sink.
  std::vector<float> route_scores_, route_cutoff_;
  std::vector<int32_t> route_idx_;
  // Sinks that take device-built statistics (RoutingSink::routing_histogram_range): the counts
  // [E, bins] and loads [E] on the device (grown on demand, so steady steps do not allocate) and
  // their host copies.
  std::unique_ptr<DeviceArena> route_stats_;
  std::unique_ptr<PinnedBuffer> upload_;  // the batch's tokens, targets and document starts
  bool upload_pending_ = false;           // copies from upload_ queued, not yet waited for
  std::vector<int64_t> route_counts_, route_loads_;
};

}  // namespace dm::cuda
