// The residual stream's own operations on the device, for residual_stack_forward
// (model/residual.h): fp32 stream, bf16 normed rows; weight arguments are HOST views mapped to
// their device mirrors. Shared by the GPU forward (model_gpu.cpp) and the GPU decode step.
#pragma once
#include <cstdint>

#include "model/cuda/gpu_run.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {

struct GpuResidualOps {
  using Normed = uint16_t;
  const DeviceWeights* dw;
  CUstream_st* stream;
  void copy(float* dst, const float* src, int64_t n) const {
    copy_device_to_device(dst, src, size_t(n) * sizeof(float));
  }
  void add(float* dst, const float* src, int64_t n) const { add_inplace(dst, src, n, stream); }
  void attnres(const float* const* src, int S, const float* query, const float* norm, float* out,
               int64_t N, int64_t d, float eps) const {
    attnres_forward(src, S, dw->f32(query), dw->f32(norm), out, N, d, eps, stream);
  }
  void rmsnorm(const float* x, const float* w, uint16_t* y, int64_t N, int64_t d,
               float eps) const {
    rmsnorm_to_bf16(x, dw->f32(w), y, N, d, eps, stream);
  }
  // The walk's fused p += out, xn = RMSNorm(p) (model/residual.h; used without AttnRes).
  void add_rmsnorm(float* p, const float* out, const float* w, uint16_t* y, int64_t N, int64_t d,
                   float eps) const {
    add_rmsnorm_to_bf16(p, out, dw->f32(w), y, N, d, eps, stream);
  }
};

}  // namespace dm::cuda
