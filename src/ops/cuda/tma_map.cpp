// cuTensorMapEncodeTiled through the runtime's driver entry point (tma_map.h).
#include "ops/cuda/tma_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace dm::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol,
                                                                12000, cudaEnableDefault, &found);
    DM_CHECK(status == cudaSuccess && found == cudaDriverEntryPointSuccess && symbol != nullptr,
             "tma_map: the driver has no cuTensorMapEncodeTiled (", cudaGetErrorString(status),
             ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(symbol);
  }();
  return fn;
}

}  // namespace

bool tma_map_bf16_applies(const void* base, uint64_t row_stride) {
  return base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride % 8 == 0;
}

CUtensorMap tma_map_bf16_rows(const void* base, uint64_t rows, uint64_t cols, uint64_t row_stride,
                              uint32_t box_rows, uint32_t box_cols) {
  DM_CHECK(tma_map_bf16_applies(base, row_stride) && row_stride >= cols,
           "tma_map_bf16_rows: needs a 16-byte aligned base and rows a multiple of 8 elements "
           "apart (at least cols), got cols = ",
           cols, ", row stride ", row_stride);
  DM_CHECK(rows > 0 && rows < (uint64_t(1) << 32) && cols < (uint64_t(1) << 32),
           "tma_map_bf16_rows: ", rows, " x ", cols, " is outside the TMA's extents");
  DM_CHECK(box_rows >= 1 && box_rows <= 256 && box_cols >= 8 && box_cols * 2 <= 128,
           "tma_map_bf16_rows: box ", box_rows, " x ", box_cols,
           " (rows ≤ 256, at most 128 bytes of columns for the 128-byte swizzle)");
  CUtensorMap map{};
  const cuuint64_t extent[2] = {cols, rows};            // innermost first
  const cuuint64_t stride_bytes[1] = {row_stride * 2};  // from one row to the next
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_stride[2] = {1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), extent, stride_bytes, box,
      element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DM_CHECK(result == CUDA_SUCCESS, "tma_map_bf16_rows: cuTensorMapEncodeTiled failed (CUresult ",
           int(result), ") for ", rows, " x ", cols, ", box ", box_rows, " x ", box_cols);
  return map;
}

}  // namespace dm::cuda
