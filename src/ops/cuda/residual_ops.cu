// Kernels of the GPU residual stream (residual_ops.h): one block per row for RMSNorm, one warp
// per row for AttnRes (forward and backward), grid-stride loops for the element-wise ones; plus
// the training-side backward kernels (AttnRes, embedding) and the deterministic sum of squares.
#include <algorithm>
#include <type_traits>

#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {
namespace {

constexpr int kRowThreads = 256;

template <typename Id>
__global__ void embedding_gather_kernel(const __nv_bfloat16* table, const Id* tokens, int64_t D,
                                        float* out) {
  const int64_t n = blockIdx.x;
  const __nv_bfloat16* row = table + int64_t(tokens[n]) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) out[n * D + i] = __bfloat162float(row[i]);
}

__global__ void rmsnorm_to_bf16_kernel(const float* x, const float* w, __nv_bfloat16* y, int64_t D,
                                       float eps) {
  __shared__ float reduce_scratch[32];
  const float* row = x + int64_t(blockIdx.x) * D;
  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum_squares += row[i] * row[i];
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    y[int64_t(blockIdx.x) * D + i] = __float2bfloat16(row[i] * inverse_rms * w[i]);
}

// The same for rows of D ≤ 4·kRowVec4 floats with D % 4 == 0: the row and the weights are read
// once, as float4, before the reduction (every load in flight at once), and kept in registers
// for the scaling. One block per row is all a decode step has: there the scalar loop above spent
// ~8.6 µs per 2304-wide row on dependent load latency.
constexpr int kRowVec4 = 4;  // float4 per thread: rows up to 4·4·256 = 4096 wide

// The norm half of the vec4 row kernels: xv/wv hold thread t's float4 chunks t, t + 256, … of
// the row and of w (zeros past the row); y_row ← bf16(x · rsqrt(mean(x²) + eps) · w).
__device__ __forceinline__ void rmsnorm_row_vec4_to_bf16(const float4 (&xv)[kRowVec4],
                                                         const float4 (&wv)[kRowVec4], int64_t D,
                                                         float eps, __nv_bfloat16* y_row,
                                                         float* reduce_scratch) {
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i)
    sum_squares += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(y_row);
  const int64_t D4 = D / 4;
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    if (j >= D4) continue;
    out[2 * j] = __floats2bfloat162_rn(xv[i].x * inverse_rms * wv[i].x,
                                       xv[i].y * inverse_rms * wv[i].y);
    out[2 * j + 1] = __floats2bfloat162_rn(xv[i].z * inverse_rms * wv[i].z,
                                           xv[i].w * inverse_rms * wv[i].w);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_to_bf16_vec4_kernel(const float* x, const float* w, __nv_bfloat16* y, int64_t D,
                                float eps) {
  __shared__ float reduce_scratch[32];
  const int64_t D4 = D / 4;
  const float4* row = reinterpret_cast<const float4*>(x + int64_t(blockIdx.x) * D);
  const float4* weight = reinterpret_cast<const float4*>(w);
  float4 xv[kRowVec4], wv[kRowVec4];
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    xv[i] = j < D4 ? row[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    wv[i] = j < D4 ? weight[j] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  rmsnorm_row_vec4_to_bf16(xv, wv, D, eps, y + int64_t(blockIdx.x) * D, reduce_scratch);
}

// p += out, then the vec4 norm of p (the same norm code as rmsnorm_to_bf16_vec4_kernel on the
// updated row, so the fused walk's rows equal the two-kernel walk's bit for bit).
__global__ void __launch_bounds__(kRowThreads)
    add_rmsnorm_to_bf16_vec4_kernel(float* p, const float* out, const float* w,
                                    __nv_bfloat16* y, int64_t D, float eps) {
  __shared__ float reduce_scratch[32];
  const int64_t D4 = D / 4;
  float4* row = reinterpret_cast<float4*>(p + int64_t(blockIdx.x) * D);
  const float4* add = reinterpret_cast<const float4*>(out + int64_t(blockIdx.x) * D);
  const float4* weight = reinterpret_cast<const float4*>(w);
  float4 xv[kRowVec4], wv[kRowVec4];
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    xv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    wv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < D4) {
      const float4 a = row[j], b = add[j];
      xv[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
      wv[i] = weight[j];
      row[j] = xv[i];
    }
  }
  rmsnorm_row_vec4_to_bf16(xv, wv, D, eps, y + int64_t(blockIdx.x) * D, reduce_scratch);
}

__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

// n4 float4 elements (both pointers 16-byte aligned).
__global__ void add_inplace_vec4_kernel(float4* dst, const float4* src, int64_t n4) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    float4 a = dst[i];
    const float4 b = src[i];
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
    dst[i] = a;
  }
}

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

