// Kernels of the MoE backward (moe_kernels.h "Backward" section; checked entry points in
// moe_backward.cpp): router backward, routing-weight gradients, the weighted gather of the
// output gradient into expert-sorted rows and the per-token sum of the rows' input gradients
// (all memory-bound; every reduction has a fixed order: deterministic run to run, no atomics),
// and the grouped dh GEMM of the down projection (cublasGemmGroupedBatchedEx).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_backward.h"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda::moe_detail {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 256;

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  DM_CHECK(status == cudaSuccess, what, ": ", cudaGetErrorString(status));
}

// Grid of a grid-stride loop over n items: enough blocks to fill the GPU, never 0.
int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(uint32_t(bits) << 16);
}

// One warp per token: zero the row [E], then each selected expert's logit gradient. The sums run
// serially in slot (= ascending expert) order in every lane, like the CPU op and the forward's
// renormalisation, so all lanes agree bit for bit.
__global__ void route_backward_kernel(const float* scores, const int32_t* idx,
                                      const float* dweights, int64_t N, int E, int k,
                                      bool renormalize, float scaling, float* dlogits) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= N) return;  // uniform per warp; no block-wide barrier below
  const float* score_row = scores + t * E;
  const int32_t* idx_row = idx + t * k;
  const float* dw_row = dweights + t * k;
  float* out = dlogits + t * E;
  for (int e = lane; e < E; e += 32) out[e] = 0.0f;
  // w_i = s_i·c, c = scaling/(S + ε):  ds_j = c·(dw_j − Σ_i dw_i·s_i/(S + ε)).
  float scale = scaling, correction = 0.0f;
  if (renormalize) {
    float sum = 0.0f, weighted = 0.0f;
    for (int i = 0; i < k; ++i) {
      const float s = score_row[idx_row[i]];
      sum += s;
      weighted += dw_row[i] * s;
    }
    const float denominator = sum + 1e-20f;  // the forward's ε
    scale = scaling / denominator;
    correction = weighted / denominator;
  }
  __syncwarp();  // the zeros above land before the selected entries below (other lanes' writes)
  for (int i = lane; i < k; i += 32) {
    const int e = idx_row[i];
    const float s = score_row[e];
    out[e] = scale * (dw_row[i] - correction) * s * (1.0f - s);  // σ' = s(1 − s)
  }
}

// One warp per (token, slot) pair: dweights[pair] = <dy[t], out[row]> over D, lane-strided
// partial sums then a fixed butterfly.
__global__ void expert_weight_grads_kernel(const float* dy, const uint16_t* out,
                                           const int32_t* row_of_pair, int64_t N, int k,
                                           int64_t D, float* dweights) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t pair = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (pair >= N * k) return;
  const int64_t t = pair / k;
  const float* dy_row = dy + t * D;
  const uint16_t* out_row = out + int64_t(row_of_pair[pair]) * D;
  float acc = 0.0f;
  for (int64_t c = lane; c < D; c += 32) acc += dy_row[c] * bf16_bits_to_float(out_row[c]);
  acc = warp_sum(acc);
  if (lane == 0) dweights[pair] = acc;
}

// Four columns per thread: dout[r, 4c..4c+3] = bf16(weight·dy[token, 4c..4c+3]).
__global__ void scale_permute_rows_kernel(const float4* dy, const int32_t* token,
                                          const int32_t* slot, const float* w, int64_t rows,
                                          int k, int64_t chunks, uint2* dout) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = rows * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks, c = i - r * chunks;
    const int64_t t = token[r];
    const float weight = w[t * k + slot[r]];
    const float4 v = dy[t * chunks + c];
    uint2 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
    pairs[0] = __floats2bfloat162_rn(weight * v.x, weight * v.y);
    pairs[1] = __floats2bfloat162_rn(weight * v.z, weight * v.w);
    dout[i] = packed;
  }
}

// Four columns per thread: dx[t] (+)= Σ_s sorted[row_of_pair[t·k + s]] in slot order.
__global__ void unpermute_sum_rows_kernel(const float4* sorted, const int32_t* row_of_pair,
                                          int64_t N, int k, int64_t chunks, float4* dx,
                                          bool accumulate) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = N * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks, c = i - t * chunks;
    float4 acc = accumulate ? dx[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < k; ++s) {
      const float4 v = sorted[int64_t(row_of_pair[t * k + s]) * chunks + c];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    dx[i] = acc;
  }
}

// One warp: the A/B/C pointer arrays of the grouped dh GEMM, group g = rank of expert e among
// the non-empty experts in ascending order (the order run_down_backward_grouped gives the host
// descriptor arrays). A = W_down_e [Din, F], B = dout rows [n_e, Din], C = dh rows [n_e, F].
__global__ void down_backward_pointer_kernel(const int64_t* offsets, DownBackwardGemm g) {
  const int lane = int(threadIdx.x);
  const void** A = g.pointer_arrays;
  const void** B = A + g.E;
  void** C = const_cast<void**>(B + g.E);
  int carry = 0;
  for (int base = 0; base < g.E; base += 32) {  // same trip count in every lane: ballot is safe
    const int e = base + lane;
    const int64_t begin = e < g.E ? offsets[e] : 0;
    const bool nonempty = e < g.E && offsets[e + 1] > begin;
    const unsigned mask = __ballot_sync(0xffffffffu, nonempty);
    if (nonempty) {
      const int slot = carry + __popc(mask & ((1u << lane) - 1u));
      A[slot] = g.down_w + int64_t(e) * g.Din * g.F;
      B[slot] = g.dout + begin * g.Din;
      C[slot] = g.dh + begin * g.F;
    }
    carry += __popc(mask);
  }
}

}  // namespace

