// Kernels of the GPU residual stream (residual_ops.h): one block per row for the row reductions
// (RMSNorm, AttnRes), grid-stride loops for the element-wise ones.
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
  rmsnorm_to_bf16_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(
      x, w, reinterpret_cast<__nv_bfloat16*>(y), D, eps);
  check_last_error("rmsnorm_to_bf16");
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

}  // namespace dm::cuda