// AttnRes forward for few rows (decode: N ≤ a batch of sequences): one 256-thread BLOCK per row,
// S logits by block reductions, the softmax in shared memory, then the weighted sum. A warp per
// row leaves most of the GPU idle there and walks a whole row alone (k3: D = 7168, a dozen
// sources). out may alias a source: every element is read from all sources, then written by the
// same thread.
constexpr int64_t kAttnResWarpRowsMinN = 1024;  // from here on the warp-per-row kernel
__global__ void attnres_forward_block_rows_kernel(AttnResSources sources, int S,
                                                  const float* query, const float* norm_w,
                                                  float* out, int64_t D, float eps) {
  __shared__ float reduce_scratch[32];
  __shared__ float weight[kAttnResCudaMaxSources];
  const int64_t row = int64_t(blockIdx.x) * D;
  for (int j = 0; j < S; ++j) {
    const float* v = sources.src[j] + row;
    float sum_squares = 0.0f, dot = 0.0f;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      sum_squares += v[i] * v[i];
      dot += v[i] * norm_w[i] * query[i];
    }
    sum_squares = block_sum(sum_squares, reduce_scratch);
    dot = block_sum(dot, reduce_scratch);
    if (threadIdx.x == 0) weight[j] = dot * rsqrtf(sum_squares / float(D) + eps);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float max_logit = weight[0];
    for (int j = 1; j < S; ++j) max_logit = fmaxf(max_logit, weight[j]);
    float total = 0.0f;
    for (int j = 0; j < S; ++j) {
      weight[j] = __expf(weight[j] - max_logit);
      total += weight[j];
    }
    for (int j = 0; j < S; ++j) weight[j] /= total;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < S; ++j) acc += weight[j] * sources.src[j][row + i];
    out[row + i] = acc;
  }
}

// AttnRes forward. Warp w of block b owns row n = b·blockDim.x/32 + w.
//  - Row of one tile (chunks ≤ 32·K): each source row is read ONCE into registers, its two sums
//    (Σ V², Σ V γ w; fp32 inside a chunk, fp64 across chunks and lanes) reduced by shuffles, and
//    folded into a running softmax over the sources (max / rescale, as flash attention does
//    over keys): acc = acc·e^(m_old − m_new) + e^(logit_j − m_new)·V_j,
//    out = acc / Σ_j e^(logit_j − m).
//    Bytes per row: 4·D·S read, 4·D written (the floor).
//  - Wider rows: two passes, the statistics tile by tile, then the weighted sum tile by tile,
//    re-reading the sources.
// out may alias a source: a lane reads every source chunk it will write before writing it, the
// statistics of the whole row (a warp reduction) complete before any write, and no other warp
// touches the row.
template <int kVec>
__global__ void __launch_bounds__(kAttnResForwardWarps * 32, 3)
    attnres_forward_rows_kernel(AttnResSources sources, int S, const float* query,
                                const float* norm_w, float* out, int64_t N, int D, float eps) {
  using Chunk = AttnResChunk<kVec>;
  constexpr int K = kAttnResChunksPerLane;
  extern __shared__ float4 attnres_smem[];
  const int chunks = D / kVec;
  Chunk* gw = reinterpret_cast<Chunk*>(attnres_smem);
  attnres_fill_gamma_w(gw, query, norm_w, chunks);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;  // whole warps: the shuffles below see all 32 lanes
  const Chunk* gwc = gw;
  Chunk* o = reinterpret_cast<Chunk*>(out + n * D);

  if (chunks <= 32 * K) {
    Chunk acc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = Chunk{};
    double running_max = -INFINITY, den = 0.0;
    for (int j = 0; j < S; ++j) {
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
      Chunk x[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = lane + 32 * k;
        x[k] = c < chunks ? __ldcs(v + c) : Chunk{};
      }
      double ss = 0.0, dot = 0.0;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = lane + 32 * k;
        if (c < chunks) {
          ss += double(chunk_dot(x[k], x[k]));
          dot += double(chunk_dot(x[k], gwc[c]));
        }
      }
      ss = warp_sum(ss);
      dot = warp_sum(dot);
      const double logit = (1.0 / sqrt(ss / double(D) + double(eps))) * dot;
      const double new_max = fmax(running_max, logit);
      const double rescale = exp(running_max - new_max), weight = exp(logit - new_max);
      den = den * rescale + weight;
      running_max = new_max;
#pragma unroll
      for (int k = 0; k < K; ++k)
        acc[k] = chunk_lincomb(float(rescale), acc[k], float(weight), x[k]);
    }
    const float inv_den = float(1.0 / den);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = lane + 32 * k;
      if (c < chunks) o[c] = chunk_scale(acc[k], inv_den);
    }
    return;
  }

  // Wider rows: half-size tiles keep the two passes within the online path's registers.
  constexpr int KW = K / 2;
  SourceSlots logit{-INFINITY, -INFINITY};
  for (int j = 0; j < S; ++j) {
    const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
    double ss = 0.0, dot = 0.0;
    for (int base = 0; base < chunks; base += 32 * KW) {
      Chunk x[KW];
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int c = base + lane + 32 * k;
        x[k] = c < chunks ? v[c] : Chunk{};
      }
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int c = base + lane + 32 * k;
        if (c < chunks) {
          ss += double(chunk_dot(x[k], x[k]));
          dot += double(chunk_dot(x[k], gwc[c]));
        }
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    logit.capture(j, (1.0 / sqrt(ss / double(D) + double(eps))) * dot, lane);
  }
  const SourceSlots a = softmax_slots(logit);
  for (int base = 0; base < chunks; base += 32 * KW) {
    Chunk acc[KW];
#pragma unroll
    for (int k = 0; k < KW; ++k) acc[k] = Chunk{};
    for (int j = 0; j < S; ++j) {
      const float aj = a.broadcast_float(j);
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int c = base + lane + 32 * k;
        if (c < chunks) acc[k] = chunk_lincomb(1.0f, acc[k], aj, __ldcs(v + c));
      }
    }
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      const int c = base + lane + 32 * k;
      if (c < chunks) o[c] = acc[k];
    }
  }
}