size_t down_backward_grouped_host_bytes(int E) {
  return size_t(E) * (2 * sizeof(cublasOperation_t) + 7 * sizeof(int) + 2 * sizeof(float));
}

void run_down_backward_grouped(void* cublas_handle, const DownBackwardGemm& g,
                               const int64_t* host_offsets, const int64_t* device_offsets,
                               void* host_scratch, CUstream_st* stream) {
  const int E = g.E;
  int groups = 0;
  for (int e = 0; e < E; ++e) groups += host_offsets[e + 1] > host_offsets[e];
  if (groups == 0) return;
  down_backward_pointer_kernel<<<1, 32, 0, stream>>>(device_offsets, g);
  check_launch("down_backward_pointer_kernel");
  // Host descriptor arrays, one entry per group (one problem per group).
  char* cursor = static_cast<char*>(host_scratch);
  auto take = [&](size_t bytes) {
    void* p = cursor;
    cursor += bytes;
    return p;
  };
  auto* op_a = static_cast<cublasOperation_t*>(take(E * sizeof(cublasOperation_t)));
  auto* op_b = static_cast<cublasOperation_t*>(take(E * sizeof(cublasOperation_t)));
  int* m = static_cast<int*>(take(E * sizeof(int)));
  int* n = static_cast<int*>(take(E * sizeof(int)));
  int* kdim = static_cast<int*>(take(E * sizeof(int)));
  int* lda = static_cast<int*>(take(E * sizeof(int)));
  int* ldb = static_cast<int*>(take(E * sizeof(int)));
  int* ldc = static_cast<int*>(take(E * sizeof(int)));
  int* group_size = static_cast<int*>(take(E * sizeof(int)));
  float* alpha = static_cast<float*>(take(E * sizeof(float)));
  float* beta = static_cast<float*>(take(E * sizeof(float)));
  // Column-major view (see gemm.cu): row-major dh[n_e, F] = dout[n_e, Din]·W[Din, F] is
  // dhᵀ [F, n_e] (ld F) = W as col-major [F, Din] (ld F) · dout as col-major [Din, n_e] (ld Din),
  // both operands untransposed.
  int i = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t rows = host_offsets[e + 1] - host_offsets[e];
    if (rows == 0) continue;
    op_a[i] = CUBLAS_OP_N;
    op_b[i] = CUBLAS_OP_N;
    m[i] = int(g.F);
    n[i] = int(rows);
    kdim[i] = int(g.Din);
    lda[i] = int(g.F);
    ldb[i] = int(g.Din);
    ldc[i] = int(g.F);
    group_size[i] = 1;
    alpha[i] = 1.0f;
    beta[i] = 0.0f;
    ++i;
  }
  const void* const* A = g.pointer_arrays;
  const void* const* B = A + E;
  void* const* C = const_cast<void* const*>(B + E);
  cublasHandle_t handle = static_cast<cublasHandle_t>(cublas_handle);
  const cublasStatus_t set_status = cublasSetStream(handle, stream);
  DM_CHECK(set_status == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed: ", int(set_status));
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      handle, op_a, op_b, m, n, kdim, alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, beta, C,
      CUDA_R_16BF, ldc, groups, group_size, CUBLAS_COMPUTE_32F);
  DM_CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasGemmGroupedBatchedEx (MoE dh, ", groups,
           " groups) failed: cuBLAS status ", int(status));
}

void launch_route_backward(const float* scores, const int32_t* idx, const float* dweights,
                           int64_t N, int E, int k, bool renormalize, float scaling,
                           float* dlogits, CUstream_st* stream) {
  if (N == 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_pdl(route_backward_kernel, unsigned(blocks), kWarpsPerBlock * 32, 0, stream, scores, idx,
             dweights, N, E, k, renormalize, scaling, dlogits);
  check_launch("route_backward_kernel");
}

void launch_expert_weight_grads(const float* dy, const uint16_t* out, const int32_t* row_of_pair,
                                int64_t N, int k, int64_t D, float* dweights,
                                CUstream_st* stream) {
  if (N == 0) return;
  const int64_t blocks = (N * k + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_pdl(expert_weight_grads_kernel, unsigned(blocks), kWarpsPerBlock * 32, 0, stream, dy, out,
             row_of_pair, N, k, D, dweights);
  check_launch("expert_weight_grads_kernel");
}

void launch_scale_permute_rows(const float* dy, const int32_t* token, const int32_t* slot,
                               const float* w, int64_t rows, int k, int64_t D, uint16_t* dout,
                               CUstream_st* stream) {
  if (rows == 0 || D == 0) return;
  const int64_t chunks = D / 4;
  launch_pdl(scale_permute_rows_kernel, grid_for(rows * chunks), kThreads, 0, stream,
             reinterpret_cast<const float4*>(dy), token, slot, w, rows, k, chunks,
             reinterpret_cast<uint2*>(dout));
  check_launch("scale_permute_rows_kernel");
}

void launch_unpermute_sum_rows(const float* sorted, const int32_t* row_of_pair, int64_t N, int k,
                               int64_t D, float* dx, bool accumulate, CUstream_st* stream) {
  if (N == 0 || D == 0) return;
  const int64_t chunks = D / 4;
  launch_pdl(unpermute_sum_rows_kernel, grid_for(N * chunks), kThreads, 0, stream,
             reinterpret_cast<const float4*>(sorted), row_of_pair, N, k, chunks,
             reinterpret_cast<float4*>(dx), accumulate);
  check_launch("unpermute_sum_rows_kernel");
}

}  // namespace dm::cuda::moe_detail
