// Softmax cross-entropy on the GPU (elementwise.h cross_entropy_forward_backward): one block per
// row. Pass 1: online max / sum of e^{z − max} and the first argmax; pass 2 writes the gradient
// (e^{z − logsumexp}·scale, minus scale at the target). A second kernel sums the per-row losses
// in row order (fp64), so results are deterministic run to run.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/vector_access.cuh"

namespace dm::cuda {
namespace {

constexpr int kRowThreads = 256;  // threads per row of the scalar kernel

struct SoftmaxPartial {
  float max, sum;  // running max and Σ e^{z − max}
  float best;      // first maximum and its index
  int best_index;
};

__device__ __forceinline__ SoftmaxPartial softmax_merge(SoftmaxPartial a, SoftmaxPartial b) {
  SoftmaxPartial r;
  r.max = fmaxf(a.max, b.max);
  // e^{−inf − x} = 0 handles an empty side (sum 0, max −inf) without NaN as long as r.max is
  // finite; two empty sides give r.max = −inf: keep the sum 0 then.
  r.sum = r.max == -INFINITY ? 0.0f : a.sum * expf(a.max - r.max) + b.sum * expf(b.max - r.max);
  const bool take_b = b.best > a.best || (b.best == a.best && b.best_index < a.best_index);
  r.best = take_b ? b.best : a.best;
  r.best_index = take_b ? b.best_index : a.best_index;
  return r;
}

__device__ __forceinline__ SoftmaxPartial softmax_shuffle_down(SoftmaxPartial p, int offset) {
  SoftmaxPartial o;
  o.max = __shfl_xor_sync(0xffffffffu, p.max, offset);
  o.sum = __shfl_xor_sync(0xffffffffu, p.sum, offset);
  o.best = __shfl_xor_sync(0xffffffffu, p.best, offset);
  o.best_index = __shfl_xor_sync(0xffffffffu, p.best_index, offset);
  return o;
}

// One logit z at index v into a thread's running partial (increasing v per thread).
__device__ __forceinline__ void softmax_add(SoftmaxPartial& p, float z, int64_t v) {
  if (z > p.max) {
    p.sum = p.sum * expf(p.max - z) + 1.0f;  // p.max = −inf at first: e^{−inf} = 0
    p.max = z;
  } else if (z != -INFINITY) {  // −inf logits add nothing (and e^{−inf − (−inf)} is NaN)
    p.sum += expf(z - p.max);
  }
  if (z > p.best) {  // increasing v: keeps the first maximum
    p.best = z;
    p.best_index = int(v);
  }
}

// The block's partials merged in a fixed order (lanes, then warps): row_stats[0] = logsumexp,
// the row's loss and flags written. row_stats[1] (z[target]) is set by thread 0 before the call.
// Ends with a barrier; every thread of the block calls it.
__device__ __forceinline__ void softmax_finish_row(SoftmaxPartial p, SoftmaxPartial* warp_partials,
                                                   float* row_stats, int64_t row, int64_t target,
                                                   int64_t V, double* row_loss,
                                                   int32_t* row_flags) {
  for (int o = 16; o > 0; o >>= 1) p = softmax_merge(p, softmax_shuffle_down(p, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < warps ? warp_partials[lane] : SoftmaxPartial{-INFINITY, 0.0f, -INFINITY, int(V)};
    for (int o = 16; o > 0; o >>= 1) p = softmax_merge(p, softmax_shuffle_down(p, o));
    if (lane == 0) {
      const float log_sum_exp = p.max + logf(p.sum);
      row_stats[0] = log_sum_exp;
      row_loss[row] = double(log_sum_exp) - double(row_stats[1]);
      row_flags[row] = 1 | (p.best_index == target ? 2 : 0);
    }
  }
  __syncthreads();
}

// One block per row. row_loss [N] (double, 0 for ignored rows), row_flags [N]: bit 0 counted,
// bit 1 argmax == target.
template <typename Storage, typename GradStorage>
__global__ void cross_entropy_rows_kernel(const Storage* logits, const int64_t* targets,
                                          GradStorage* dlogits, int64_t V, float scale,
                                          double* row_loss, int32_t* row_flags) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ SoftmaxPartial warp_partials[32];
  __shared__ float row_stats[2];  // logsumexp, z[target]
  const int64_t row = blockIdx.x;
  const int64_t offset = row * V;
  const int64_t target = targets[row];
  const bool counted = target >= 0 && target < V;
  if (!counted) {
    if (dlogits)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
        store_from_float(dlogits, offset + v, 0.0f);
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0;
      row_flags[row] = 0;
    }
    return;
  }
  SoftmaxPartial p{-INFINITY, 0.0f, -INFINITY, int(V)};
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    softmax_add(p, load_as_float(logits, offset + v), v);
  if (threadIdx.x == 0) row_stats[1] = load_as_float(logits, offset + target);  // before writes
  softmax_finish_row(p, warp_partials, row_stats, row, target, V, row_loss, row_flags);
  if (dlogits == nullptr) return;
  const float log_sum_exp = row_stats[0];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float z = load_as_float(logits, offset + v);
    const float gradient = expf(z - log_sum_exp) * scale - (v == target ? scale : 0.0f);
    store_from_float(dlogits, offset + v, gradient);
  }
}

// fp32 logits with V % 4 == 0 (every row 16-byte aligned): the same per-row math as the kernel
// above on float4 loads, the gradient stored 4 elements at a time, and 1024 threads a row. The
// larger block is for L2: an SM holds at most two such rows (2·V·4 bytes, 256 KB at V = 32000;
// 34 MB over 132 SMs), so the gradient pass re-reads the row from L2, where the 256-thread
// kernel keeps up to eight rows an SM in flight (135 MB at V = 32000, past the 50 MB L2) and
// read most of them twice from HBM: 308 µs for 2097 × 32000 on the H200, ~2.5× the bytes' time.
// Each thread walks its own elements in increasing order, so the result is deterministic (its
// low bits differ from the scalar kernel's, whose threads hold other elements).
constexpr int kCrossEntropyVecThreads = 1024;
template <typename GradStorage>
__global__ void __launch_bounds__(kCrossEntropyVecThreads)
    cross_entropy_rows_vec4_kernel(const float* logits, const int64_t* targets,
                                   GradStorage* dlogits, int64_t V, float scale, double* row_loss,
                                   int32_t* row_flags) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ SoftmaxPartial warp_partials[32];
  __shared__ float row_stats[2];  // logsumexp, z[target]
  const int64_t row = blockIdx.x;
  const int64_t offset = row * V, V4 = V / 4;
  const float4* row4 = reinterpret_cast<const float4*>(logits + offset);
  const int64_t target = targets[row];
  if (!(target >= 0 && target < V)) {
    const float zeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (dlogits)
      for (int64_t i = threadIdx.x; i < V4; i += blockDim.x)
        store_vector_from_float<4>(dlogits, offset + 4 * i, zeros);
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0;
      row_flags[row] = 0;
    }
    return;
  }
  SoftmaxPartial p{-INFINITY, 0.0f, -INFINITY, int(V)};
  for (int64_t i = threadIdx.x; i < V4; i += blockDim.x) {
    const float4 z = row4[i];
    softmax_add(p, z.x, 4 * i);
    softmax_add(p, z.y, 4 * i + 1);
    softmax_add(p, z.z, 4 * i + 2);
    softmax_add(p, z.w, 4 * i + 3);
  }
  if (threadIdx.x == 0) row_stats[1] = logits[offset + target];
  softmax_finish_row(p, warp_partials, row_stats, row, target, V, row_loss, row_flags);
  if (dlogits == nullptr) return;
  const float log_sum_exp = row_stats[0];
  for (int64_t i = threadIdx.x; i < V4; i += blockDim.x) {
    const float4 z4 = row4[i];
    const float z[4] = {z4.x, z4.y, z4.z, z4.w};
    float gradient[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      gradient[e] = expf(z[e] - log_sum_exp) * scale - (4 * i + e == target ? scale : 0.0f);
    store_vector_from_float<4>(dlogits, offset + 4 * i, gradient);
  }
}

