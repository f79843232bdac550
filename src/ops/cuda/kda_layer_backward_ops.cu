// CUDA backwards of the KDA layer's per-token pieces (formulas in kda_layer_backward_ops.h; CPU
// twins in ops/cpu/kda_prep.cpp and ops/cpu/norm_gated.cpp). The short conv's backward is in
// short_conv.cu.
//
// Layouts of the launches:
//   element kernels (β): one thread per element, grid-stride;
//   row-reducing kernels (gate): blocks of 32 channels × 8 row lanes over a grid of
//     channel tiles × R row ranges; consecutive threads on consecutive channels (coalesced), the
//     8 row lanes summed in shared memory in a fixed order, one partial per (range, channel);
//   norm: one warp per row (a head of K ≤ 256), 8 warps per block over one range of 16 rows
//     (norm_row_ranges), each lane keeping the dw partial sums of its D/32 columns;
//   reduce: one block per parameter element, summing its R partials (times a group of columns
//     for dA_log) with the fixed-order block_sum.
// Row ranges: R = clamp(ceil(rows / 64), 1, 256) of ceil(rows / R) rows each, so the partials
// stay small (R · columns floats) while every block still has rows to sum.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/vector_access.cuh"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLanes = 32;                       // channels of a row-reducing block
constexpr int kRowLanes = kThreads / kLanes;     // row lanes (or warps) of a block: 8
constexpr int64_t kRowsPerRange = 64;
constexpr int64_t kMaxRanges = 256;
constexpr int kNormChunks = int(kKdaNormBackwardMaxD / 32);  // columns per lane

int grid_blocks(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(wanted, 65536)));
}

// Number of row ranges R of a two-stage reduction over `rows`, and the rows per range.
int64_t row_ranges(int64_t rows) {
  return std::clamp<int64_t>((rows + kRowsPerRange - 1) / kRowsPerRange, 1, kMaxRanges);
}
int64_t rows_per_range(int64_t rows) {
  const int64_t R = row_ranges(rows);
  return std::max<int64_t>(1, (rows + R - 1) / R);
}

// The gated norm's row ranges: 16 rows (two per warp) each, up to 4096 ranges. Its partials are
// only R·D floats (D = one head), and with 256 ranges of 256 rows the kernel had ~15 warps per SM
// walking 32 dependent rows each: 181 µs at rows = 65536, D = 128 on the H200.
constexpr int64_t kNormRowsPerRange = 16;
constexpr int64_t kNormMaxRanges = 4096;
int64_t norm_row_ranges(int64_t rows) {
  return std::clamp<int64_t>((rows + kNormRowsPerRange - 1) / kNormRowsPerRange, 1,
                             kNormMaxRanges);
}
int64_t norm_rows_per_range(int64_t rows) {
  const int64_t R = norm_row_ranges(rows);
  return std::max<int64_t>(1, (rows + R - 1) / R);
}

__device__ __forceinline__ float softplus_f32(float z) { return z > 20.0f ? z : log1pf(expf(z)); }

// ---- stage 2 of every parameter gradient ------------------------------------------------------
// out[m] += Σ_{r<R} Σ_{i<group} partial[r·row_stride + m·group + i]; one block per m (grid = M).
__global__ void reduce_partials_kernel(const float* __restrict__ partial, int64_t R,
                                       int64_t row_stride, int64_t group,
                                       float* __restrict__ out) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float shared[32];
  const int64_t m = blockIdx.x, count = R * group;
  float acc = 0.0f;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t r = e / group, i = e % group;
    acc += partial[r * row_stride + m * group + i];
  }
  acc = block_sum(acc, shared);  // fixed shuffle order: deterministic
  if (threadIdx.x == 0) out[m] += acc;
}

void reduce_partials(const float* partial, int64_t R, int64_t row_stride, int64_t group,
                     float* out, int64_t M, cudaStream_t stream, const char* what) {
  if (M == 0) return;
  DM_CHECK(M <= 0x7fffffff, what, ": too many parameter elements ", M);
  launch_pdl(reduce_partials_kernel, unsigned(M), kThreads, 0, stream, partial, R, row_stride,
             group, out);
  check_last_error(what);
}

