// The Block AttnRes row machinery shared by the forward (residual_ops.cu) and backward
// (residual_ops_backward.cu) kernels of the GPU residual stream. Internal to those two files.
#pragma once
#include <cstdint>
#include <type_traits>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda::attnres_detail {

// Threads of the block-per-row kernels (RMSNorm, the few-row AttnRes forward, the embedding
// backward).
constexpr int kRowThreads = 256;

// ---- Block AttnRes -----------------------------------------------------------------------------
// Layout of the forward and backward row kernels: one WARP per row, the rows of a block side by
// side, so a row's statistics are warp-shuffle reductions and the per-row path has no block
// barrier. A row is cut into chunks: float4 when D % 4 == 0 and every row pointer is 16-byte
// aligned, else single floats. Lane l owns chunks l, l + 32, l + 64, …; a tile is the 32·K chunks
// a warp holds in registers at once (K = kAttnResChunksPerLane: 2048 floats as float4, 512 as
// floats), so every training width up to 2048 is one tile. The per-source scalars of a row (sums,
// r_j, softmax weight, backward coefficients) are fp64 and spread over the lanes (SourceSlots),
// so the softmax over sources is a handful of warp reductions that every lane computes at once.
// γ⊙w is formed once per block in shared memory (the kernels' only barrier before the rows).

constexpr int kAttnResChunksPerLane = 16;
constexpr int kAttnResForwardWarps = 4;  // rows (warps) per forward block
// Widest row the kernels take: γ⊙w (and the backward's per-warp partials of G) live in shared
// memory.
constexpr int kAttnResMaxWidth = 16384;
static_assert(kAttnResCudaMaxSources <= 64, "SourceSlots: two sources per lane");

struct AttnResSources {
  const float* src[kAttnResCudaMaxSources];
};

template <int kVec>
using AttnResChunk = std::conditional_t<kVec == 4, float4, float>;

__device__ __forceinline__ float chunk_dot(float a, float b) { return a * b; }
__device__ __forceinline__ float chunk_dot(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}
// p·a + q·b
__device__ __forceinline__ float chunk_lincomb(float p, float a, float q, float b) {
  return fmaf(q, b, p * a);
}
__device__ __forceinline__ float4 chunk_lincomb(float p, float4 a, float q, float4 b) {
  return make_float4(fmaf(q, b.x, p * a.x), fmaf(q, b.y, p * a.y), fmaf(q, b.z, p * a.z),
                     fmaf(q, b.w, p * a.w));
}
__device__ __forceinline__ float chunk_scale(float a, float s) { return a * s; }
__device__ __forceinline__ float4 chunk_scale(float4 a, float s) {
  return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}
// d + (p·a + q·b + r·c): the backward's dsrc update.
__device__ __forceinline__ float chunk_update(float d, float p, float a, float q, float b, float r,
                                              float c) {
  return d + fmaf(r, c, fmaf(q, b, p * a));
}
__device__ __forceinline__ float4 chunk_update(float4 d, float p, float4 a, float q, float4 b,
                                               float r, float4 c) {
  return make_float4(chunk_update(d.x, p, a.x, q, b.x, r, c.x),
                     chunk_update(d.y, p, a.y, q, b.y, r, c.y),
                     chunk_update(d.z, p, a.z, q, b.z, r, c.z),
                     chunk_update(d.w, p, a.w, q, b.w, r, c.w));
}

__device__ __forceinline__ double warp_max_double(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One fp64 scalar per source of a row, spread over the warp: lane l holds source l in `lo` and
// source l + 32 in `hi` (S ≤ 64). Xor-shuffle sums give every lane the same bits, so all lanes
// agree on every derived scalar.
struct SourceSlots {
  double lo, hi;
  // After a warp reduction every lane has `value`; the owner of source j keeps it.
  __device__ __forceinline__ void capture(int j, double value, int lane) {
    if (lane == (j & 31)) (j < 32 ? lo : hi) = value;
  }
  // Source j's value on every lane, rounded to fp32 (the element passes' coefficient).
  __device__ __forceinline__ float broadcast_float(int j) const {
    return __shfl_sync(0xffffffffu, float(j < 32 ? lo : hi), j & 31);
  }
};

// softmax over the sources of a row; unused slots hold −inf and get weight 0.
__device__ __forceinline__ SourceSlots softmax_slots(SourceSlots logit) {
  const double mx = warp_max_double(fmax(logit.lo, logit.hi));
  SourceSlots a{exp(logit.lo - mx), exp(logit.hi - mx)};
  const double den = warp_sum(a.lo + a.hi);
  a.lo /= den;
  a.hi /= den;
  return a;
}

__device__ __forceinline__ float chunk_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float4 chunk_mul(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// γ⊙w, `chunks` chunks, into shared memory by the whole block (the caller then has the one
// barrier before any row).
template <typename Chunk>
__device__ __forceinline__ void attnres_fill_gamma_w(Chunk* gw, const float* query,
                                                     const float* norm_w, int chunks) {
  const Chunk* q = reinterpret_cast<const Chunk*>(query);
  const Chunk* w = reinterpret_cast<const Chunk*>(norm_w);
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) gw[i] = chunk_mul(q[i], w[i]);
}


inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launches `kernel` (an AttnRes row kernel) with `smem` bytes of dynamic shared memory, first
// allowing more than the default 48 KiB when needed (set on every such launch: per device).
template <typename Kernel, typename... Args>
void launch_attnres_rows(Kernel kernel, int64_t blocks, int threads, size_t smem,
                         CUstream_st* stream, Args... args) {
  if (smem > 48 * 1024)
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_pdl(kernel, unsigned(blocks), threads, smem, stream, args...);  // kernels wait first
}

}  // namespace dm::cuda::attnres_detail
