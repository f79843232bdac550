// Kernels of the GPU residual stream (residual_ops.h): one block per row for RMSNorm, one warp
// per row for AttnRes, grid-stride loops for the element-wise ones. The training side (AttnRes
// and embedding backward, the deterministic sum of squares) is residual_ops_backward.cu.
// The gather and the RMSNorm kernels are templated on the table / normed-row storage, bf16 bits
// (uint16_t) or fp32 (the fp32 GPU mode): one body and one launch configuration for both.
#include <algorithm>
#include <type_traits>

#include "ops/cuda/attnres_rows.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {
using namespace attnres_detail;
namespace {

// One block per token: out[n, :] = fp32(table[tokens[n], :]); Table is uint16_t (bf16 bits) or
// float.
template <typename Table, typename Id>
__global__ void embedding_gather_kernel(const Table* table, const Id* tokens, int64_t D,
                                        float* out) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t n = blockIdx.x;
  const Table* row = table + int64_t(tokens[n]) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) out[n * D + i] = load_as_float(row, i);
}

// One block per row: y[row, :] = x[row, :] · rsqrt(mean(x²) + eps) · w, y stored as Out (bf16
// bits rounded to nearest even, or fp32).
template <typename Out>
__global__ void rmsnorm_rows_kernel(const float* x, const float* w, Out* y, int64_t D, float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float reduce_scratch[32];
  const float* row = x + int64_t(blockIdx.x) * D;
  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum_squares += row[i] * row[i];
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    store_from_float(y, int64_t(blockIdx.x) * D + i, row[i] * inverse_rms * w[i]);
}

// The same for rows of D ≤ 4·kRowVec4 floats with D % 4 == 0: the row and the weights are read
// once, as float4, before the reduction (every load in flight at once), and kept in registers
// for the scaling. One block per row is all a decode step has: there the scalar loop above spent
// ~8.6 µs per 2304-wide row on dependent load latency.
constexpr int kRowVec4 = 4;  // float4 per thread: rows up to 4·4·256 = 4096 wide

// Stores float4 chunk j of a normed row, x · r · w per element: as two bf16 pairs, or as one
// float4. (The bf16 one forms each pair's products right before its store, as the bf16-only
// kernel did.)
__device__ __forceinline__ void store_normed_chunk(uint16_t* y_row, int64_t j, float4 x, float4 w,
                                                   float inverse_rms) {
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(y_row);
  out[2 * j] = __floats2bfloat162_rn(x.x * inverse_rms * w.x, x.y * inverse_rms * w.y);
  out[2 * j + 1] = __floats2bfloat162_rn(x.z * inverse_rms * w.z, x.w * inverse_rms * w.w);
}
__device__ __forceinline__ void store_normed_chunk(float* y_row, int64_t j, float4 x, float4 w,
                                                   float inverse_rms) {
  reinterpret_cast<float4*>(y_row)[j] =
      make_float4(x.x * inverse_rms * w.x, x.y * inverse_rms * w.y, x.z * inverse_rms * w.z,
                  x.w * inverse_rms * w.w);
}

// The norm half of the vec4 row kernels: xv/wv hold thread t's float4 chunks t, t + 256, … of
// the row and of w (zeros past the row); y_row ← x · rsqrt(mean(x²) + eps) · w as Out (bf16
// bits or fp32).
template <typename Out>
__device__ __forceinline__ void rmsnorm_row_vec4(const float4 (&xv)[kRowVec4],
                                                 const float4 (&wv)[kRowVec4], int64_t D, float eps,
                                                 Out* y_row, float* reduce_scratch) {
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i)
    sum_squares += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  const int64_t D4 = D / 4;
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    if (j >= D4) continue;
    store_normed_chunk(y_row, j, xv[i], wv[i], inverse_rms);
  }
}

template <typename Out>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_vec4_kernel(const float* x, const float* w, Out* y, int64_t D, float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
  rmsnorm_row_vec4(xv, wv, D, eps, y + int64_t(blockIdx.x) * D, reduce_scratch);
}

// p += out, then the vec4 norm of p (the same norm code as rmsnorm_rows_vec4_kernel on the
// updated row, so the fused walk's rows equal the two-kernel walk's bit for bit).
template <typename Out>
__global__ void __launch_bounds__(kRowThreads)
    add_rmsnorm_rows_vec4_kernel(float* p, const float* out, const float* w, Out* y, int64_t D,
                                 float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
  rmsnorm_row_vec4(xv, wv, D, eps, y + int64_t(blockIdx.x) * D, reduce_scratch);
}

// dst = a + b; dst may alias a or b (each element is read, then written, by one thread).
__global__ void add_kernel(float* dst, const float* a, const float* b, int64_t n) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = a[i] + b[i];
}

