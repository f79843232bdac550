// Kernels of the GPU residual stream (residual_ops.h): one block per row for the row reductions
// (RMSNorm, AttnRes), grid-stride loops for the element-wise ones; plus the training-side
// backward kernels (AttnRes, embedding) and the deterministic sum of squares.
#include <algorithm>

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
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_to_bf16_vec4_kernel(const float* x, const float* w, __nv_bfloat16* y, int64_t D,
                                float eps) {
  __shared__ float reduce_scratch[32];
  const int64_t D4 = D / 4;
  const float4* row = reinterpret_cast<const float4*>(x + int64_t(blockIdx.x) * D);
  const float4* weight = reinterpret_cast<const float4*>(w);
  float4 xv[kRowVec4], wv[kRowVec4];
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    xv[i] = j < D4 ? row[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    wv[i] = j < D4 ? weight[j] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i)
    sum_squares += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(y + int64_t(blockIdx.x) * D);
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

// p += out, then the vec4 norm of p (same arithmetic as rmsnorm_to_bf16_vec4_kernel on the
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
  float sum_squares = 0.0f;
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
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i)
    sum_squares += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = rsqrtf(sum_squares / float(D) + eps);
  __nv_bfloat162* normed = reinterpret_cast<__nv_bfloat162*>(y + int64_t(blockIdx.x) * D);
#pragma unroll
  for (int i = 0; i < kRowVec4; ++i) {
    const int64_t j = threadIdx.x + int64_t(i) * kRowThreads;
    if (j >= D4) continue;
    normed[2 * j] = __floats2bfloat162_rn(xv[i].x * inverse_rms * wv[i].x,
                                          xv[i].y * inverse_rms * wv[i].y);
    normed[2 * j + 1] = __floats2bfloat162_rn(xv[i].z * inverse_rms * wv[i].z,
                                              xv[i].w * inverse_rms * wv[i].w);
  }
}

__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

struct AttnResSources {
  const float* src[kAttnResCudaMaxSources];
};

// One block per row: S logits (two block reductions per source), softmax in shared memory, then
// the weighted sum. out may alias a source: every element is read from all sources, then written
// by the same thread.
__global__ void attnres_forward_kernel(AttnResSources sources, int S, const float* query,
                                       const float* norm_w, float* out, int64_t D, float eps) {
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

// ---- training side ---------------------------------------------------------------------------

// Blocks of the AttnRes backward row kernel: each owns rows blockIdx.x + k·gridDim.x and one fp64
// partial of G [D] in the workspace. A function of N only, so the reduction order (hence the
// bits of dquery / dnorm_w) never depends on scheduling.
constexpr int64_t kAttnResBwdMaxBlocks = 512;
int64_t attnres_backward_blocks(int64_t N) { return std::min<int64_t>(N, kAttnResBwdMaxBlocks); }

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

// Three fp64 block sums at once (shared ≥ 96 doubles): the per-source statistics of a row.
__device__ __forceinline__ void block_sum3_double(double& a, double& b, double& c, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  c = warp_sum(c);
  __syncthreads();
  if (lane == 0) {
    shared[warp] = a;
    shared[32 + warp] = b;
    shared[64 + warp] = c;
  }
  __syncthreads();
  a = warp_sum(lane < warps ? shared[lane] : 0.0);
  b = warp_sum(lane < warps ? shared[32 + lane] : 0.0);
  c = warp_sum(lane < warps ? shared[64 + lane] : 0.0);
}

struct AttnResGradTargets {
  float* dsrc[kAttnResCudaMaxSources];
};

// AttnRes backward, stage 1. Block b handles rows n = b, b + gridDim.x, …; per row:
//   1. per source j (block reductions over D, fp64): ss_j = Σ V², s_j = Σ V γ w, da_j = Σ dout·V;
//   2. thread 0: r_j = 1/sqrt(ss_j/D + eps), softmax a_j of r_j·s_j, dl_j = a_j (da_j − Σ_k a_k da_k),
//      c_j = dl_j r_j, c3_j = dl_j s_j r_j³ / D (the CPU formulas, fp64);
//   3. element pass: dsrc[j][d] += a_j g_d + c_j γ_d w_d − c3_j V_jd, and G[d] += Σ_j c_j V_jd into
//      this block's fp64 partial (G = partial + b·D; thread t owns d ≡ t mod blockDim.x, so no
//      two threads touch one element). partial == nullptr: no parameter gradient wanted.
__global__ void attnres_backward_rows_kernel(AttnResSources sources, AttnResGradTargets targets,
                                             int S, const float* query, const float* norm_w,
                                             const float* dout, double* partial, int64_t N,
                                             int64_t D, float eps) {
  __shared__ double reduce_scratch[96];
  __shared__ double coef_a[kAttnResCudaMaxSources], coef_c[kAttnResCudaMaxSources],
      coef_c3[kAttnResCudaMaxSources], stat_r[kAttnResCudaMaxSources],
      stat_s[kAttnResCudaMaxSources], stat_da[kAttnResCudaMaxSources];
  double* G = partial ? partial + int64_t(blockIdx.x) * D : nullptr;
  if (G)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) G[d] = 0.0;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int64_t row = n * D;
    const float* g = dout + row;
    for (int j = 0; j < S; ++j) {
      const float* v = sources.src[j] + row;
      double ss = 0.0, dot = 0.0, gv = 0.0;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        const double x = v[d];
        ss += x * x;
        dot += x * double(norm_w[d]) * double(query[d]);
        gv += double(g[d]) * x;
      }
      block_sum3_double(ss, dot, gv, reduce_scratch);
      if (threadIdx.x == 0) {
        const double r = 1.0 / sqrt(ss / double(D) + double(eps));
        stat_r[j] = r;
        stat_s[j] = dot;
        stat_da[j] = gv;
        coef_a[j] = r * dot;  // logit, turned into the softmax weight below
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double mx = coef_a[0];
      for (int j = 1; j < S; ++j) mx = fmax(mx, coef_a[j]);
      double den = 0.0;
      for (int j = 0; j < S; ++j) den += (coef_a[j] = exp(coef_a[j] - mx));
      double mean_da = 0.0;
      for (int j = 0; j < S; ++j) {
        coef_a[j] /= den;
        mean_da += coef_a[j] * stat_da[j];
      }
      for (int j = 0; j < S; ++j) {
        const double dl = coef_a[j] * (stat_da[j] - mean_da);  // softmax backward
        const double r = stat_r[j];
        coef_c[j] = dl * r;
        coef_c3[j] = dl * stat_s[j] * r * r * r / double(D);  // through r_j
      }
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const double gd = g[d], gw = double(norm_w[d]) * double(query[d]);
      double gsum = 0.0;
      for (int j = 0; j < S; ++j) {
        const double v = sources.src[j][row + d];
        if (float* dv = targets.dsrc[j])
          dv[row + d] += float(coef_a[j] * gd + coef_c[j] * gw - coef_c3[j] * v);
        gsum += coef_c[j] * v;
      }
      if (G) G[d] += gsum;
    }
    __syncthreads();  // the next row rewrites the shared coefficients
  }
}

// AttnRes backward, stage 2: G[d] = Σ_b partial[b, d] in block order, then
// dquery[d] += G γ_d, dnorm_w[d] += G w_d (grid-stride over d; reads coalesced across d).
__global__ void attnres_backward_params_kernel(const double* partial, int64_t blocks,
                                               const float* query, const float* norm_w,
                                               float* dquery, float* dnorm_w, int64_t D) {
  for (int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; d < D;
       d += int64_t(gridDim.x) * blockDim.x) {
    double G = 0.0;
    for (int64_t b = 0; b < blocks; ++b) G += partial[b * D + d];
    if (dquery) dquery[d] += float(G * double(norm_w[d]));
    if (dnorm_w) dnorm_w[d] += float(G * double(query[d]));
  }
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
  const int blocks = int(n / 1024 + 1 < 4096 ? n / 1024 + 1 : 4096);
  add_inplace_kernel<<<blocks, 256, 0, stream>>>(dst, src, n);
  check_last_error("add_inplace");
}

void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, int64_t N, int64_t D, float eps, CUstream_st* stream) {
  DM_CHECK(S >= 1 && S <= kAttnResCudaMaxSources, "attnres (CUDA): ", S, " sources (1..",
           kAttnResCudaMaxSources, " supported)");
  if (N == 0) return;
  AttnResSources sources{};
  for (int j = 0; j < S; ++j) sources.src[j] = src[j];
  attnres_forward_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(sources, S, query, norm_w, out,
                                                                  D, eps);
  check_last_error("attnres_forward");
}

// ---- training side ---------------------------------------------------------------------------

size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S) {
  return align256(size_t(attnres_backward_blocks(N)) * size_t(D) * sizeof(double));
}

void attnres_backward(const float* const* src, int S, const float* query, const float* norm_w,
                      const float* dout, float* const* dsrc, float* dquery, float* dnorm_w,
                      int64_t N, int64_t D, float eps, void* workspace, CUstream_st* stream) {
  DM_CHECK(S >= 1 && S <= kAttnResCudaMaxSources, "attnres_backward (CUDA): ", S,
           " sources (1..", kAttnResCudaMaxSources, " supported)");
  DM_CHECK(N >= 0 && D >= 0, "attnres_backward (CUDA): bad shape N=", N, " D=", D);
  if (N == 0 || D == 0) return;
  const bool param_grads = dquery != nullptr || dnorm_w != nullptr;
  DM_CHECK(!param_grads || workspace != nullptr,
           "attnres_backward (CUDA): a workspace is needed for dquery / dnorm_w");
  AttnResSources sources{};
  AttnResGradTargets targets{};
  for (int j = 0; j < S; ++j) {
    sources.src[j] = src[j];
    targets.dsrc[j] = dsrc ? dsrc[j] : nullptr;
  }
  const int64_t blocks = attnres_backward_blocks(N);
  double* partial = param_grads ? static_cast<double*>(workspace) : nullptr;
  attnres_backward_rows_kernel<<<unsigned(blocks), kRowThreads, 0, stream>>>(
      sources, targets, S, query, norm_w, dout, partial, N, D, eps);
  check_last_error("attnres_backward (rows)");
  if (!param_grads) return;
  attnres_backward_params_kernel<<<elementwise_blocks(D, 256), 256, 0, stream>>>(
      partial, blocks, query, norm_w, dquery, dnorm_w, D);
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
