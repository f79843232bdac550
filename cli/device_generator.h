// `--device cpu|cuda` for the commands that generate (generate, chat): one object that holds the
// GPU upload of the weights across calls (chat generates once per turn) and says clearly when
// cuda is asked of a build or a machine without it — before the model is loaded (require()).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "infer/generate.h"
#include "model/model.h"
#if DELTAMOE_HAVE_CUDA
#include "infer/cuda/generation_session_gpu.h"
#include "model/cuda/generate_gpu.h"
#include "ops/cuda/device.h"
#endif

namespace dm::cli {

class DeviceGenerator {
 public:
  // Throws dm::Error when `device` is "cuda" and there is no CUDA backend or no GPU.
  static void require(const std::string& device) {
    if (device != "cuda") return;
#if DELTAMOE_HAVE_CUDA
    DM_CHECK(cuda::device_available(), "--device cuda: ", cuda::device_description());
#else
    throw Error("--device cuda: this build has no CUDA backend (configure with -DDELTAMOE_CUDA=ON)");
#endif
  }

  // cuda: uploads the weights once (bf16 compute, fp32 logits, host sampling); fp32 = true: the
  // fp32 GPU mode (fp32 weights and compute, no decode cache: generate_gpu_fp32). The CPU
  // engine is fp32 whatever `fp32` says. prefix_cache_bytes > 0 (bf16 cuda; chat): calls share
  // one decoder and a GPU prefix cache, so a prompt that repeats an earlier one's start (the
  // conversation so far) prefills only the rest.
  DeviceGenerator(Model& model, const std::string& device, bool fp32 = false,
                  size_t prefix_cache_bytes = 0)
      : model_(model) {
    require(device);
#if DELTAMOE_HAVE_CUDA
    if (device == "cuda" && fp32) {
      gpu_fp32_ = std::make_unique<cuda::GpuModel>(model.weights(), cuda::WeightPrecision::F32);
    } else if (device == "cuda") {
      dw_ = std::make_unique<cuda::DeviceWeights>(model.weights());
      if (prefix_cache_bytes > 0)
        session_ = std::make_unique<cuda::GpuGenerationSession>(*dw_, prefix_cache_bytes);
    }
#else
    (void)fp32, (void)prefix_cache_bytes;
#endif
  }

  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const GenerateOptions& go,
                                const std::function<void(int32_t)>& on_token) {
#if DELTAMOE_HAVE_CUDA
    if (session_) return session_->generate(prompt, go, on_token);
    if (dw_) return cuda::generate_gpu(*dw_, prompt, go, on_token);
    if (gpu_fp32_) return cuda::generate_gpu_fp32(*gpu_fp32_, prompt, go, on_token);
#endif
    return dm::generate(model_, prompt, go, on_token);
  }

 private:
  Model& model_;
#if DELTAMOE_HAVE_CUDA
  std::unique_ptr<cuda::DeviceWeights> dw_;
  std::unique_ptr<cuda::GpuModel> gpu_fp32_;
  std::unique_ptr<cuda::GpuGenerationSession> session_;  // after dw_: destroyed first
#endif
};

}  // namespace dm::cli