// n4 float4 elements (all three pointers 16-byte aligned).
__global__ void add_vec4_kernel(float4* dst, const float4* a, const float4* b, int64_t n4) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 x = a[i], y = b[i];
    dst[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  }
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
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
// kNormOut (float4 rows of one tile only): the row's RMSNorm follows from the registers,
// normed[n] = bf16(out[n]·rsqrt(mean(out[n]²) + norm_eps)·out_w) as rmsnorm_to_bf16 (warp sums
// instead of block sums), so the norm does not read the row back.
struct AttnResNormOut {
  const float* out_w = nullptr;
  uint16_t* normed = nullptr;
  float eps = 0.0f;
};

template <int kVec, bool kNormOut = false>
__global__ void __launch_bounds__(kAttnResForwardWarps * 32, 3)
    attnres_forward_rows_kernel(AttnResSources sources, int S, const float* query,
                                const float* norm_w, float* out, int64_t N, int D, float eps,
                                AttnResNormOut norm = {}) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
      acc[k] = chunk_scale(acc[k], inv_den);
      if (c < chunks) o[c] = acc[k];
    }
    if constexpr (kNormOut && kVec == 4) {
      float ss = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) ss += chunk_dot(acc[k], acc[k]);  // zeros past the row
      ss = warp_sum(ss);
      const float inverse_rms = rsqrtf(ss / float(D) + norm.eps);
      const float4* w = reinterpret_cast<const float4*>(norm.out_w);
      uint16_t* normed_row = norm.normed + n * D;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = lane + 32 * k;
        if (c < chunks) store_normed_chunk(normed_row, c, acc[k], __ldg(w + c), inverse_rms);
      }
    }
    return;
  }
  if constexpr (kNormOut) __trap();  // the host sends only one-tile rows here

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

// Launches shared by the bf16 and fp32 overloads (the same grids and kernel choice for both).
template <typename Table, typename Id>
void embedding_gather_launch(const Table* table, const Id* tokens, int64_t N, int64_t D, float* out,
                             CUstream_st* stream) {
  if (N == 0) return;
  launch_pdl(embedding_gather_kernel<Table, Id>, unsigned(N), kRowThreads, 0, stream, table, tokens,
             D, out);
  check_last_error("embedding_gather");
}

// The float4 kernel for rows of D % 4 == 0 up to 4·kRowVec4·kRowThreads with 16-byte aligned
// pointers (every model width), the scalar one otherwise.
template <typename Out>
void rmsnorm_rows_launch(const float* x, const float* w, Out* y, int64_t N, int64_t D, float eps,
                         CUstream_st* stream, const char* what) {
  if (N == 0) return;
  if (D % 4 == 0 && D <= 4 * kRowVec4 * kRowThreads && aligned16(x) && aligned16(w) &&
      aligned16(y))
    launch_pdl(rmsnorm_rows_vec4_kernel<Out>, unsigned(N), kRowThreads, 0, stream, x, w, y, D, eps);
  else
    launch_pdl(rmsnorm_rows_kernel<Out>, unsigned(N), kRowThreads, 0, stream, x, w, y, D, eps);
  check_last_error(what);
}

// Fused on the float4 path; add_inplace then the norm otherwise (the same values either way).
template <typename Out>
void add_rmsnorm_rows_launch(float* p, const float* out, const float* w, Out* y, int64_t N,
                             int64_t D, float eps, CUstream_st* stream, const char* what) {
  if (N == 0) return;
  if (D % 4 == 0 && D <= 4 * kRowVec4 * kRowThreads && aligned16(p) && aligned16(out) &&
      aligned16(w) && aligned16(y)) {
    launch_pdl(add_rmsnorm_rows_vec4_kernel<Out>, unsigned(N), kRowThreads, 0, stream, p, out, w, y,
               D, eps);
    check_last_error(what);
    return;
  }
  add_inplace(p, out, N * D, stream);
  rmsnorm_rows_launch(p, w, y, N, D, eps, stream, what);
}

}  // namespace

void embedding_gather(const uint16_t* table, const int64_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream) {
  embedding_gather_launch(table, tokens, N, D, out, stream);
}
void embedding_gather(const uint16_t* table, const int32_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream) {
  embedding_gather_launch(table, tokens, N, D, out, stream);
}
void embedding_gather(const float* table, const int64_t* tokens, int64_t N, int64_t D, float* out,
                      CUstream_st* stream) {
  embedding_gather_launch(table, tokens, N, D, out, stream);
}
void embedding_gather(const float* table, const int32_t* tokens, int64_t N, int64_t D, float* out,
                      CUstream_st* stream) {
  embedding_gather_launch(table, tokens, N, D, out, stream);
}

void rmsnorm_to_bf16(const float* x, const float* w, uint16_t* y, int64_t N, int64_t D, float eps,
                     CUstream_st* stream) {
  rmsnorm_rows_launch(x, w, y, N, D, eps, stream, "rmsnorm_to_bf16");
}
void rmsnorm_to_f32(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps,
                    CUstream_st* stream) {
  rmsnorm_rows_launch(x, w, y, N, D, eps, stream, "rmsnorm_to_f32");
}

void add_rmsnorm_to_bf16(float* p, const float* out, const float* w, uint16_t* y, int64_t N,
                         int64_t D, float eps, CUstream_st* stream) {
  add_rmsnorm_rows_launch(p, out, w, y, N, D, eps, stream, "add_rmsnorm_to_bf16");
}
void add_rmsnorm_to_f32(float* p, const float* out, const float* w, float* y, int64_t N, int64_t D,
                        float eps, CUstream_st* stream) {
  add_rmsnorm_rows_launch(p, out, w, y, N, D, eps, stream, "add_rmsnorm_to_f32");
}

void add(float* dst, const float* a, const float* b, int64_t n, CUstream_st* stream) {
  if (n == 0) return;
  const auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (n % 4 == 0 && aligned(dst) && aligned(a) && aligned(b)) {
    const int64_t n4 = n / 4;
    const int blocks = int(n4 / 1024 + 1 < 4096 ? n4 / 1024 + 1 : 4096);
    launch_pdl(add_vec4_kernel, blocks, 256, 0, stream, reinterpret_cast<float4*>(dst),
               reinterpret_cast<const float4*>(a), reinterpret_cast<const float4*>(b), n4);
    check_last_error("add");
    return;
  }
  const int blocks = int(n / 1024 + 1 < 4096 ? n / 1024 + 1 : 4096);
  launch_pdl(add_kernel, blocks, 256, 0, stream, dst, a, b, n);
  check_last_error("add");
}

void add_inplace(float* dst, const float* src, int64_t n, CUstream_st* stream) {
  add(dst, dst, src, n, stream);
}

namespace {

// attnres_forward, then (norm.normed != nullptr) rmsnorm_to_bf16 of its output, fused into the
// row kernel where a row is one float4 tile.
void attnres_forward_launch(const float* const* src, int S, const float* query, const float* norm_w,
                            float* out, const AttnResNormOut& norm, int64_t N, int64_t D, float eps,
                            CUstream_st* stream) {
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
  const bool fuse_norm = norm.normed != nullptr && vec4 && N >= kAttnResWarpRowsMinN &&
                         D <= 4 * 32 * kAttnResChunksPerLane && aligned16(norm.out_w) &&
                         aligned16(norm.normed);
  if (N < kAttnResWarpRowsMinN) {
    launch_pdl(attnres_forward_block_rows_kernel, unsigned(N), kRowThreads, 0, stream, sources, S,
               query, norm_w, out, D, eps);
  } else {
    const int64_t blocks = (N + kAttnResForwardWarps - 1) / kAttnResForwardWarps;
    const size_t smem = size_t(D) * sizeof(float);
    if (fuse_norm)
      launch_attnres_rows(attnres_forward_rows_kernel<4, true>, blocks, kAttnResForwardWarps * 32,
                          smem, stream, sources, S, query, norm_w, out, N, int(D), eps, norm);
    else if (vec4)
      launch_attnres_rows(attnres_forward_rows_kernel<4>, blocks, kAttnResForwardWarps * 32, smem,
                          stream, sources, S, query, norm_w, out, N, int(D), eps, AttnResNormOut{});
    else
      launch_attnres_rows(attnres_forward_rows_kernel<1>, blocks, kAttnResForwardWarps * 32, smem,
                          stream, sources, S, query, norm_w, out, N, int(D), eps, AttnResNormOut{});
  }
  check_last_error("attnres_forward");
  if (norm.normed != nullptr && !fuse_norm)
    rmsnorm_to_bf16(out, norm.out_w, norm.normed, N, D, norm.eps, stream);
}

}  // namespace

void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, int64_t N, int64_t D, float eps, CUstream_st* stream) {
  attnres_forward_launch(src, S, query, norm_w, out, AttnResNormOut{}, N, D, eps, stream);
}

void attnres_forward_norm(const float* const* src, int S, const float* query, const float* norm_w,
                          float* out, const float* out_w, uint16_t* normed, int64_t N, int64_t D,
                          float eps, float norm_eps, CUstream_st* stream) {
  DM_CHECK(out_w != nullptr && normed != nullptr,
           "attnres_forward_norm (CUDA): out_w and normed are needed");
  AttnResNormOut norm;
  norm.out_w = out_w;
  norm.normed = normed;
  norm.eps = norm_eps;
  attnres_forward_launch(src, S, query, norm_w, out, norm, N, D, eps, stream);
}

}  // namespace dm::cuda