// ---- gated RMSNorm ---------------------------------------------------------------------------
// Where a row's first element of dgate sits: element e of the [n / width, width] matrix at
// (e / width)·ld + e % width (width 0: contiguous). A row of D never crosses a width boundary.
struct RowBlock {
  int64_t width = 0, ld = 0;
  __device__ __forceinline__ int64_t operator()(int64_t e) const {
    return width == 0 ? e : e / width * ld + e % width;
  }
};

// Grid: R row ranges; block: 8 warps, warp w taking rows r0 + w, r0 + w + 8, … of its range.
// partial [R, D]: the range's Σ dy·x·r·σ per column.
__global__ void __launch_bounds__(kThreads)
    rmsnorm_gated_backward_kernel(const uint16_t* __restrict__ x, const float* __restrict__ w,
                                  const uint16_t* __restrict__ gate, const float* __restrict__ dy,
                                  uint16_t* __restrict__ dx, uint16_t* __restrict__ dgate,
                                  float* __restrict__ partial, int64_t rows, int64_t D, float eps,
                                  int64_t range_rows, RowBlock dgate_at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float block_dw[kRowLanes][kKdaNormBackwardMaxD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * range_rows;
  const int64_t r1 = r0 + range_rows < rows ? r0 + range_rows : rows;
  float dw_acc[kNormChunks];
#pragma unroll
  for (int m = 0; m < kNormChunks; ++m) dw_acc[m] = 0.0f;

  // The row loop depends on the warp only, so the warp_sum shuffles below stay full-warp.
  for (int64_t row = r0 + warp; row < r1; row += kRowLanes) {
    const int64_t offset = row * D, offset_g = dgate_at(offset);
    float sum_squares = 0.0f;
    for (int64_t i = lane; i < D; i += 32) {
      const float value = load_as_float(x, offset + i);
      sum_squares += value * value;
    }
    sum_squares = warp_sum(sum_squares);
    const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);  // as the forward
    float dot = 0.0f;  // Σ dn·n with n = x·r, dn = dy·w·σ
#pragma unroll
    for (int m = 0; m < kNormChunks; ++m) {
      const int64_t i = lane + 32 * m;
      if (i < D) {
        const float sig = sigmoid_f32(load_as_float(gate, offset + i));
        const float normed = load_as_float(x, offset + i) * inverse_rms;
        const float upstream = dy[offset + i];
        store_from_float(dgate, offset_g + i, upstream * normed * w[i] * sig * (1.0f - sig));
        dot += upstream * w[i] * sig * normed;
        dw_acc[m] += upstream * normed * sig;
      }
    }
    const float mean_dot = warp_sum(dot) / float(D);
#pragma unroll
    for (int m = 0; m < kNormChunks; ++m) {
      const int64_t i = lane + 32 * m;
      if (i < D) {
        const float sig = sigmoid_f32(load_as_float(gate, offset + i));
        const float normed = load_as_float(x, offset + i) * inverse_rms;
        const float d_normed = dy[offset + i] * w[i] * sig;
        store_from_float(dx, offset + i, inverse_rms * (d_normed - normed * mean_dot));
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kNormChunks; ++m) {
    const int64_t i = lane + 32 * m;
    if (i < D) block_dw[warp][i] = dw_acc[m];
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float sum = 0.0f;
    for (int wp = 0; wp < kRowLanes; ++wp) sum += block_dw[wp][i];  // fixed order
    partial[int64_t(blockIdx.x) * D + i] = sum;
  }
}

// The same with each lane holding M chunks of 4 consecutive columns (column 128·m + 4·lane + e)
// loaded once, as the forward's vec4 kernel (8-byte bf16 and 16-byte fp32 loads, where the kernel
// above moved 2 or 4 bytes a lane and read x, gate and dy twice): D = 128·M, every tensor
// 4-element aligned.
template <int M>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_gated_backward_vec4_kernel(const uint16_t* __restrict__ x, const float* __restrict__ w,
                                       const uint16_t* __restrict__ gate,
                                       const float* __restrict__ dy, uint16_t* __restrict__ dx,
                                       uint16_t* __restrict__ dgate, float* __restrict__ partial,
                                       int64_t rows, float eps, int64_t range_rows,
                                       RowBlock dgate_at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr int D = 128 * M;
  __shared__ float block_dw[kRowLanes][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * range_rows;
  const int64_t r1 = r0 + range_rows < rows ? r0 + range_rows : rows;
  float ws[M][4], dw_acc[M][4];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4 wv = *reinterpret_cast<const float4*>(w + 128 * m + 4 * lane);
    ws[m][0] = wv.x, ws[m][1] = wv.y, ws[m][2] = wv.z, ws[m][3] = wv.w;
#pragma unroll
    for (int e = 0; e < 4; ++e) dw_acc[m][e] = 0.0f;
  }

  // The row loop depends on the warp only, so the warp_sum shuffles below stay full-warp.
  for (int64_t row = r0 + warp; row < r1; row += kRowLanes) {
    const int64_t offset = row * D + 4 * lane, offset_g = dgate_at(row * D) + 4 * lane;
    float xs[M][4], sig[M][4], up[M][4];
    float sum_squares = 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      load_vector_as_float<4>(x, offset + 128 * m, xs[m]);
      load_vector_as_float<4>(gate, offset + 128 * m, sig[m]);
      load_vector_as_float<4>(dy, offset + 128 * m, up[m]);
#pragma unroll
      for (int e = 0; e < 4; ++e) sum_squares += xs[m][e] * xs[m][e];
    }
    sum_squares = warp_sum(sum_squares);
    const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);  // as the forward
    float dot = 0.0f;  // Σ dn·n with n = x·r, dn = dy·w·σ
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float dg[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float s = sig[m][e] = sigmoid_f32(sig[m][e]);
        const float normed = xs[m][e] * inverse_rms;
        dg[e] = up[m][e] * normed * ws[m][e] * s * (1.0f - s);
        dot += up[m][e] * ws[m][e] * s * normed;
        dw_acc[m][e] += up[m][e] * normed * s;
      }
      store_vector_from_float<4>(dgate, offset_g + 128 * m, dg);
    }
    const float mean_dot = warp_sum(dot) / float(D);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float d_x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float normed = xs[m][e] * inverse_rms;
        const float d_normed = up[m][e] * ws[m][e] * sig[m][e];
        d_x[e] = inverse_rms * (d_normed - normed * mean_dot);
      }
      store_vector_from_float<4>(dx, offset + 128 * m, d_x);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) block_dw[warp][128 * m + 4 * lane + e] = dw_acc[m][e];
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float sum = 0.0f;
    for (int wp = 0; wp < kRowLanes; ++wp) sum += block_dw[wp][i];  // fixed order
    partial[int64_t(blockIdx.x) * D + i] = sum;
  }
}