// ---- training side ---------------------------------------------------------------------------

// Blocks of the sum-of-squares first stage (fixed by n; ≤ kSumSquaresThreads so the second
// stage is one pass of one block).
constexpr int kSumSquaresThreads = 1024;
int64_t sum_squares_blocks(int64_t n) {
  return std::min<int64_t>((n + 256 * 16 - 1) / (256 * 16), kSumSquaresThreads);
}

// Grid for a grid-stride element-wise loop over n elements (n ≥ 1).
unsigned elementwise_blocks(int64_t n, int threads) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, 8192));
}

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// ---- AttnRes backward --------------------------------------------------------------------------

struct AttnResGradTargets {
  float* dsrc[kAttnResCudaMaxSources];
};

// Grid of the AttnRes backward row kernel, a function of (N, D) only, so the order in which G
// adds up (hence the bits of dquery / dnorm_w) never depends on scheduling or on the device.
// `warps` rows run side by side per block: as many (≤ 8) as keep γ⊙w and one fp32 partial of G
// per warp within kAttnResBackwardSmemBudget; each warp owns rows_per_warp rows, so that there
// are at most kAttnResBackwardMaxBlocks blocks, each writing one fp64 partial [D].
constexpr int kAttnResBackwardMaxWarps = 8;
constexpr int64_t kAttnResBackwardMaxBlocks = 512;
constexpr size_t kAttnResBackwardSmemBudget = 112 * 1024;  // half of an sm_90 SM's 228 KiB
// Chunks per lane whose loads the element pass issues together (x, dout, dsrc: 24 float4).
constexpr int kAttnResElementGroup = 8;

struct AttnResBackwardGrid {
  int warps;          // rows (warps) per block
  int rows_per_warp;  // rows each warp walks
  int64_t blocks;     // = the number of fp64 partials of G
};

AttnResBackwardGrid attnres_backward_grid(int64_t N, int64_t D) {
  AttnResBackwardGrid grid{};
  const int64_t fit =
      int64_t(kAttnResBackwardSmemBudget / (size_t(std::max<int64_t>(D, 1)) * sizeof(float))) - 1;
  grid.warps = int(std::clamp<int64_t>(fit, 1, kAttnResBackwardMaxWarps));
  const int64_t rows = std::max<int64_t>(N, 1);
  const int64_t max_rows_per_pass = grid.warps * kAttnResBackwardMaxBlocks;
  grid.rows_per_warp = int((rows + max_rows_per_pass - 1) / max_rows_per_pass);
  const int64_t rows_per_block = int64_t(grid.warps) * grid.rows_per_warp;
  grid.blocks = (rows + rows_per_block - 1) / rows_per_block;
  return grid;
}

// Dynamic shared memory of the backward row kernel: γ⊙w [D], then (parameter gradients wanted)
// one fp32 partial of G [D] per warp.
size_t attnres_backward_smem_bytes(int64_t D, int warps, bool param_grads) {
  return size_t(1 + (param_grads ? warps : 0)) * size_t(D) * sizeof(float);
}

