// Warp-level tensor-core building blocks for the attention kernels (attention*.cu): bf16
// mma.sync m16n8k16 with fp32 accumulators, ldmatrix fragment loads from shared memory and
// cp.async tile copies. Included only by nvcc-compiled files.
//
// Fragment layouts of mma.m16n8k16 (PTX ISA), lane = 4·g + tq (g = lane/4 ∈ [0,8), tq ∈ [0,4)):
//   A [16 rows × 16 k] : a[0] = (row g,   k 2tq..2tq+1)   a[1] = (row g+8, k 2tq..2tq+1)
//                        a[2] = (row g,   k 2tq+8..+9)    a[3] = (row g+8, k 2tq+8..+9)
//   B [16 k × 8 cols]  : b[0] = (k 2tq..2tq+1, col g)     b[1] = (k 2tq+8..+9, col g)
//   C [16 rows × 8 cols] fp32: c[0..1] = (row g, cols 2tq, 2tq+1), c[2..3] = (row g+8, same cols)
// Each 32-bit register holds two bf16, the lower k (or column) index in the low half.
//
// Shared-memory tiles are row-major bf16 with a row stride of (D + 8) elements: 16 bytes of
// padding put the 8 rows of one ldmatrix phase on 8 distinct 16-byte bank groups (no conflicts).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dm::cuda::attention_detail {

// Extra bf16 elements per shared-memory row (see the header comment).
constexpr int kSmemRowPad = 8;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// d += a·b for one 16×8 output tile (bf16 inputs, fp32 accumulate).
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i
// receives matrix i in the "row g, columns 2tq..2tq+1" distribution.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem_row))
               : "memory");
}
// Same with each matrix transposed: register i receives (stored row 2tq and 2tq+1, column g).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem_row))
               : "memory");
}

// Lane address offsets (row, column) inside a 16×16 block of a row-major smem tile, for the
// three ways the kernels read fragments:
//  * A operand (16 rows × 16 k, k contiguous), registers = a[0..3]:
//      row = lane % 16, col = (lane / 16)·8.
//  * B operand for two 8-column tiles when the smem tile is stored [col][k] (k contiguous,
//    e.g. K rows for S = Q·Kᵀ), non-transposed load; registers = {b0,b1} of column tile 0 then
//    of column tile 1:  row = (lane % 8) + (lane / 16)·8, col = ((lane / 8) % 2)·8.
//  * B operand for two 8-column tiles when the smem tile is stored [k][col] (columns contiguous,
//    e.g. V rows for O = P·V), transposed load; same register order:
//      row = (lane % 8) + ((lane / 8) % 2)·8, col = (lane / 16)·8.
struct LaneOffsets {
  int a_row, a_col;
  int b_row, b_col;    // [col][k] storage, ldmatrix (non-trans)
  int bt_row, bt_col;  // [k][col] storage, ldmatrix.trans
  __device__ __forceinline__ explicit LaneOffsets(int lane)
      : a_row(lane & 15),
        a_col((lane >> 4) << 3),
        b_row((lane & 7) + ((lane >> 4) << 3)),
        b_col(((lane >> 3) & 1) << 3),
        bt_row((lane & 7) + (((lane >> 3) & 1) << 3)),
        bt_col((lane >> 4) << 3) {}
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Converts two adjacent 16×8 fp32 C tiles (columns 16kk..16kk+15) into the A fragment of a
// 16×16 bf16 operand whose k index is that column range (FlashAttention-2's register reuse).
__device__ __forceinline__ void c_tiles_to_a_fragment(const float (&c0)[4], const float (&c1)[4],
                                                      uint32_t (&a)[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

// 2^x (ex2.approx: relative error ~2^-22; 2^-inf = +0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max / sum over the four lanes of a quad (the lanes that share one C-fragment row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// 16-byte global → shared copy that bypasses registers; when !valid the 16 shared bytes are
// zero-filled and nothing is read (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Copies rows [row_begin, row_begin + kRows) of one (batch, head) slice into a padded smem tile
// [kRows][kD + kSmemRowPad] asynchronously. Global row t starts at base + t·row_stride (elements)
// and holds `D` valid values (D % 8 == 0); rows t ≥ T and columns ≥ D are zero-filled.
// One step of the online softmax over an S tile held as mma C fragments: s [kScoreTiles][4]
// holds this thread's entries of rows g (half 0) and g+8 (half 1), log2-scaled. Updates the
// running row max/sum, rescales the output accumulator o_acc [kOutTiles][4] and turns s into
// P = exp2(s − max). A row that has seen no visible key yet keeps max −inf; it then uses 0 as
// the reference so no exp2(−inf − (−inf)) = NaN is formed.
template <int kScoreTiles, int kOutTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[kScoreTiles][4],
                                                    float (&o_acc)[kOutTiles][4],
                                                    float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < kScoreTiles; ++n)
      tile_max = fmaxf(tile_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    tile_max = quad_max(tile_max);
    const float new_max = fmaxf(row_max[half], tile_max);
    const float reference = new_max == -INFINITY ? 0.0f : new_max;
    const float correction = fast_exp2(row_max[half] - reference);
    row_max[half] = new_max;
    float tile_sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kScoreTiles; ++n) {
      const float p0 = fast_exp2(s[n][2 * half] - reference);
      const float p1 = fast_exp2(s[n][2 * half + 1] - reference);
      s[n][2 * half] = p0;
      s[n][2 * half + 1] = p1;
      tile_sum += p0 + p1;
    }
    row_sum[half] = row_sum[half] * correction + tile_sum;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      o_acc[n][2 * half] *= correction;
      o_acc[n][2 * half + 1] *= correction;
    }
  }
}

template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_rows_async(__nv_bfloat16* smem, const __nv_bfloat16* base,
                                                int64_t row_stride, int row_begin, int T, int D) {
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kStride = kD + kSmemRowPad;
  for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, d = (chunk % kChunksPerRow) * 8;
    const int t = row_begin + r;
    const bool valid = t < T && d < D;
    const __nv_bfloat16* src = valid ? base + int64_t(t) * row_stride + d : base;
    cp_async_16(smem + r * kStride + d, src, valid);
  }
}

// Adds a [rows of this lane's C fragments] fp32 tile into bf16 global memory: element (row, col)
// of the tile lives at dst + row·row_stride + col. Columns are written in pairs (D is even).
// rows ≥ valid_rows or cols ≥ valid_cols are skipped. Accumulating, like every backward here.
template <int kColTiles>
__device__ __forceinline__ void accumulate_c_tiles_to_global(const float (&acc)[kColTiles][4],
                                                             __nv_bfloat16* dst,
                                                             int64_t row_stride, int row0,
                                                             int valid_rows, int valid_cols,
                                                             float scale, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int n = 0; n < kColTiles; ++n) {
    const int col = n * 8 + 2 * tq;
    if (col >= valid_cols) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + g + half * 8;
      if (row >= valid_rows) continue;
      __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(dst + int64_t(row) * row_stride + col);
      const float2 old = __bfloat1622float2(*p);
      *p = __floats2bfloat162_rn(old.x + scale * acc[n][2 * half],
                                 old.y + scale * acc[n][2 * half + 1]);
    }
  }
}

}  // namespace dm::cuda::attention_detail