// ---- decay gate ------------------------------------------------------------------------------
// Grid: ceil(HK/(32·kVec)) × R; block 32 × 8; thread (x, y) owns channels c0 … c0 + kVec − 1
// (one head: K % kVec == 0) and rows r0 + y, + 8, … of its range. partial: [R, HK] Σ dz, then
// [R, HK] Σ ∂/∂A_log. Each channel's rows add up in the same order for every kVec, so the
// partials' bits do not depend on it; kVec = 4 moves 8 + 16 + 8 bytes a load or store where the
// scalar kernel moved 2 + 4 + 2 (40 µs a call at N = 4096, HK = 2048, ~16 µs of bytes).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    gate_backward_kernel(const uint16_t* __restrict__ f, const float* __restrict__ A_log,
                         const float* __restrict__ dt_bias, const float* __restrict__ dg,
                         uint16_t* __restrict__ df, float* __restrict__ partial, int64_t N,
                         int64_t HK, int64_t K, bool safe_gate, float lower_bound,
                         int64_t range_rows) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float sum_bias[kRowLanes][kLanes * kVec], sum_a_log[kRowLanes][kLanes * kVec];
  const int64_t c0 = (int64_t(blockIdx.x) * kLanes + threadIdx.x) * kVec;
  const int64_t R = gridDim.y, r0 = int64_t(blockIdx.y) * range_rows;
  const int64_t r1 = r0 + range_rows < N ? r0 + range_rows : N;
  float acc_bias[kVec], acc_a_log[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc_bias[v] = acc_a_log[v] = 0.0f;
  if (c0 < HK) {
    const float a = expf(A_log[c0 / K]);
    float bias[kVec];
    load_vector_as_float<kVec>(dt_bias, c0, bias);
#pragma unroll 4
    for (int64_t n = r0 + threadIdx.y; n < r1; n += kRowLanes) {
      const int64_t i = n * HK + c0;
      float fv[kVec], upstream[kVec], dz[kVec];
      load_vector_as_float<kVec>(f, i, fv);
      load_vector_as_float<kVec>(dg, i, upstream);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float z = fv[v] + bias[v];
        float d_a_log;
        if (safe_gate) {
          // g = lb·σ(a·z): ∂g/∂z = lb·σ(1−σ)·a, ∂g/∂A_log = lb·σ(1−σ)·a·z (∂a/∂A_log = a).
          const float sig = sigmoid_f32(a * z);
          const float slope = lower_bound * sig * (1.0f - sig);
          dz[v] = upstream[v] * slope * a;
          d_a_log = upstream[v] * slope * a * z;
        } else {
          // g = −a·softplus(z): ∂g/∂z = −a·σ(z) (−a above the threshold 20), ∂g/∂A_log = g.
          const float slope = z > 20.0f ? 1.0f : sigmoid_f32(z);
          dz[v] = -upstream[v] * a * slope;
          d_a_log = -upstream[v] * a * softplus_f32(z);
        }
        // Rounded adds: no product contracts into them, so every kVec adds the same bits.
        acc_bias[v] = __fadd_rn(acc_bias[v], dz[v]);
        acc_a_log[v] = __fadd_rn(acc_a_log[v], d_a_log);
      }
      store_vector_from_float<kVec>(df, i, dz);
    }
  }
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    sum_bias[threadIdx.y][threadIdx.x * kVec + v] = acc_bias[v];
    sum_a_log[threadIdx.y][threadIdx.x * kVec + v] = acc_a_log[v];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c0 < HK) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      float b = 0.0f, s = 0.0f;
      for (int y = 0; y < kRowLanes; ++y) {  // fixed order
        b += sum_bias[y][threadIdx.x * kVec + v];
        s += sum_a_log[y][threadIdx.x * kVec + v];
      }
      partial[int64_t(blockIdx.y) * HK + c0 + v] = b;
      partial[(R + int64_t(blockIdx.y)) * HK + c0 + v] = s;
    }
  }
}