// AttnRes backward, stage 1. Warp w of block b owns rows n = (i·gridDim.x + b)·warps + w,
// i = 0 … rows_per_warp − 1 (attnres_backward_grid). Per row:
//   1. statistics, source by source, tile by tile: ss_j = Σ V², s_j = Σ V γ w, da_j = Σ dout·V
//      (fp32 within a chunk, fp64 across chunks and lanes), three shuffle reductions per source
//      into the lanes' SourceSlots;
//   2. every lane, for its slots (fp64, the CPU formulas): r_j = 1/sqrt(ss_j/D + eps),
//      a = softmax(r·s), dl_j = a_j (da_j − Σ_k a_k da_k), c_j = dl_j r_j, c3_j = dl_j s_j r_j³/D;
//   3. element pass, sources in reverse order (the last read are the likeliest still in L2):
//      dsrc[j] += a_j·dout + c_j·γ⊙w − c3_j·V_j in fp32, and the warp's fp32 partial of
//      G = Σ_j c_j V_j in shared memory (lane-owned chunks, so no two lanes touch one element and
//      no barrier is needed until the end).
// Bytes per row: 4·D·(S + 1) for the statistics, then per source 4·D re-read (L2 for the last
// few) + 4·D dsrc read + 4·D written; the dout row is re-read from L1/L2 for every source. The
// dsrc stream and the last read of a source use evict-first hints so that they do not push the
// row's remaining sources out of L2.
// At the end the block sums its warps' partials in warp order, in fp64, into
// partial[blockIdx.x, :]; partial == nullptr: no parameter gradient wanted (no partials kept).
template <int kVec>
__global__ void __launch_bounds__(kAttnResBackwardMaxWarps * 32)
    attnres_backward_rows_kernel(AttnResSources sources, AttnResGradTargets targets, int S,
                                 const float* query, const float* norm_w, const float* dout,
                                 double* partial, int64_t N, int D, float eps,
                                 int rows_per_warp) {
  using Chunk = AttnResChunk<kVec>;
  constexpr int K = kAttnResChunksPerLane, kGroup = kAttnResElementGroup;
  static_assert(K % kGroup == 0, "element groups tile a tile");
  extern __shared__ float4 attnres_smem[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = D / kVec;
  Chunk* gw = reinterpret_cast<Chunk*>(attnres_smem);
  float* warp_partials = reinterpret_cast<float*>(gw + chunks);  // [warps, D] if partial
  attnres_fill_gamma_w(gw, query, norm_w, chunks);
  if (partial) {
    Chunk* zero = reinterpret_cast<Chunk*>(warp_partials);
    for (int i = threadIdx.x; i < warps * chunks; i += blockDim.x) zero[i] = Chunk{};
  }
  __syncthreads();
  const Chunk* gwc = gw;
  Chunk* gpart = partial ? reinterpret_cast<Chunk*>(warp_partials + warp * D) : nullptr;

  for (int i = 0; i < rows_per_warp; ++i) {
    const int64_t n = (int64_t(i) * gridDim.x + blockIdx.x) * warps + warp;
    if (n >= N) break;  // whole warps; rows grow with i
    const Chunk* g = reinterpret_cast<const Chunk*>(dout + n * D);

    SourceSlots logit{-INFINITY, -INFINITY}, r{0.0, 0.0}, s{0.0, 0.0}, da{0.0, 0.0};
    for (int j = 0; j < S; ++j) {
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
      double ss = 0.0, dot = 0.0, gv = 0.0;
      for (int base = 0; base < chunks; base += 32 * K) {
        Chunk x[K], y[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = base + lane + 32 * k;
          x[k] = c < chunks ? __ldcg(v + c) : Chunk{};  // L2 only: L1 keeps the dout row
          y[k] = c < chunks ? g[c] : Chunk{};
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = base + lane + 32 * k;
          if (c < chunks) {
            ss += double(chunk_dot(x[k], x[k]));
            dot += double(chunk_dot(x[k], gwc[c]));
            gv += double(chunk_dot(x[k], y[k]));
          }
        }
      }
      ss = warp_sum(ss);
      dot = warp_sum(dot);
      gv = warp_sum(gv);
      const double rj = 1.0 / sqrt(ss / double(D) + double(eps));
      r.capture(j, rj, lane);
      s.capture(j, dot, lane);
      da.capture(j, gv, lane);
      logit.capture(j, rj * dot, lane);
    }

    const SourceSlots a = softmax_slots(logit);
    const double mean_da = warp_sum(a.lo * da.lo + a.hi * da.hi);
    SourceSlots c, c3;  // unused slots: a = da = r = 0, so c = c3 = 0
    {
      const double dl_lo = a.lo * (da.lo - mean_da), dl_hi = a.hi * (da.hi - mean_da);
      c.lo = dl_lo * r.lo;
      c.hi = dl_hi * r.hi;
      c3.lo = dl_lo * s.lo * r.lo * r.lo * r.lo / double(D);
      c3.hi = dl_hi * s.hi * r.hi * r.hi * r.hi / double(D);
    }

    for (int j = S - 1; j >= 0; --j) {
      float* dsrc_j = targets.dsrc[j];
      if (dsrc_j == nullptr && gpart == nullptr) continue;  // warp-uniform
      Chunk* dv = dsrc_j ? reinterpret_cast<Chunk*>(dsrc_j + n * D) : nullptr;
      const float fa = a.broadcast_float(j), fc = c.broadcast_float(j),
                  neg_fc3 = -c3.broadcast_float(j);
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
      for (int base = 0; base < chunks; base += 32 * K) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += kGroup) {
          // All of the group's loads go out before its first store: dsrc aliases nothing read
          // here, but the compiler cannot know that and would not hoist a load over a store.
          Chunk x[kGroup], y[kGroup], z[kGroup];
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            const int cc = base + lane + 32 * (k0 + k);
            x[k] = y[k] = z[k] = Chunk{};
            if (cc < chunks) {
              x[k] = __ldcs(v + cc);
              if (dv) {
                y[k] = g[cc];
                z[k] = __ldcs(dv + cc);
              }
            }
          }
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            const int cc = base + lane + 32 * (k0 + k);
            if (cc >= chunks) continue;
            if (dv) __stcs(dv + cc, chunk_update(z[k], fa, y[k], fc, gwc[cc], neg_fc3, x[k]));
            if (gpart) gpart[cc] = chunk_lincomb(1.0f, gpart[cc], fc, x[k]);
          }
        }
      }
    }
  }

  if (partial == nullptr) return;  // block-uniform
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    double G = 0.0;
    for (int w = 0; w < warps; ++w) G += double(warp_partials[w * D + d]);
    partial[int64_t(blockIdx.x) * D + d] = G;
  }
}

