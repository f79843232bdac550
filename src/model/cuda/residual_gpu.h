// The residual stream's own operations on the device, for residual_stack_forward
// (model/residual.h): fp32 stream, bf16 normed rows (fp32 in the fp32 GPU mode); weight
// arguments are HOST views mapped to their device mirrors. Shared by the GPU forward
// (model_gpu.cpp) and the GPU decode step.
#pragma once
#include <cstdint>
#include <type_traits>

#include "model/cuda/gpu_run.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {

// Normed: the sub-layers' input rows, bf16 (uint16_t) or fp32 (the fp32 GPU mode).
template <typename Normed_>
struct GpuResidualOpsT {
  using Normed = Normed_;
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
  void rmsnorm(const float* x, const float* w, Normed* y, int64_t N, int64_t d, float eps) const {
    if constexpr (std::is_same_v<Normed, float>)
      rmsnorm_to_f32(x, dw->f32(w), y, N, d, eps, stream);
    else
      rmsnorm_to_bf16(x, dw->f32(w), y, N, d, eps, stream);
  }
  // The walk's fused p += out, xn = RMSNorm(p) (model/residual.h; used without AttnRes).
  void add_rmsnorm(float* p, const float* out, const float* w, Normed* y, int64_t N, int64_t d,
                   float eps) const {
    if constexpr (std::is_same_v<Normed, float>)
      add_rmsnorm_to_f32(p, out, dw->f32(w), y, N, d, eps, stream);
    else
      add_rmsnorm_to_bf16(p, out, dw->f32(w), y, N, d, eps, stream);
  }
};
using GpuResidualOps = GpuResidualOpsT<uint16_t>;

}  // namespace dm::cuda
