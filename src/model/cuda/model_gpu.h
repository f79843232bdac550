// The whole model forward on one GPU (SPEC §1, §5): embedding → residual stream (Block AttnRes
// or plain) over KDA / MLA mixers and MoE / dense FFNs → final RMSNorm → LM head, every op on the
// device, bf16 GEMM operands and activations between ops, fp32 residual stream, KDA state,
// softmax statistics and router scores. The twin of ModelT<float>::forward (model/model.h).
//
// fp32 mode (WeightPrecision::F32): fp32 weights, fp32 normed rows and activations, fp32 GEMMs
// without TF32 (layers.h): the CPU float engine's numbers to ~1e-6, for checking the GPU path and
// for users who want fp32 inference; about 2× the weight memory and several times slower.
//
// Memory: the weights' device mirrors (DeviceWeights), one activation arena sized for the
// largest batch seen so far (stream buffers + AttnRes block sums + logits) and one scratch arena
// for the sub-layers (their *_gpu_bytes maximum); both grow only when a larger B·T arrives.
#pragma once
#include <cstdint>
#include <memory>

#include "model/cuda/gpu_run.h"
#include "model/model.h"

namespace dm::cuda {

// Per MoE layer loads of the last forward (balance metrics, `deltamoe forward --device cuda`).
struct GpuForwardRouting {
  int layer = 0;
  std::vector<int32_t> idx;  // [N, k] (host copy)
};

class GpuModel {
 public:
  // Uploads the weights (bf16 + fp32 mirrors, or all fp32). `host` must outlive this object.
  explicit GpuModel(const ModelWeights& host, WeightPrecision precision = WeightPrecision::Bf16);
  ~GpuModel();
  const ModelConfig& config() const { return dw_.config(); }

  // tokens [B, T] (host; ids checked) → logits [B, T, V] (host, fp32). doc_start [B·T] (host,
  // optional): packed documents. routing (optional): each MoE layer's choices, copied back.
  void forward(const int64_t* tokens, int64_t B, int64_t T, float* logits,
               const int32_t* doc_start = nullptr,
               std::vector<GpuForwardRouting>* routing = nullptr);

  // One sequence tokens [T] (host; ids checked) → the logits of its LAST position [V] (host,
  // fp32): the LM head runs on that row only. What generation without a cache needs
  // (generate_gpu_fp32).
  void forward_last(const int64_t* tokens, int64_t T, float* logits);

  size_t weight_bytes() const { return dw_.bytes(); }
  size_t activation_bytes() const;

 private:
  void ensure_capacity(int64_t B, int64_t T);
  // A: the normed rows' type (uint16_t bf16, float in the fp32 mode).
  // last_only: logits of row B·T − 1 only (B = 1).
  template <typename A>
  void forward_impl(const int64_t* tokens, int64_t B, int64_t T, float* logits,
                    const int32_t* doc_start, std::vector<GpuForwardRouting>* routing,
                    bool last_only);
  DeviceWeights dw_;
  std::unique_ptr<GpuRun> run_;
  std::unique_ptr<DeviceArena> act_;
  int64_t capacity_B_ = 0, capacity_T_ = 0;
};

}  // namespace dm::cuda