// AttnRes backward, stage 2: G[d] = Σ_b partial[b, d], then dquery[d] += G·w_d and
// dnorm_w[d] += G·γ_d. A block of 32 columns × kAttnResParamGroups per 32-column slice of D:
// thread (x, y) sums the partials b ≡ y (mod groups) in ascending b (a warp reads 256
// contiguous bytes per b), then thread (x, 0) adds the group sums in group order: a fixed order,
// so bit-identical run to run, and 16-way parallel over the ≤ 512 partials of a column.
constexpr int kAttnResParamGroups = 16;
__global__ void __launch_bounds__(32 * kAttnResParamGroups)
    attnres_backward_params_kernel(const double* partial, int64_t blocks, const float* query,
                                   const float* norm_w, float* dquery, float* dnorm_w, int D) {
  __shared__ double group_sum[kAttnResParamGroups][32];
  const int x = threadIdx.x, y = threadIdx.y;
  const int d = blockIdx.x * 32 + x;
  double acc = 0.0;
  if (d < D) {
#pragma unroll 4
    for (int64_t b = y; b < blocks; b += kAttnResParamGroups) acc += partial[b * D + d];
  }
  group_sum[y][x] = acc;
  __syncthreads();
  if (y != 0 || d >= D) return;
  double G = 0.0;
  for (int k = 0; k < kAttnResParamGroups; ++k) G += group_sum[k][x];
  if (dquery) dquery[d] += float(G * double(norm_w[d]));
  if (dnorm_w) dnorm_w[d] += float(G * double(query[d]));
}

// Embedding backward, step 1: sort keys (token id, or V for an id outside [0, V): sorted last
// and skipped) and values (the row index n).
__global__ void embedding_backward_keys_kernel(const int64_t* tokens, int64_t N, int64_t V,
                                               uint32_t* keys, uint32_t* rows) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = tokens[n];
    keys[n] = uint32_t(t >= 0 && t < V ? t : V);
    rows[n] = uint32_t(n);
  }
}