// ---- β -----------------------------------------------------------------------------------------
__global__ void beta_sigmoid_backward_kernel(const float* __restrict__ z,
                                             const float* __restrict__ dbeta,
                                             uint16_t* __restrict__ dz, int64_t n, int64_t width,
                                             int64_t ld_dz) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float s = sigmoid_f32(z[i]);
    store_from_float(dz, i / width * ld_dz + i % width, dbeta[i] * s * (1.0f - s));
  }
}

}  // namespace

size_t kda_rmsnorm_gated_backward_partial_floats(int64_t rows, int64_t D) {
  return size_t(norm_row_ranges(rows) * D);
}

void kda_rmsnorm_gated_backward(const uint16_t* x, const float* w, const uint16_t* gate,
                                const float* dy, uint16_t* dx, uint16_t* dgate, float* dw,
                                float* partial, int64_t rows, int64_t D, float eps,
                                CUstream_st* stream, int64_t dgate_width, int64_t dgate_ld) {
  DM_CHECK(rows >= 0 && D > 0 && D <= kKdaNormBackwardMaxD,
           "cuda kda_rmsnorm_gated_backward: bad shape rows=", rows, " D=", D, " (D ≤ ",
           kKdaNormBackwardMaxD, ")");
  DM_CHECK(dgate_ld == 0 || (dgate_width > 0 && dgate_width % D == 0 && dgate_ld >= dgate_width &&
                             rows * D % dgate_width == 0),
           "cuda kda_rmsnorm_gated_backward: bad dgate rows (width=", dgate_width,
           ", ld=", dgate_ld, ", rows=", rows, ", D=", D, ")");
  const RowBlock dgate_at{dgate_ld == 0 ? 0 : dgate_width, dgate_ld};
  if (rows == 0) return;
  const int64_t R = norm_row_ranges(rows);
  const int64_t range_rows = norm_rows_per_range(rows);
  const bool vec4 = (D == 128 || D == 256) && aligned_to(x, 8) && aligned_to(gate, 8) &&
                    aligned_to(dy, 16) && aligned_to(dx, 8) && aligned_to(dgate, 8) &&
                    aligned_to(w, 16) && dgate_ld % 4 == 0;
  if (vec4 && D == 128)
    launch_pdl(rmsnorm_gated_backward_vec4_kernel<1>, unsigned(R), kThreads, 0, stream, x, w, gate,
               dy, dx, dgate, partial, rows, eps, range_rows, dgate_at);
  else if (vec4)
    launch_pdl(rmsnorm_gated_backward_vec4_kernel<2>, unsigned(R), kThreads, 0, stream, x, w, gate,
               dy, dx, dgate, partial, rows, eps, range_rows, dgate_at);
  else
    launch_pdl(rmsnorm_gated_backward_kernel, unsigned(R), kThreads, 0, stream, x, w, gate, dy, dx,
               dgate, partial, rows, D, eps, range_rows, dgate_at);
  check_last_error("cuda kda_rmsnorm_gated_backward");
  reduce_partials(partial, R, D, 1, dw, D, stream, "cuda kda_rmsnorm_gated_backward (dw)");
}

