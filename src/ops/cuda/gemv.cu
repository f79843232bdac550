// Few-row bf16 GEMV (gemv.h). A block of kWarps warps owns kCols consecutive outputs n (rows of
// W) for all M rows of x; its warps split K in kWarps ranges (split-K inside the block), so every
// load of a weight row is issued in the block's first step for K ≤ kWarps·kUnroll·32·8 = 4096
// (a warp's range is then at most kUnroll·32 16-byte chunks: one step of kUnroll predicated loads
// per lane and column). (With one warp walking all of K the loads came in four dependent
// rounds and a [2304, 4096] weight streamed at 1.5 TB/s.) x's matching chunks hit L1: every warp
// of the block reads the same x. fp32 sums, reduced across the warp with shuffles and across
// the warps in shared memory. The weights are read with evict-first loads: nothing in one decode
// step reads a weight twice. When two outputs per block would need a second, nearly empty wave
// of blocks, a block takes four. Small K (≤ 256, K/8 a power of two) goes to its own kernel:
// a row per K/8 adjacent lanes, several rows per thread.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kWarps = 4;   // K ranges per block
constexpr int kUnroll = 4;  // 16-byte chunks per lane and column in one step
constexpr int kChunk = 8;   // bf16 per 16-byte load
// Small K (gemv_small_k_kernel): rows per thread, each one 16-byte load in flight.
constexpr int kSmallKRowsPerThread = 4;
constexpr int kSmallKMaxK = 32 * kChunk;  // a row's chunks fit one warp

__device__ __forceinline__ float bf16_lo(uint32_t bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t bits) {
  return __uint_as_float(bits & 0xffff0000u);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
  acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
  acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
  acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
  acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
  acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
  acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
  acc = fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
  return acc;
}

__device__ __forceinline__ void store_out(float* y, float v, float beta) {
  *y = beta != 0.0f ? fmaf(beta, *y, v) : v;
}
__device__ __forceinline__ void store_out(__nv_bfloat16* y, float v, float beta) {
  *y = __float2bfloat16(beta != 0.0f ? fmaf(beta, __bfloat162float(*y), v) : v);
}

// The products of one launch (gemv.h GemvOutput), with the first block of each: blocks
// [block_begin[i], block_begin[i + 1]) compute the outputs of product i (kCols or, for small K,
// a block's rows each).
struct GemvBatch {
  const uint16_t* W[kGemvMaxOutputs];
  void* y[kGemvMaxOutputs];
  int64_t ldw[kGemvMaxOutputs], N[kGemvMaxOutputs], ldy[kGemvMaxOutputs];
  int block_begin[kGemvMaxOutputs + 1];
  bool f32[kGemvMaxOutputs];
  int count;
};

// Blocks an SM must hold of gemv_bf16_kernel<kRows, kCols, ·> (its __launch_bounds__): one row,
// four outputs per block at ≤ 96 registers (115 without the bound; ptxas spills nothing at 96)
// fits 5 blocks an SM, 660 on an H200, so N = 2304 (the KDA and MLA W_o: 576 blocks) runs in one
// wave instead of two waves of two-output blocks (1152 against 1056 resident). Two or more rows
// at four outputs spill under the same bound: they keep 1.
constexpr int gemv_min_blocks(int rows, int cols) { return rows == 1 && cols == 4 ? 5 : 1; }

template <int kRows, int kCols, bool kRegisterPrefetch>
__global__ void __launch_bounds__(kWarps * 32, gemv_min_blocks(kRows, kCols))
    gemv_bf16_kernel(const uint16_t* __restrict__ x, int64_t ldx, int64_t K, float alpha,
                     float beta, const GemvBatch batch) {
  __shared__ float partial[kWarps][kRows * kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int target = 0;
  while (target + 1 < batch.count && int(blockIdx.x) >= batch.block_begin[target + 1]) ++target;
  const uint16_t* __restrict__ W = batch.W[target];
  const int64_t ldw = batch.ldw[target], N = batch.N[target], ldy = batch.ldy[target];
  const int64_t n0 = int64_t(int(blockIdx.x) - batch.block_begin[target]) * kCols;
  // A column past N re-reads the last row (in bounds) and is not written.
  const uint4* w_rows[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    w_rows[c] = reinterpret_cast<const uint4*>(W + (n0 + c < N ? n0 + c : N - 1) * ldw);
  const uint4* x_rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) x_rows[r] = reinterpret_cast<const uint4*>(x + r * ldx);

  float acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;

  // This warp's chunks (of 8 elements): [begin, end); lane takes begin + lane + 32·i.
  const int64_t chunks = K / kChunk, per_warp = (chunks + kWarps - 1) / kWarps;
  const int64_t begin = warp * per_warp, end = begin + per_warp < chunks ? begin + per_warp : chunks;
  // PDL (pdl.h): the first step's weight chunks are requested before the wait for x (no kernel
  // writes W): by default loaded into the first step's registers, or (DM_GEMV_PREFETCH=l2)
  // prefetched into L2, which holds no registers (the one-row four-column kernel: 84 against
  // 115, so it fits 6 blocks an SM instead of 4) but was slower end to end: Kimi-Linear-48B
  // decode 1 x 32K 2.768 / 2.775 ms against 2.652 / 2.703 with registers (H200).
  bool waited = !kRegisterPrefetch;  // every thread waits once: here, in the loop or after it
  if constexpr (!kRegisterPrefetch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        if (begin + lane + u * 32 < end) prefetch_l2(w_rows[c] + begin + lane + u * 32);
    pdl_wait_then_launch_dependents();
  }
  for (int64_t j = begin + lane; j < end; j += kUnroll * 32) {
    uint4 wv[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        wv[u][c] = j + u * 32 < end ? __ldcs(w_rows[c] + j + u * 32) : make_uint4(0u, 0u, 0u, 0u);
    if (!waited) {
      pdl_wait_then_launch_dependents();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * 32 >= end) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint4 xv = __ldg(x_rows[r] + j + u * 32);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = dot8(xv, wv[u][c], acc[r][c]);
      }
    }
  }
  if (!waited) pdl_wait_then_launch_dependents();

#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float v = warp_sum(acc[r][c]);
      if (lane == 0) partial[warp][r * kCols + c] = v;
    }
  __syncthreads();
  if (threadIdx.x < kRows * kCols) {
    const int r = threadIdx.x / kCols, c = threadIdx.x % kCols;
    if (n0 + c < N) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][threadIdx.x];
      const int64_t at = r * ldy + n0 + c;
      if (batch.f32[target])
        store_out(static_cast<float*>(batch.y[target]) + at, alpha * sum, beta);
      else
        store_out(static_cast<__nv_bfloat16*>(batch.y[target]) + at, alpha * sum, beta);
    }
  }
}

// Small K (K ≤ kSmallKMaxK, K/8 a power of two): a row's kLanes = K/8 chunks take kLanes
// adjacent lanes, so a warp covers 32/kLanes consecutive rows per pass and every lane loads;
// each thread takes kSmallKRowsPerThread rows, their loads in flight together. Sums: shuffles
// within each lane segment, in a fixed order. (The split-K kernel above left 28 of a warp's 32
// lanes idle at K = 128, the KDA gates' up-projections, and ran two waves of 2048 blocks.)
template <int kRows, int kLanes>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_small_k_kernel(const uint16_t* __restrict__ x, int64_t ldx, float alpha, float beta,
                        const GemvBatch batch) {
  constexpr int kRowsPerPass = 32 / kLanes;
  constexpr int kBlockRows = kWarps * kRowsPerPass * kSmallKRowsPerThread;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = lane % kLanes, slot = lane / kLanes;
  int target = 0;
  while (target + 1 < batch.count && int(blockIdx.x) >= batch.block_begin[target + 1]) ++target;
  const uint16_t* __restrict__ W = batch.W[target];
  const int64_t ldw = batch.ldw[target], N = batch.N[target], ldy = batch.ldy[target];
  const int64_t row0 = int64_t(int(blockIdx.x) - batch.block_begin[target]) * kBlockRows;
  int64_t rows[kSmallKRowsPerThread];
  uint4 wv[kSmallKRowsPerThread];
#pragma unroll
  for (int u = 0; u < kSmallKRowsPerThread; ++u) {
    rows[u] = row0 + (u * kWarps + warp) * kRowsPerPass + slot;
    // A row past N re-reads the last row (in bounds) and is not written.
    const int64_t row = rows[u] < N ? rows[u] : N - 1;
    wv[u] = __ldcs(reinterpret_cast<const uint4*>(W + row * ldw) + chunk);
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): the weights are in flight; x comes after
  float acc[kRows][kSmallKRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + r * ldx) + chunk);
