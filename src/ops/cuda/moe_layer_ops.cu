// Kernels of moe_layer_ops.h (see there). Memory-bound element-wise work: one thread per element,
// grid-stride, coalesced loads and stores.
#include <algorithm>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/moe_layer_ops.h"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void convert_f32_to_bf16_kernel(const float* x, uint16_t* y, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store_from_float(y, i, x[i]);
}

}  // namespace

void convert_f32_to_bf16(const float* x, uint16_t* y, int64_t n, CUstream_st* stream) {
  DM_CHECK(n >= 0, "convert_f32_to_bf16: negative length ", n);
  if (n == 0) return;
  DM_CHECK(x && y, "convert_f32_to_bf16: null argument");
  // Enough blocks to fill the GPU; the grid-stride loop covers any n.
  const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
  convert_f32_to_bf16_kernel<<<blocks, kThreads, 0, stream>>>(x, y, n);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda
