// CUDA KDA decay gate, β sigmoid and gated per-head RMSNorm (formulas in kda_layer_ops.h; CPU
// twins in ops/cpu/kda_prep.cpp and ops/cpu/norm_gated.cpp). The short conv is in short_conv.cu.
// Each kernel is templated on the activation storage, bf16 bits (uint16_t) or fp32 (the fp32 GPU
// mode), so both precisions share one body and one launch; the math is fp32 in both.
//
// All memory-bound: element kernels run one thread per output element over a grid-stride loop,
// with consecutive threads on consecutive channels so every load and store is coalesced; the
// norm runs one warp per row (a row is one head, K ≤ a few hundred elements, too short to give a
// whole block work).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/kda_gate.cuh"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/vector_access.cuh"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kNormRowsPerBlock = kThreads / 32;  // one warp per row

// Blocks of a grid-stride element launch: enough to fill the GPU, never 0.
int grid_blocks(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(wanted, 65536)));
}

// f, g [N, H·K] (Act storage); A_log [H]; dt_bias [H·K]. A thread owns channel c (consecutive
// threads, consecutive channels: coalesced) and rows blockIdx.y, + gridDim.y, …: its head's
// e^{A_log} and its dt_bias are formed once, and no element index is divided. (One thread per
// element, with i % HK, c / K and the exp per element, took 46 µs per call at N = 4096,
// H·K = 2048 on an H200; this layout 23.6 µs. ncu, cold caches, 2026-11-30.)
// kVec > 1: the thread owns channels c … c + kVec − 1 of one head (K % kVec == 0) and loads
// kRowsInFlight rows before it stores any (f may be g itself, element for element, so the
// compiler would not hoist a load over a store): 8-byte bf16 loads, four rows in flight, where
// the scalar kernel had one 2-byte load (~22 µs a call at N = 4096, HK = 2048; ~8 µs of bytes).
template <typename Act, int kVec>
__global__ void kda_gate_kernel(const Act* f, const float* __restrict__ A_log,
                                const float* __restrict__ dt_bias, Act* g, int64_t N, int64_t HK,
                                int64_t K, bool safe_gate, float lower_bound) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr int kRowsInFlight = kVec > 1 ? 4 : 1;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (c >= HK) return;
  const float a = expf(A_log[c / K]);
  float bias[kVec];
  load_vector_as_float<kVec>(dt_bias, c, bias);
  const int64_t step = gridDim.y;
  for (int64_t n0 = blockIdx.y; n0 < N; n0 += kRowsInFlight * step) {
    float z[kRowsInFlight][kVec];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u)
      if (n0 + u * step < N) load_vector_as_float<kVec>(f, (n0 + u * step) * HK + c, z[u]);
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (n0 + u * step >= N) break;
#pragma unroll
      for (int v = 0; v < kVec; ++v)
        z[u][v] = kda_gate_value(a, z[u][v] + bias[v], safe_gate, lower_bound);
      store_vector_from_float<kVec>(g, (n0 + u * step) * HK + c, z[u]);
    }
  }
}

// z fp32 [n] → β [n] (Out storage).
template <typename Out>
__global__ void beta_sigmoid_kernel(const float* __restrict__ z, Out* __restrict__ beta,
                                    int64_t n) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_from_float(beta, i, sigmoid_f32(z[i]));
}

// One warp per row of D: x, gate, y [rows, D] (Act storage); w [D]. Each lane rewrites only the
// elements it read, so y may alias x.
template <typename Act>
__global__ void rmsnorm_gated_kernel(const Act* x, const float* __restrict__ w,
                                     const Act* __restrict__ gate, Act* y, int64_t rows, int64_t D,
                                     float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kNormRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  const int64_t offset = row * D;
  float sum_squares = 0.0f;
  for (int64_t i = lane; i < D; i += 32) {
    const float value = load_as_float(x, offset + i);
    sum_squares += value * value;
  }
  sum_squares = warp_sum(sum_squares);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);
  for (int64_t i = lane; i < D; i += 32) {
    const float value = load_as_float(x, offset + i) * inverse_rms * w[i] *
                        sigmoid_f32(load_as_float(gate, offset + i));
    store_from_float(y, offset + i, value);
  }
}

// The same with each lane holding M chunks of 4 consecutive elements (element 128·m + 4·lane + e)
// loaded once (8 bytes of bf16 or 16 of fp32 per load, where the kernel above moved 2 or 4 a
// lane and read x twice): D = 128·M, every tensor 4-element aligned. The row's Σ x² runs in a
// different order than above (per lane over its chunk, then the shuffle tree).
template <typename Act, int M>
__global__ void rmsnorm_gated_vec4_kernel(const Act* x, const float* __restrict__ w,
                                          const Act* __restrict__ gate, Act* y, int64_t rows,
                                          float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr int D = 128 * M;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kNormRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  const int64_t offset = row * D + 4 * lane;
  float xs[M][4], gs[M][4];
  float sum_squares = 0.0f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    load_vector_as_float<4>(x, offset + 128 * m, xs[m]);
    load_vector_as_float<4>(gate, offset + 128 * m, gs[m]);
#pragma unroll
    for (int e = 0; e < 4; ++e) sum_squares += xs[m][e] * xs[m][e];
  }
  sum_squares = warp_sum(sum_squares);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4 wv = *reinterpret_cast<const float4*>(w + 128 * m + 4 * lane);
    const float ws[4] = {wv.x, wv.y, wv.z, wv.w};
    float out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = xs[m][e] * inverse_rms * ws[e] * sigmoid_f32(gs[m][e]);
    store_vector_from_float<4>(y, offset + 128 * m, out);
  }
}