size_t kda_gate_backward_partial_floats(int64_t N, int64_t H, int64_t K) {
  return size_t(2 * row_ranges(N) * H * K);
}

void kda_gate_backward(const uint16_t* f, const float* A_log, const float* dt_bias,
                       const float* dg, uint16_t* df, float* dA_log, float* ddt_bias,
                       float* partial, int64_t N, int64_t H, int64_t K, bool safe_gate,
                       float lower_bound, CUstream_st* stream) {
  DM_CHECK(N >= 0 && H > 0 && K > 0, "cuda kda_gate_backward: bad shape N=", N, " H=", H,
           " K=", K);
  if (N == 0) return;
  const int64_t HK = H * K, R = row_ranges(N);
  const bool vec4 = K % 4 == 0 && aligned_to(f, 8) && aligned_to(dt_bias, 16) &&
                    aligned_to(dg, 16) && aligned_to(df, 8);
  if (vec4)
    launch_pdl(gate_backward_kernel<4>, dim3(unsigned(ceil_div(HK, 4 * kLanes)), unsigned(R)),
               dim3(kLanes, kRowLanes), 0, stream, f, A_log, dt_bias, dg, df, partial, N, HK, K,
               safe_gate, lower_bound, rows_per_range(N));
  else
    launch_pdl(gate_backward_kernel<1>, dim3(unsigned(ceil_div(HK, kLanes)), unsigned(R)),
               dim3(kLanes, kRowLanes), 0, stream, f, A_log, dt_bias, dg, df, partial, N, HK, K,
               safe_gate, lower_bound, rows_per_range(N));
  check_last_error("cuda kda_gate_backward");
  // ddt_bias[c]: the R partials of column c; dA_log[h]: those of the K columns of head h.
  reduce_partials(partial, R, HK, 1, ddt_bias, HK, stream, "cuda kda_gate_backward (dt_bias)");
  reduce_partials(partial + R * HK, R, HK, K, dA_log, H, stream,
                  "cuda kda_gate_backward (A_log)");
}

void kda_beta_sigmoid_backward(const float* z, const float* dbeta, uint16_t* dz, int64_t n,
                               CUstream_st* stream, int64_t width, int64_t ld_dz) {
  DM_CHECK(n >= 0, "cuda kda_beta_sigmoid_backward: bad size ", n);
  if (width == 0) width = ld_dz = n > 0 ? n : 1;
  DM_CHECK(width > 0 && ld_dz >= width && n % width == 0,
           "cuda kda_beta_sigmoid_backward: bad rows (n=", n, ", width=", width, ", ld=", ld_dz,
           ")");
  if (n == 0) return;
  launch_pdl(beta_sigmoid_backward_kernel, grid_blocks(n), kThreads, 0, stream, z, dbeta, dz, n,
             width, ld_dz);
  check_last_error("cuda kda_beta_sigmoid_backward");
}

}  // namespace dm::cuda