// Embedding backward, step 3: sorted position i that starts a run of equal tokens (i = 0 or a
// different key before it) sums dp over the run in sorted (= ascending n) order, in fp64, and
// adds once to dtable[token]. Other positions do nothing; one block per position, grid-stride.
__global__ void embedding_backward_accumulate_kernel(const uint32_t* keys, const uint32_t* rows,
                                                     const float* dp, int64_t N, int64_t D,
                                                     int64_t V, float* dtable) {
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const uint32_t key = keys[i];
    if (int64_t(key) >= V || (i > 0 && keys[i - 1] == key)) continue;  // block-uniform branch
    float* out = dtable + int64_t(key) * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      double acc = 0.0;
      for (int64_t k = i; k < N && keys[k] == key; ++k) acc += double(dp[int64_t(rows[k]) * D + d]);
      out[d] = float(double(out[d]) + acc);
    }
  }
}

// Embedding backward, atomic variant: one block per row n (grid-stride), fp32 atomicAdd.
__global__ void embedding_backward_atomic_kernel(const int64_t* tokens, const float* dp, int64_t N,
                                                 int64_t D, float* dtable) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    float* out = dtable + tokens[n] * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(out + d, dp[n * D + d]);
  }
}

// Sum of squares, stage 1: block b writes Σ over its grid-stride share of x² (fp64).
__global__ void sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Sum of squares, stage 2: one block of kSumSquaresThreads; thread t takes partial t (count ≤
// kSumSquaresThreads), one fixed-order block reduction.
__global__ void sum_squares_final_kernel(const double* partial, int64_t count, double* result) {
  __shared__ double scratch[32];
  const double v = threadIdx.x < count ? partial[threadIdx.x] : 0.0;
  const double total = block_sum(v, scratch);
  if (threadIdx.x == 0) *result = total;
}

__global__ void scale_inplace_kernel(float* x, int64_t n, float s) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

}  // namespace

template <typename Id>
void embedding_gather_impl(const uint16_t* table, const Id* tokens, int64_t N, int64_t D,
                           float* out, CUstream_st* stream) {
  if (N == 0) return;
  embedding_gather_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(table), tokens, D, out);
  check_last_error("embedding_gather");
}
void embedding_gather(const uint16_t* table, const int64_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream) {
  embedding_gather_impl(table, tokens, N, D, out, stream);
}
void embedding_gather(const uint16_t* table, const int32_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream) {
  embedding_gather_impl(table, tokens, N, D, out, stream);
}

void rmsnorm_to_bf16(const float* x, const float* w, uint16_t* y, int64_t N, int64_t D, float eps,
                     CUstream_st* stream) {
  if (N == 0) return;
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (D % 4 == 0 && D <= 4 * kRowVec4 * kRowThreads && aligned16(x) && aligned16(w) &&
      aligned16(y))
    rmsnorm_to_bf16_vec4_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
        x, w, reinterpret_cast<__nv_bfloat16*>(y), D, eps);
  else
    rmsnorm_to_bf16_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
        x, w, reinterpret_cast<__nv_bfloat16*>(y), D, eps);
  check_last_error("rmsnorm_to_bf16");
}

void add_rmsnorm_to_bf16(float* p, const float* out, const float* w, uint16_t* y, int64_t N,
                         int64_t D, float eps, CUstream_st* stream) {
  if (N == 0) return;
  const auto aligned16 = [](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  };
  if (D % 4 == 0 && D <= 4 * kRowVec4 * kRowThreads && aligned16(p) && aligned16(out) &&
      aligned16(w) && aligned16(y)) {
    add_rmsnorm_to_bf16_vec4_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
        p, out, w, reinterpret_cast<__nv_bfloat16*>(y), D, eps);
    check_last_error("add_rmsnorm_to_bf16");
    return;
  }
  add_inplace(p, out, N * D, stream);
  rmsnorm_to_bf16(p, w, y, N, D, eps, stream);
}

void add_inplace(float* dst, const float* src, int64_t n, CUstream_st* stream) {
  if (n == 0) return;
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int64_t n4 = n / 4;
    const int blocks = int(n4 / 1024 + 1 < 4096 ? n4 / 1024 + 1 : 4096);
    add_inplace_vec4_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<float4*>(dst),
                                                        reinterpret_cast<const float4*>(src), n4);
    check_last_error("add_inplace");
    return;
  }
  const int blocks = int(n / 1024 + 1 < 4096 ? n / 1024 + 1 : 4096);
  add_inplace_kernel<<<blocks, 256, 0, stream>>>(dst, src, n);
  check_last_error("add_inplace");
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launches `kernel` (an AttnRes row kernel) with `smem` bytes of dynamic shared memory, first
// allowing more than the default 48 KiB when needed (set on every such launch: per device).
template <typename Kernel, typename... Args>
void launch_attnres_rows(Kernel kernel, int64_t blocks, int threads, size_t smem,
                         CUstream_st* stream, Args... args) {
  if (smem > 48 * 1024)
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(blocks), threads, smem, stream>>>(args...);
}
}  // namespace

void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, int64_t N, int64_t D, float eps, CUstream_st* stream) {
  DM_CHECK(S >= 1 && S <= kAttnResCudaMaxSources, "attnres (CUDA): ", S, " sources (1..",
           kAttnResCudaMaxSources, " supported)");
  DM_CHECK(N >= 0 && D >= 0 && D <= kAttnResMaxWidth, "attnres (CUDA): bad shape N=", N,
           " D=", D, " (D ≤ ", kAttnResMaxWidth, ")");
  if (N == 0 || D == 0) return;
  AttnResSources sources{};
  bool vec4 = D % 4 == 0 && aligned16(query) && aligned16(norm_w) && aligned16(out);
  for (int j = 0; j < S; ++j) {
    sources.src[j] = src[j];
    vec4 = vec4 && aligned16(src[j]);
  }
  if (N < kAttnResWarpRowsMinN) {
    attnres_forward_block_rows_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
        sources, S, query, norm_w, out, D, eps);
    check_last_error("attnres_forward");
    return;
  }
  const int64_t blocks = (N + kAttnResForwardWarps - 1) / kAttnResForwardWarps;
  const size_t smem = size_t(D) * sizeof(float);
  if (vec4)
    launch_attnres_rows(attnres_forward_rows_kernel<4>, blocks, kAttnResForwardWarps * 32, smem,
                        stream, sources, S, query, norm_w, out, N, int(D), eps);
  else
    launch_attnres_rows(attnres_forward_rows_kernel<1>, blocks, kAttnResForwardWarps * 32, smem,
                        stream, sources, S, query, norm_w, out, N, int(D), eps);
  check_last_error("attnres_forward");
}

// ---- training side ---------------------------------------------------------------------------

size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S) {
  (void)S;
  if (N <= 0 || D <= 0) return 0;
  return align256(size_t(attnres_backward_grid(N, D).blocks) * size_t(D) * sizeof(double));
}

void attnres_backward(const float* const* src, int S, const float* query, const float* norm_w,
                      const float* dout, float* const* dsrc, float* dquery, float* dnorm_w,
                      int64_t N, int64_t D, float eps, void* workspace, CUstream_st* stream) {
  DM_CHECK(S >= 1 && S <= kAttnResCudaMaxSources, "attnres_backward (CUDA): ", S,
           " sources (1..", kAttnResCudaMaxSources, " supported)");
  DM_CHECK(N >= 0 && D >= 0 && D <= kAttnResMaxWidth, "attnres_backward (CUDA): bad shape N=", N,
           " D=", D, " (D ≤ ", kAttnResMaxWidth, ")");
  if (N == 0 || D == 0) return;
  const bool param_grads = dquery != nullptr || dnorm_w != nullptr;
  DM_CHECK(!param_grads || workspace != nullptr,
           "attnres_backward (CUDA): a workspace is needed for dquery / dnorm_w");
  AttnResSources sources{};
  AttnResGradTargets targets{};
  bool vec4 = D % 4 == 0 && aligned16(query) && aligned16(norm_w) && aligned16(dout);
  bool any_dsrc = false;
  for (int j = 0; j < S; ++j) {
    sources.src[j] = src[j];
    targets.dsrc[j] = dsrc ? dsrc[j] : nullptr;
    vec4 = vec4 && aligned16(src[j]) && aligned16(targets.dsrc[j]);
    any_dsrc = any_dsrc || targets.dsrc[j] != nullptr;
  }
  if (!any_dsrc && !param_grads) return;
  const AttnResBackwardGrid grid = attnres_backward_grid(N, D);
  const size_t smem = attnres_backward_smem_bytes(D, grid.warps, param_grads);
  double* partial = param_grads ? static_cast<double*>(workspace) : nullptr;
  if (vec4)
    launch_attnres_rows(attnres_backward_rows_kernel<4>, grid.blocks, grid.warps * 32, smem,
                        stream, sources, targets, S, query, norm_w, dout, partial, N, int(D), eps,
                        grid.rows_per_warp);
  else
    launch_attnres_rows(attnres_backward_rows_kernel<1>, grid.blocks, grid.warps * 32, smem,
                        stream, sources, targets, S, query, norm_w, dout, partial, N, int(D), eps,
                        grid.rows_per_warp);
  check_last_error("attnres_backward (rows)");
  if (!param_grads) return;
  attnres_backward_params_kernel<<<unsigned((D + 31) / 32), dim3(32, kAttnResParamGroups), 0,
                                   stream>>>(partial, grid.blocks, query, norm_w, dquery, dnorm_w,
                                             int(D));
  check_last_error("attnres_backward (params)");
}