// Launches shared by the bf16 and fp32 overloads (the same grids for both).
template <typename Act>
void gate_forward_launch(const Act* f, const float* A_log, const float* dt_bias, Act* g, int64_t N,
                         int64_t H, int64_t K, bool safe_gate, float lower_bound,
                         KdaLayerStream stream) {
  DM_CHECK(N >= 0 && H > 0 && K > 0, "cuda kda_gate_forward: bad shape N=", N, " H=", H,
           " K=", K);
  const int64_t HK = H * K;
  if (N == 0) return;
  // Channel blocks × row groups: ~4096 blocks of one channel a thread, ~1024 of four (a few rows
  // per thread at training sizes).
  const bool vec4 = K % 4 == 0 && reinterpret_cast<uintptr_t>(f) % (4 * sizeof(Act)) == 0 &&
                    reinterpret_cast<uintptr_t>(g) % (4 * sizeof(Act)) == 0 &&
                    reinterpret_cast<uintptr_t>(dt_bias) % 16 == 0;
  const int vec = vec4 ? 4 : 1;
  const int64_t channel_blocks = (HK + vec * kThreads - 1) / (vec * kThreads);
  const int64_t row_groups =
      std::clamp<int64_t>(4096 / (vec * channel_blocks), 1, std::min<int64_t>(N, 65535));
  const dim3 grid{unsigned(channel_blocks), unsigned(row_groups)};
  if (vec4)
    launch_pdl(kda_gate_kernel<Act, 4>, grid, kThreads, 0, stream, f, A_log, dt_bias, g, N, HK, K,
               safe_gate, lower_bound);
  else
    launch_pdl(kda_gate_kernel<Act, 1>, grid, kThreads, 0, stream, f, A_log, dt_bias, g, N, HK, K,
               safe_gate, lower_bound);
  check_last_error("cuda kda_gate_forward");
}

template <typename Out>
void beta_sigmoid_launch(const float* z, Out* beta, int64_t n, KdaLayerStream stream) {
  DM_CHECK(n >= 0, "cuda kda_beta_sigmoid_forward: bad size ", n);
  if (n == 0) return;
  launch_pdl(beta_sigmoid_kernel<Out>, grid_blocks(n), kThreads, 0, stream, z, beta, n);
  check_last_error("cuda kda_beta_sigmoid_forward");
}

template <typename Act>
void rmsnorm_gated_launch(const Act* x, const float* w, const Act* gate, Act* y, int64_t rows,
                          int64_t D, float eps, KdaLayerStream stream) {
  DM_CHECK(rows >= 0 && D > 0, "cuda kda_rmsnorm_gated_forward: bad shape rows=", rows, " D=", D);
  if (rows == 0) return;
  const int64_t blocks = (rows + kNormRowsPerBlock - 1) / kNormRowsPerBlock;
  DM_CHECK(blocks <= 0x7fffffff, "cuda kda_rmsnorm_gated_forward: too many rows ", rows);
  const bool vec4 = (D == 128 || D == 256) && aligned_to(x, 4 * sizeof(Act)) &&
                    aligned_to(gate, 4 * sizeof(Act)) && aligned_to(y, 4 * sizeof(Act)) &&
                    aligned_to(w, 16);
  if (vec4 && D == 128)
    launch_pdl(rmsnorm_gated_vec4_kernel<Act, 1>, unsigned(blocks), kThreads, 0, stream, x, w, gate,
               y, rows, eps);
  else if (vec4)
    launch_pdl(rmsnorm_gated_vec4_kernel<Act, 2>, unsigned(blocks), kThreads, 0, stream, x, w, gate,
               y, rows, eps);
  else
    launch_pdl(rmsnorm_gated_kernel<Act>, unsigned(blocks), kThreads, 0, stream, x, w, gate, y,
               rows, D, eps);
  check_last_error("cuda kda_rmsnorm_gated_forward");
}

}  // namespace

void kda_gate_forward(const uint16_t* f, const float* A_log, const float* dt_bias, uint16_t* g,
                      int64_t N, int64_t H, int64_t K, bool safe_gate, float lower_bound,
                      KdaLayerStream stream) {
  gate_forward_launch(f, A_log, dt_bias, g, N, H, K, safe_gate, lower_bound, stream);
}

void kda_gate_forward(const float* f, const float* A_log, const float* dt_bias, float* g, int64_t N,
                      int64_t H, int64_t K, bool safe_gate, float lower_bound,
                      KdaLayerStream stream) {
  gate_forward_launch(f, A_log, dt_bias, g, N, H, K, safe_gate, lower_bound, stream);
}

void kda_beta_sigmoid_forward(const float* z, uint16_t* beta, int64_t n, KdaLayerStream stream) {
  beta_sigmoid_launch(z, beta, n, stream);
}

void kda_beta_sigmoid_forward(const float* z, float* beta, int64_t n, KdaLayerStream stream) {
  beta_sigmoid_launch(z, beta, n, stream);
}

void kda_rmsnorm_gated_forward(const uint16_t* x, const float* w, const uint16_t* gate, uint16_t* y,
                               int64_t rows, int64_t D, float eps, KdaLayerStream stream) {
  rmsnorm_gated_launch(x, w, gate, y, rows, D, eps, stream);
}

void kda_rmsnorm_gated_forward(const float* x, const float* w, const float* gate, float* y,
                               int64_t rows, int64_t D, float eps, KdaLayerStream stream) {
  rmsnorm_gated_launch(x, w, gate, y, rows, D, eps, stream);
}

}  // namespace dm::cuda
