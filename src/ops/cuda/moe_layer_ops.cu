// Kernels of moe_layer_ops.h (see there). Memory-bound element-wise work: one thread per element
// (four when the pointers allow 16-byte loads), grid-stride, coalesced loads and stores.
#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/moe_layer_ops.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void convert_f32_to_bf16_kernel(const float* x, uint16_t* y, int64_t n) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store_from_float(y, i, x[i]);
}

// n % 4 == 0, x 16-byte and y 8-byte aligned: one float4 in, four bf16 (8 bytes) out per step
// (the scalar kernel moved 6 bytes per thread and step: 1.3 TB/s at 8M elements on the H200).
// Rows: with width > 0, x's element (group) i goes to y at (i / width)·ld + i % width, in the
// kernel's units (elements, or groups of 4); width 0: y contiguous.
struct ConvertRows {
  int64_t width = 0, ld = 0;
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    return width == 0 ? i : i / width * ld + i % width;
  }
};

__global__ void convert_f32_to_bf16_rows_kernel(const float* x, uint16_t* y, int64_t n,
                                                ConvertRows at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store_from_float(y, at(i), x[i]);
}

__global__ void convert_f32_to_bf16_vec4_kernel(const float4* x, uint2* y, int64_t n4,
                                                ConvertRows at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += stride) {
    const float4 v = x[i];
    const uint32_t lo = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v.x))) |
                        (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v.y))) << 16);
    const uint32_t hi = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v.z))) |
                        (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v.w))) << 16);
    y[at(i)] = make_uint2(lo, hi);
  }
}

}  // namespace

void convert_f32_to_bf16(const float* x, uint16_t* y, int64_t n, CUstream_st* stream) {
  DM_CHECK(n >= 0, "convert_f32_to_bf16: negative length ", n);
  if (n == 0) return;
  DM_CHECK(x && y, "convert_f32_to_bf16: null argument");
  // Enough blocks to fill the GPU; the grid-stride loop covers any n.
  const auto aligned = [](const void* p, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  if (n % 4 == 0 && aligned(x, 16) && aligned(y, 8)) {
    const int64_t n4 = n / 4;
    const int blocks = int(std::min<int64_t>((n4 + kThreads - 1) / kThreads, 65536));
    launch_pdl(convert_f32_to_bf16_vec4_kernel, blocks, kThreads, 0, stream,
               reinterpret_cast<const float4*>(x), reinterpret_cast<uint2*>(y), n4, ConvertRows{});
    DM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
  launch_pdl(convert_f32_to_bf16_kernel, blocks, kThreads, 0, stream, x, y, n);
  DM_CUDA_CHECK(cudaGetLastError());
}

void convert_f32_to_bf16_rows(const float* x, uint16_t* y, int64_t rows, int64_t width,
                              int64_t ld_y, CUstream_st* stream) {
  DM_CHECK(rows >= 0 && width > 0 && ld_y >= width,
           "convert_f32_to_bf16_rows: bad shape rows=", rows, " width=", width, " ld=", ld_y);
  if (rows == 0) return;
  DM_CHECK(x && y, "convert_f32_to_bf16_rows: null argument");
  const int64_t n = rows * width;
  if (width % 4 == 0 && ld_y % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(y) % 8 == 0) {
    const int64_t n4 = n / 4;
    const int blocks = int(std::min<int64_t>((n4 + kThreads - 1) / kThreads, 65536));
    launch_pdl(convert_f32_to_bf16_vec4_kernel, blocks, kThreads, 0, stream,
               reinterpret_cast<const float4*>(x), reinterpret_cast<uint2*>(y), n4,
               ConvertRows{width / 4, ld_y / 4});
  } else {
    const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
    launch_pdl(convert_f32_to_bf16_rows_kernel, blocks, kThreads, 0, stream, x, y, n,
               ConvertRows{width, ld_y});
  }
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda
