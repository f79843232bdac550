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

// The checks and the encode call shared by both map shapes (rank 2 or 3, innermost first).
CUtensorMap encode_bf16(const char* who, const void* base, uint32_t rank, const cuuint64_t* extent,
                        const cuuint64_t* stride_bytes, uint32_t box_rows, uint32_t box_cols) {
  DM_CHECK(box_rows >= 1 && box_rows <= 256 && box_cols >= 8 && box_cols * 2 <= 128, who, ": box ",
           box_rows, " x ", box_cols,
           " (rows ≤ 256, at most 128 bytes of columns for the 128-byte swizzle)");
  for (uint32_t d = 0; d < rank; ++d)
    DM_CHECK(extent[d] > 0 && extent[d] < (uint64_t(1) << 32), who, ": extent ", extent[d],
             " in dimension ", d, " is outside the TMA's range");
  CUtensorMap map{};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t element_stride[3] = {1, 1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), extent, stride_bytes,
      box, element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DM_CHECK(result == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed (CUresult ", int(result),
           ") for extents ", extent[0], " x ", extent[1], ", box ", box_rows, " x ", box_cols);
  return map;
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
  const cuuint64_t extent[2] = {cols, rows};            // innermost first
  const cuuint64_t stride_bytes[1] = {row_stride * 2};  // from one row to the next
  return encode_bf16("tma_map_bf16_rows", base, 2, extent, stride_bytes, box_rows, box_cols);
}

CUtensorMap tma_map_f32_rows(const void* base, uint64_t rows, uint64_t cols, uint64_t row_stride,
                             uint32_t box_rows, uint32_t box_cols) {
  DM_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride % 4 == 0 &&
               row_stride >= cols && cols % 4 == 0,
           "tma_map_f32_rows: needs a 16-byte aligned base and rows a multiple of 4 floats apart, "
           "got cols = ",
           cols, ", row stride ", row_stride);
  DM_CHECK(
      box_rows >= 1 && box_rows <= 256 && box_cols >= 4 && box_cols <= 256 && box_cols % 4 == 0,
      "tma_map_f32_rows: box ", box_rows, " x ", box_cols,
      " (rows ≤ 256, columns ≤ 256 and a multiple of 4)");
  DM_CHECK(rows > 0 && rows < (uint64_t(1) << 32) && cols > 0, "tma_map_f32_rows: extent ", rows,
           " x ", cols, " outside the TMA's range");
  const cuuint64_t extent[2] = {cols, rows};
  const cuuint64_t stride_bytes[1] = {row_stride * 4};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_stride[2] = {1, 1};
  CUtensorMap map{};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<void*>(base), extent, stride_bytes, box,
      element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DM_CHECK(result == CUDA_SUCCESS, "tma_map_f32_rows: cuTensorMapEncodeTiled failed (CUresult ",
           int(result), ") for extents ", cols, " x ", rows, ", box ", box_rows, " x ", box_cols);
  return map;
}

CUtensorMap tma_map_bf16_head_rows(const void* base, uint64_t B, uint64_t T, uint64_t H, uint64_t V,
                                   uint32_t box_tokens, uint32_t box_cols) {
  DM_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0 && V % 8 == 0 && B > 0 &&
               T > 0 && H > 0 && B < (uint64_t(1) << 32) && T < (uint64_t(1) << 32) &&
               H < (uint64_t(1) << 32),
           "tma_map_bf16_head_rows: needs a 16-byte aligned base and V % 8 == 0, got V = ", V);
  DM_CHECK(
      box_tokens >= 1 && box_tokens <= 256 && box_cols >= 8 && box_cols <= 256 && box_cols % 8 == 0,
      "tma_map_bf16_head_rows: box ", box_tokens, " x ", box_cols);
  const cuuint64_t extent[4] = {V, H, T, B};
  const cuuint64_t stride_bytes[3] = {V * 2, H * V * 2, T * H * V * 2};
  const cuuint32_t box[4] = {box_cols, 1, box_tokens, 1};
  const cuuint32_t element_stride[4] = {1, 1, 1, 1};
  CUtensorMap map{};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), extent, stride_bytes, box,
      element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DM_CHECK(result == CUDA_SUCCESS,
           "tma_map_bf16_head_rows: cuTensorMapEncodeTiled failed "
           "(CUresult ",
           int(result), ")");
  return map;
}

CUtensorMap tma_map_bf16_batched(const void* base, uint64_t batches, uint64_t rows, uint64_t cols,
                                 uint32_t box_rows, uint32_t box_cols) {
  DM_CHECK(tma_map_bf16_applies(base, cols),
           "tma_map_bf16_batched: needs a 16-byte aligned base and a multiple of 8 columns, got ",
           cols);
  const cuuint64_t extent[3] = {cols, rows, batches};
  const cuuint64_t stride_bytes[2] = {cols * 2, rows * cols * 2};  // next row, next matrix
  return encode_bf16("tma_map_bf16_batched", base, 3, extent, stride_bytes, box_rows, box_cols);
}

}  // namespace dm::cuda
