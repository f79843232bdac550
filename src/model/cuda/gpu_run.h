// What a model forward on the GPU shares across its layers (SPEC §5 GPU path): the device copy of
// the weights and the per-run resources (cuBLAS handles, one scratch arena, the stream).
//
// DeviceWeights mirrors the host weight arena as bf16 (GEMM operands, the embedding table) at the
// SAME element offsets as the host arena, and keeps an fp32 copy of the parameters read
// element-wise (norm weights, gates, biases, A_log, dt_bias, short-conv kernels, AttnRes
// pseudo-queries: everything but the N(0,σ)-initialised matrices), packed. A layer keeps using
// the host views of model/weights.h (LayerWeights::kda.q_proj …) and maps each to its device twin
// with bf16(p) / f32(p); f32() of a matrix is an error. Weights cost 2 bytes per parameter plus 4
// per element-wise one; one cudaMalloc for both. The routing bias changes during training:
// sync_from_host() re-uploads everything.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/weights.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"

namespace dm::cuda {

class DeviceWeights {
 public:
  // One fp32-mirrored parameter: host offsets [begin, end) → packed offset.
  struct F32Range {
    int64_t begin, end, packed;
  };
  explicit DeviceWeights(const ModelWeights& host);
  // Device twin of a host parameter view (any pointer inside the host arena).
  const uint16_t* bf16(const float* host_view) const { return bf16_ + offset(host_view); }
  const float* f32(const float* host_view) const;
  const ModelWeights& host() const { return host_; }
  const ModelConfig& config() const { return host_.cfg; }
  void sync_from_host();
  size_t bytes() const { return arena_.capacity(); }

 private:
  int64_t offset(const float* p) const;
  const ModelWeights& host_;
  int64_t numel_ = 0;
  std::vector<F32Range> f32_ranges_;  // sorted by begin
  int64_t f32_numel_;
  DeviceArena arena_;
  uint16_t* bf16_ = nullptr;
  float* f32_ = nullptr;
};

// Per-run resources: cuBLAS(Lt) handles + workspace, one scratch arena that layers carve their
// temporaries from inside a DeviceArenaScope, and the stream everything is queued on.
struct GpuRun {
  explicit GpuRun(size_t scratch_bytes, CUstream_st* stream_ = nullptr)
      : scratch(scratch_bytes), stream(stream_) {}
  GemmContext gemm;
  DeviceArena scratch;
  CUstream_st* stream = nullptr;
};

// y[N, out] = x[N, in] · W[out, in]ᵀ (bf16 operands, fp32 accumulate; y bf16 or fp32 per y_type;
// beta = 1 accumulates into an fp32/bf16 y).
void linear(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta = 0.0f);

}  // namespace dm::cuda