#pragma unroll
    for (int u = 0; u < kSmallKRowsPerThread; ++u) acc[r][u] = dot8(xv, wv[u], 0.0f);
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1)
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kSmallKRowsPerThread; ++u)
        acc[r][u] += __shfl_xor_sync(0xffffffffu, acc[r][u], o);
  if (chunk != 0) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int u = 0; u < kSmallKRowsPerThread; ++u) {
      if (rows[u] >= N) continue;
      const int64_t at = r * ldy + rows[u];
      if (batch.f32[target])
        store_out(static_cast<float*>(batch.y[target]) + at, alpha * acc[r][u], beta);
      else
        store_out(static_cast<__nv_bfloat16*>(batch.y[target]) + at, alpha * acc[r][u], beta);
    }
}

// How one launch covers its products: the small-K kernel with kLanes = K/8, or the split-K
// kernel with `cols` outputs per block.
struct GemvShape {
  bool small_k = false;
  int lanes = 0, cols = 2;
  int64_t outputs_per_block() const {
    return small_k ? int64_t(kWarps) * (32 / lanes) * kSmallKRowsPerThread : cols;
  }
};

// DM_GEMV_COLUMNS=auto|2: `2` keeps two outputs per block even where four would save a wave
// (the A/B of gemv_min_blocks' bound).
bool gemv_four_columns_allowed() {
  static const bool allowed = env_choice("DM_GEMV_COLUMNS", {"auto", "2"}) == 0;
  return allowed;
}

bool gemv_register_prefetch() {
  static const bool registers = env_choice("DM_GEMV_PREFETCH", {"registers", "l2"}) == 0;
  return registers;
}

template <int kRows, int kCols>
int resident_blocks() {  // per GPU, for one launch of gemv_bf16_kernel<kRows, kCols, ·>
  static const int blocks = [] {
    int device = 0, sms = 0, per_sm = 0;
    DM_CUDA_CHECK(cudaGetDevice(&device));
    DM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm,
        gemv_register_prefetch() ? gemv_bf16_kernel<kRows, kCols, true>
                                 : gemv_bf16_kernel<kRows, kCols, false>,
        kWarps * 32, 0));
    return sms * per_sm;
  }();
  return blocks;
}

template <int kRows>
int resident_blocks(int cols) {
  return cols == 4 ? resident_blocks<kRows, 4>() : resident_blocks<kRows, 2>();
}

int resident_blocks(int64_t M, int cols) {
  switch (M) {
    case 1:
      return resident_blocks<1>(cols);
    case 2:
      return resident_blocks<2>(cols);
    case 3:
      return resident_blocks<3>(cols);
    default:
      return resident_blocks<4>(cols);
  }
}

// Small K when a row's chunks divide a warp. Otherwise two outputs per block, unless that grid
// needs a second wave that four outputs per block would avoid: the second wave of a
// latency-bound GEMV costs as much as the first (N = 2304: 1152 blocks against 1056 resident at
// two outputs per block on an H200).
GemvShape choose_shape(int64_t M, int64_t K, const GemvOutput* outputs, int count) {
  GemvShape shape;
  const int64_t chunks = K / kChunk;
  if (K <= kSmallKMaxK && (chunks & (chunks - 1)) == 0) {
    shape.small_k = true;
    shape.lanes = int(chunks);
    return shape;
  }
  auto blocks_at = [&](int cols) {
    int64_t b = 0;
    for (int i = 0; i < count; ++i) b += (outputs[i].N + cols - 1) / cols;
    return b;
  };
  if (gemv_four_columns_allowed() && blocks_at(2) > resident_blocks(M, 2) &&
      blocks_at(4) <= resident_blocks(M, 4))
    shape.cols = 4;
  return shape;
}