namespace {
// Radix-sort key bits: enough for every id in [0, V] (V itself is the "invalid id" key).
int embedding_key_bits(int64_t V) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= V) ++bits;
  return bits;
}
// cub's scratch for sorting N (uint32 key, uint32 value) pairs on `bits` key bits; the query
// launches nothing.
size_t embedding_sort_temp_bytes(int64_t N, int bits) {
  size_t bytes = 0;
  DM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), int(N), 0, bits));
  return bytes;
}
}  // namespace

size_t embedding_backward_workspace_bytes(int64_t N, int64_t V) {
  DM_CHECK(N >= 0 && N < (int64_t(1) << 31) && V > 0 && V < (int64_t(1) << 31),
           "embedding_backward (CUDA): N=", N, " V=", V, " out of range");
  if (N == 0) return 0;
  // keys in/out, rows in/out (uint32 [N] each), then cub's scratch.
  return 4 * align256(size_t(N) * sizeof(uint32_t)) +
         align256(embedding_sort_temp_bytes(N, embedding_key_bits(V)));
}

void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D, int64_t V,
                        float* dtable, void* workspace, CUstream_st* stream) {
  DM_CHECK(N >= 0 && N < (int64_t(1) << 31) && V > 0 && V < (int64_t(1) << 31) && D >= 0,
           "embedding_backward (CUDA): N=", N, " D=", D, " V=", V, " out of range");
  if (N == 0 || D == 0) return;
  DM_CHECK(workspace != nullptr, "embedding_backward (CUDA): workspace is null");
  const int bits = embedding_key_bits(V);
  const size_t slot = align256(size_t(N) * sizeof(uint32_t));
  char* base = static_cast<char*>(workspace);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + slot);
  uint32_t* rows_in = reinterpret_cast<uint32_t*>(base + 2 * slot);
  uint32_t* rows_out = reinterpret_cast<uint32_t*>(base + 3 * slot);
  void* sort_temp = base + 4 * slot;
  size_t sort_temp_bytes = embedding_sort_temp_bytes(N, bits);
  embedding_backward_keys_kernel<<<elementwise_blocks(N, 256), 256, 0, stream>>>(tokens, N, V,
                                                                                 keys_in, rows_in);
  check_last_error("embedding_backward (keys)");
  // LSD radix sort is stable: equal tokens keep ascending n, so the per-token sum order is fixed.
  DM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_temp_bytes, keys_in, keys_out,
                                                rows_in, rows_out, int(N), 0, bits, stream));
  embedding_backward_accumulate_kernel<<<unsigned(std::min<int64_t>(N, 65536)), kRowThreads, 0,
                                         stream>>>(keys_out, rows_out, dp, N, D, V, dtable);
  check_last_error("embedding_backward (accumulate)");
}

void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D,
                        float* dtable, CUstream_st* stream) {
  DM_CHECK(N >= 0 && D >= 0, "embedding_backward (CUDA): N=", N, " D=", D);
  if (N == 0 || D == 0) return;
  embedding_backward_atomic_kernel<<<unsigned(std::min<int64_t>(N, 65536)), kRowThreads, 0,
                                     stream>>>(tokens, dp, N, D, dtable);
  check_last_error("embedding_backward (atomic)");
}

size_t sum_squares_workspace_bytes(int64_t n) {
  return align256(size_t(std::max<int64_t>(sum_squares_blocks(n), 1)) * sizeof(double));
}

void sum_squares(const float* x, int64_t n, double* result_device, void* workspace,
                 CUstream_st* stream) {
  DM_CHECK(n >= 0 && workspace != nullptr && result_device != nullptr,
           "sum_squares (CUDA): n=", n, ", workspace and result must be set");
  double* partial = static_cast<double*>(workspace);
  const int64_t blocks = sum_squares_blocks(n);
  if (blocks > 0) {
    sum_squares_partial_kernel<<<unsigned(blocks), 256, 0, stream>>>(x, n, partial);
    check_last_error("sum_squares (partial)");
  }
  sum_squares_final_kernel<<<1, kSumSquaresThreads, 0, stream>>>(partial, blocks, result_device);
  check_last_error("sum_squares (final)");
}

void scale_inplace(float* x, int64_t n, float s, CUstream_st* stream) {
  DM_CHECK(n >= 0, "scale_inplace (CUDA): n=", n);
  if (n == 0) return;
  scale_inplace_kernel<<<elementwise_blocks(n, 256), 256, 0, stream>>>(x, n, s);
  check_last_error("scale_inplace");
}

}  // namespace dm::cuda
