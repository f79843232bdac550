// Host side of the TMA (tma.cuh): tensor maps of row-major bf16 matrices, encoded through the
// driver's cuTensorMapEncodeTiled (reached with cudaGetDriverEntryPointByVersion, so nothing links
// libcuda directly).
#pragma once
#include <cuda.h>

#include <cstdint>

namespace dm::cuda {

// A [rows][cols] row-major bf16 matrix at `base` with rows row_stride elements apart
// (≥ cols; base 16-byte aligned and row_stride a multiple of 8: the TMA wants 16-byte row
// strides), read in boxes of box_rows × box_cols (box_cols · 2 ≤ 128 bytes, box_rows ≤ 256)
// laid out in shared memory with the 128-byte swizzle of wgmma.cuh's tiles (a box of 64 columns
// is one K-major row per line, or one MN-major atom of box_rows k lines). Elements past rows or
// cols read as zeros. Throws dm::Error on a bad shape or a driver failure.
CUtensorMap tma_map_bf16_rows(const void* base, uint64_t rows, uint64_t cols, uint64_t row_stride,
                              uint32_t box_rows, uint32_t box_cols);

// `batches` such matrices [rows][cols] one after another (each rows·cols elements, cols a
// multiple of 8), as a 3-D map (x = column, y = row, z = matrix): a box never reads into the next
// matrix; rows past `rows` and columns past `cols` read as zeros. The expert weights [E][K][N]
// whose k rows a product steps through.
CUtensorMap tma_map_bf16_batched(const void* base, uint64_t batches, uint64_t rows, uint64_t cols,
                                 uint32_t box_rows, uint32_t box_cols);

// A [rows][cols] row-major fp32 matrix at `base` (rows row_stride elements apart, both 16-byte
// multiples), read in unswizzled boxes of box_rows × box_cols with box_cols ≥ the columns a
// reader wants: the box lands densely in shared memory, so box_cols is also the shared row
// stride, and a box wider than the columns left (past `cols`) pads each row with zeros. This is
// how the KDA state kernels get their bank-conflict padding (rows of KP + 4 or KP + 8 floats)
// from one copy. box_cols ≤ 256 and a multiple of 4, box_rows ≤ 256.
CUtensorMap tma_map_f32_rows(const void* base, uint64_t rows, uint64_t cols, uint64_t row_stride,
                             uint32_t box_rows, uint32_t box_cols);

// One head's rows of a [B][T][H][V] bf16 tensor (V % 8 == 0, base 16-byte aligned) as a 4-D map
// (x = column, y = head, z = token, w = batch), read in unswizzled boxes of box_tokens tokens ×
// box_cols columns of one head (box_cols a multiple of 8, ≤ 256): dense [box_tokens][box_cols] in
// shared memory; tokens past T and columns past V read as zeros (never the next sequence's).
CUtensorMap tma_map_bf16_head_rows(const void* base, uint64_t B, uint64_t T, uint64_t H, uint64_t V,
                                   uint32_t box_tokens, uint32_t box_cols);

// Whether tma_map_bf16_rows accepts a matrix at `base` with rows `row_stride` elements apart.
bool tma_map_bf16_applies(const void* base, uint64_t row_stride);

}  // namespace dm::cuda