template <int kRows>
void launch_rows(const GemvShape& shape, float alpha, const uint16_t* x, int64_t ldx, int64_t K,
                 float beta, const GemvBatch& batch, CUstream_st* stream) {
  const unsigned grid = unsigned(batch.block_begin[batch.count]);
  if (!shape.small_k) {
    const bool regs = gemv_register_prefetch();
    auto kernel =
        shape.cols == 4
            ? (regs ? gemv_bf16_kernel<kRows, 4, true> : gemv_bf16_kernel<kRows, 4, false>)
            : (regs ? gemv_bf16_kernel<kRows, 2, true> : gemv_bf16_kernel<kRows, 2, false>);
    launch_pdl(kernel, grid, kWarps * 32, 0, stream, x, ldx, K, alpha, beta, batch);
    check_last_error("gemv_bf16_kernel");
    return;
  }
  switch (shape.lanes) {
#define DM_GEMV_SMALL_K(L)                                                                       \
  case L:                                                                                        \
    launch_pdl(gemv_small_k_kernel<kRows, L>, grid, kWarps * 32, 0, stream, x, ldx, alpha, beta, \
               batch);                                                                           \
    break;
    DM_GEMV_SMALL_K(1)
    DM_GEMV_SMALL_K(2)
    DM_GEMV_SMALL_K(4)
    DM_GEMV_SMALL_K(8)
    DM_GEMV_SMALL_K(16)
    DM_GEMV_SMALL_K(32)
#undef DM_GEMV_SMALL_K
    default:
      throw Error(str_cat("gemv: no small-K kernel for K = ", K));
  }
  check_last_error("gemv_small_k_kernel");
}

void launch_batch(const GemvShape& shape, int64_t M, int64_t K, float alpha, const uint16_t* x,
                  int64_t ldx, float beta, const GemvBatch& batch, CUstream_st* stream) {
  if (batch.block_begin[batch.count] == 0) return;
  switch (M) {
    case 1:
      launch_rows<1>(shape, alpha, x, ldx, K, beta, batch, stream);
      break;
    case 2:
      launch_rows<2>(shape, alpha, x, ldx, K, beta, batch, stream);
      break;
    case 3:
      launch_rows<3>(shape, alpha, x, ldx, K, beta, batch, stream);
      break;
    default:
      launch_rows<4>(shape, alpha, x, ldx, K, beta, batch, stream);
      break;
  }
}

bool gemv_enabled() {
  static const bool enabled = env_choice("DM_GEMV", {"ours", "cublas"}) == 0;
  return enabled;
}

}  // namespace

bool gemv_applies(int64_t M, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* W,
                  int64_t ldw) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return M >= 1 && M <= kGemvMaxRows && K > 0 && K % kChunk == 0 && ldx % kChunk == 0 &&
         ldw % kChunk == 0 && aligned16(x) && aligned16(W) && gemv_enabled();
}

int gemv_columns_per_block(int64_t M, int64_t K, const GemvOutput* outputs, int count) {
  const GemvShape shape = choose_shape(M, K, outputs, count);
  return shape.small_k ? 0 : shape.cols;
}

void launch_gemv_bf16(int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* x,
                      int64_t ldx, const uint16_t* W, int64_t ldw, float beta, void* y,
                      GemmOutType y_type, int64_t ldy, CUstream_st* stream) {
  const GemvOutput out{W, ldw, N, y, y_type, ldy};
  launch_gemv_bf16_many(M, K, x, ldx, &out, 1, stream, alpha, beta);
}

void launch_gemv_bf16_many(int64_t M, int64_t K, const uint16_t* x, int64_t ldx,
                           const GemvOutput* outputs, int count, CUstream_st* stream, float alpha,
                           float beta) {
  DM_CHECK(count >= 1 && count <= kGemvMaxOutputs, "launch_gemv_bf16_many: ", count,
           " outputs (1 to ", kGemvMaxOutputs, ")");
  GemvBatch batch{};
  batch.count = count;
  const GemvShape shape = choose_shape(M, K, outputs, count);
  const int64_t per_block = shape.outputs_per_block();
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    const GemvOutput& o = outputs[i];
    DM_CHECK(gemv_applies(M, K, x, ldx, o.W, o.ldw), "launch_gemv_bf16: unsupported product M=",
             M, " K=", K, " ldx=", ldx, " ldw=", o.ldw);
    DM_CHECK(o.N >= 0 && (o.N == 0 || o.ldy >= o.N), "launch_gemv_bf16: output ", i, " has N=",
             o.N, ", ldy=", o.ldy);
    batch.W[i] = o.W;
    batch.y[i] = o.y;
    batch.ldw[i] = o.ldw;
    batch.N[i] = o.N;
    batch.ldy[i] = o.ldy;
    batch.f32[i] = o.y_type == GemmOutType::F32;
    batch.block_begin[i] = int(blocks);
    blocks += (o.N + per_block - 1) / per_block;
  }
  DM_CHECK(blocks < (int64_t(1) << 31), "launch_gemv_bf16: ", blocks, " blocks");
  batch.block_begin[count] = int(blocks);
  launch_batch(shape, M, K, alpha, x, ldx, beta, batch, stream);
}

}  // namespace dm::cuda
