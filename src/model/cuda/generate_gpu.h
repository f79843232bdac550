// Autoregressive generation for one prompt on the GPU: the twin of infer/generate.h's generate()
// (same options, same result, same callback), running GpuDecoder (model/cuda/decode_gpu.h) with
// one slot. Sampling stays on the host (infer/sampler.h) over the fp32 logits of each step.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "infer/generate.h"
#include "model/cuda/gpu_run.h"
#include "model/cuda/model_gpu.h"

namespace dm::cuda {

// Returns the new tokens (prompt excluded); on_token (optional) sees each as it comes; generation
// ends after max_new_tokens or after emitting one of opt.stop_ids. The prompt is fed one token per
// decode step (GpuDecoder::prefill). `dw` is the device copy of the model's weights.
std::vector<int32_t> generate_gpu(const DeviceWeights& dw, const std::vector<int32_t>& prompt,
                                  const GenerateOptions& opt,
                                  const std::function<void(int32_t)>& on_token = nullptr);

// The fp32 GPU mode's generation (GpuModel with WeightPrecision::F32): the same loop, but every
// step runs the whole sequence through GpuModel::forward_last — there is no fp32 decode cache —
// so a step costs a prefill of the sequence so far. It exists to check the GPU path against the
// CPU float engine token for token (greedy continuations match), not to serve.
std::vector<int32_t> generate_gpu_fp32(GpuModel& model, const std::vector<int32_t>& prompt,
                                       const GenerateOptions& opt,
                                       const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace dm::cuda