// One block: sums row_loss / row_flags in a fixed order into *result.
constexpr int kCrossEntropyReduceThreads = 256;
__global__ void cross_entropy_reduce_kernel(const double* row_loss, const int32_t* row_flags,
                                            int64_t N, CrossEntropyDeviceResult* result) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ double loss_sums[kCrossEntropyReduceThreads];
  __shared__ long long counts[kCrossEntropyReduceThreads], corrects[kCrossEntropyReduceThreads];
  double loss = 0.0;
  long long count = 0, correct = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    loss += row_loss[n];
    count += row_flags[n] & 1;
    correct += (row_flags[n] >> 1) & 1;
  }
  loss_sums[threadIdx.x] = loss;
  counts[threadIdx.x] = count;
  corrects[threadIdx.x] = correct;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (int(threadIdx.x) < stride) {
      loss_sums[threadIdx.x] += loss_sums[threadIdx.x + stride];
      counts[threadIdx.x] += counts[threadIdx.x + stride];
      corrects[threadIdx.x] += corrects[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    result->loss_sum = loss_sums[0];
    result->count = counts[0];
    result->correct = corrects[0];
  }
}

// The vec4 row kernel: V % 4 == 0, 16-byte aligned logits and gradient, unless
// DM_CROSS_ENTROPY_ROWS=scalar (read at each call; the A/B reference).
template <typename GradStorage>
bool rows_vec4(const float* logits, const GradStorage* dlogits, int64_t V) {
  const char* env = std::getenv("DM_CROSS_ENTROPY_ROWS");
  if (env && std::strcmp(env, "scalar") == 0) return false;
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return V % 4 == 0 && aligned16(logits) && (dlogits == nullptr || aligned16(dlogits));
}

template <typename Storage, typename GradStorage>
void cross_entropy_launch(const Storage* logits, const int64_t* targets, GradStorage* dlogits,
                          int64_t N, int64_t V, double scale, CrossEntropyDeviceResult* result,
                          void* workspace, Stream stream) {
  DM_CHECK(N >= 0 && V > 0, "cuda cross_entropy: bad shape N=", N, " V=", V);
  DM_CHECK(N < (int64_t(1) << 31) && V < (int64_t(1) << 31), "cuda cross_entropy: N=", N,
           " or V=", V, " beyond 2^31");
  DM_CHECK(result != nullptr, "cuda cross_entropy: result pointer is null");
  DM_CHECK(N == 0 || workspace != nullptr,
           "cuda cross_entropy: workspace is null (size it with cross_entropy_workspace_bytes)");
  double* row_loss = static_cast<double*>(workspace);             // [N]
  int32_t* row_flags = reinterpret_cast<int32_t*>(row_loss + N);  // [N]
  bool vec4 = false;
  if constexpr (std::is_same_v<Storage, float>) vec4 = rows_vec4(logits, dlogits, V);
  if (N > 0 && vec4) {
    launch_pdl(cross_entropy_rows_vec4_kernel<GradStorage>, unsigned(N), kCrossEntropyVecThreads, 0,
               stream, reinterpret_cast<const float*>(logits), targets, dlogits, V, float(scale),
               row_loss, row_flags);
    check_last_error("cuda cross_entropy (rows, vec4)");
  } else if (N > 0) {
    launch_pdl(cross_entropy_rows_kernel<Storage, GradStorage>, unsigned(N), kRowThreads, 0, stream,
               logits, targets, dlogits, V, float(scale), row_loss, row_flags);
    check_last_error("cuda cross_entropy (rows)");
  }
  launch_pdl(cross_entropy_reduce_kernel, 1, kCrossEntropyReduceThreads, 0, stream, row_loss,
             row_flags, N, result);
  check_last_error("cuda cross_entropy (reduce)");
}

}  // namespace

size_t cross_entropy_workspace_bytes(int64_t N) {
  return size_t(std::max<int64_t>(N, 0)) * (sizeof(double) + sizeof(int32_t));
}
void cross_entropy_forward_backward(const float* logits, const int64_t* targets, float* dlogits,
                                    int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream) {
  cross_entropy_launch(logits, targets, dlogits, N, V, scale, result_device, workspace, stream);
}
void cross_entropy_forward_backward(const uint16_t* logits, const int64_t* targets,
                                    uint16_t* dlogits, int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream) {
  cross_entropy_launch(logits, targets, dlogits, N, V, scale, result_device, workspace, stream);
}
void cross_entropy_forward_backward(const float* logits, const int64_t* targets, uint16_t* dlogits,
                                    int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream) {
  cross_entropy_launch(logits, targets, dlogits, N, V, scale, result_device, workspace, stream);
}

}  // namespace dm::cuda
