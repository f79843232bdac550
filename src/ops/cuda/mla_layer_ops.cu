// Kernels of the gated MLA layer, forward and backward (shapes and formulas: mla_layer_ops.h).
//
// All memory-bound: one thread per output element (or rotary pair) with consecutive threads on
// consecutive elements, so loads and stores coalesce; the latent RMSNorm is one block per row.
// Math in fp32 (the RoPE table angle in fp64, as the CPU builds it). The four forward kernels
// are templated on the activation storage, bf16 bits (uint16_t) or fp32 (the fp32 GPU mode), so
// both precisions share one body and one launch configuration.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/mla_layer_ops.h"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;     // element kernels
constexpr int kRowThreads = 256;  // row kernels (a multiple of 32)

// Blocks of a grid-stride launch over n items: enough to fill the GPU, never 0.
int grid_for(int64_t n) {
  return int(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)));
}

// Position of token n = b·T + t (RoPE restarts at each document start).
__device__ __forceinline__ int64_t token_position(int64_t n, int64_t T, const int32_t* doc_start) {
  const int64_t t = n % T;
  return doc_start ? t - doc_start[n] : t;
}

// cos, sin [T, half]: one thread per (t, i).
__global__ void rope_table_kernel(MlaRopeFrequencies f, int64_t T, float* cos_out,
                                  float* sin_out) {
  const int64_t total = T * f.half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / f.half;
    const int i = int(idx % f.half);
    // Angle in double from the fp32 frequency, like rope_build_tables.
    const double angle = double(t) * double(f.freq[i]);
    cos_out[idx] = float(::cos(angle) * f.amplitude);
    sin_out[idx] = float(::sin(angle) * f.amplitude);
  }
}

// One block per row: y[row, 0:D] = x[row, 0:D] · r · w (x fp32 with leading dim ldx; y bf16 or
// fp32 per Out, contiguous).
template <typename Out>
__global__ void rmsnorm_rows_kernel(const float* x, int64_t ldx, const float* w, Out* y, int64_t D,
                                    float eps) {
  __shared__ float reduce_scratch[32];
  const float* x_row = x + int64_t(blockIdx.x) * ldx;
  Out* y_row = y + int64_t(blockIdx.x) * D;
  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum_squares += x_row[i] * x_row[i];
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    store_from_float(y_row, i, x_row[i] * inverse_rms * w[i]);
}

// q [N, H, dq] (Act storage) in place: one thread per (token, head, pair). sin_sign = −1 rotates
// by −angle (the backward: the transpose of the forward rotation, amplitude included).
template <typename Act>
__global__ void rope_queries_kernel(Act* q, int64_t N, int64_t T, int64_t H, int64_t dq,
                                    int64_t nope, int64_t half, const float* cos, const float* sin,
                                    const int32_t* doc_start, float sin_sign) {
  const int64_t total = N * H * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, row = idx / half;  // row = n·H + h
    const int64_t n = row / H;
    const int64_t table = token_position(n, T, doc_start) * half + i;
    const float c = cos[table], s = sin_sign * sin[table];
    Act* pair = q + row * dq + nope + 2 * i;
    const float x0 = load_as_float(pair, 0), x1 = load_as_float(pair, 1);
    store_from_float(pair, 0, x0 * c - x1 * s);
    store_from_float(pair, 1, x1 * c + x0 * s);
  }
}

// k [N, H, dq] then v [N, H, dv]: one thread per output element of either (index space
// [0, N·H·dq) for k, the rest for v). The rotated kr is recomputed per head (H small reads of
// the same row; cheaper than a second pass). kv, k, v share the Act storage, so the nope and v
// slices are plain element copies.
template <typename Act>
__global__ void assemble_kv_kernel(const Act* kv, const float* kv_a, int64_t N, int64_t T,
                                   int64_t H, int64_t nope, int64_t rope, int64_t dv, int64_t kvl,
                                   const float* cos, const float* sin, const int32_t* doc_start,
                                   Act* k, Act* v) {
  const int64_t dq = nope + rope, kv_width = nope + dv;
  const int64_t k_total = N * H * dq, total = k_total + N * H * dv;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < k_total) {
      const int64_t j = idx % dq, row = idx / dq;  // row = n·H + h
      if (j < nope) {
        k[idx] = kv[row * kv_width + j];
        continue;
      }
      const int64_t n = row / H, r = j - nope;
      const float* kr = kv_a + n * (kvl + rope) + kvl;  // [rope] shared by every head
      float value;
      if (cos) {
        const int64_t half = rope / 2, p = r / 2;
        const int64_t table = token_position(n, T, doc_start) * half + p;
        const float c = cos[table], s = sin[table];
        const float x0 = kr[2 * p], x1 = kr[2 * p + 1];
        value = (r % 2 == 0) ? x0 * c - x1 * s : x1 * c + x0 * s;
      } else {
        value = kr[r];
      }
      store_from_float(k, idx, value);
    } else {
      const int64_t e = idx - k_total;
      const int64_t j = e % dv, row = e / dv;
      v[e] = kv[row * kv_width + nope + j];
    }
  }
}

template <typename Act>
__global__ void gate_multiply_kernel(Act* o, const Act* g, int64_t n) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x)
    store_from_float(o, idx, load_as_float(o, idx) * sigmoid_f32(load_as_float(g, idx)));
}

// ---- Backward kernels ----------------------------------------------------------------------

__global__ void gate_multiply_into_kernel(const uint16_t* o, const uint16_t* g, uint16_t* out,
                                          int64_t n) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x)
    store_from_float(out, idx, load_as_float(o, idx) * sigmoid_f32(load_as_float(g, idx)));
}

// o_gated = o·σ(g): ∂/∂g = o·σ(1−σ), ∂/∂o = σ (the CPU's d_gate_preactivation and d_out ⊙ σ).
__global__ void gate_backward_kernel(const float* d_out, const uint16_t* o, const uint16_t* g,
                                     uint16_t* dg, uint16_t* d_o, int64_t n) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const float s = sigmoid_f32(load_as_float(g, idx));
    const float up = d_out[idx];
    store_from_float(dg, idx, up * load_as_float(o, idx) * s * (1.0f - s));
    store_from_float(d_o, idx, up * s);
  }
}

// d_kv [N, H, nope + dv] (index space [0, N·H·(nope+dv))) then the rope-key columns of d_kv_a
// (index space N·rope after it): one thread per output element. A rope-key thread sums its
// column over the H heads (and, with RoPE, its pair partner's column, which the transposed
// rotation mixes in); the partner's sum is recomputed rather than shared (H·2 small reads).
__global__ void split_kv_grad_kernel(const uint16_t* dk, const uint16_t* dv, int64_t N, int64_t T,
                                     int64_t H, int64_t nope, int64_t rope, int64_t dv_dim,
                                     int64_t kvl, const float* cos, const float* sin,
                                     const int32_t* doc_start, uint16_t* d_kv, uint16_t* d_kv_a) {
  const int64_t dq = nope + rope, kv_width = nope + dv_dim;
  const int64_t kv_total = N * H * kv_width, total = kv_total + N * rope;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < kv_total) {
      const int64_t j = idx % kv_width, row = idx / kv_width;  // row = n·H + h
      d_kv[idx] = j < nope ? dk[row * dq + j] : dv[row * dv_dim + (j - nope)];
      continue;
    }
    const int64_t e = idx - kv_total;
    const int64_t n = e / rope, r = e % rope;
    const uint16_t* dk_token = dk + n * H * dq + nope;  // head h's rope slice at + h·dq
    float value;
    if (cos) {
      const int64_t half = rope / 2, p = r / 2;
      float sum0 = 0.0f, sum1 = 0.0f;  // Σ_h of the pair (2p, 2p+1), head order like the CPU
      for (int64_t h = 0; h < H; ++h) {
        sum0 += load_as_float(dk_token, h * dq + 2 * p);
        sum1 += load_as_float(dk_token, h * dq + 2 * p + 1);
      }
      const int64_t table = token_position(n, T, doc_start) * half + p;
      const float c = cos[table], s = sin[table];
      // Forward: y0 = x0·c − x1·s, y1 = x1·c + x0·s;  transpose: dx0 = dy0·c + dy1·s,
      // dx1 = dy1·c − dy0·s.
      value = (r % 2 == 0) ? sum0 * c + sum1 * s : sum1 * c - sum0 * s;
    } else {
      float sum = 0.0f;
      for (int64_t h = 0; h < H; ++h) sum += load_as_float(dk_token, h * dq + r);
      value = sum;
    }
    store_from_float(d_kv_a, n * (kvl + rope) + kvl + r, value);
  }
}

// One thread per element of y [N, D].
template <typename Out>
__global__ void copy_rows_kernel(const float* x, int64_t ldx, Out* y, int64_t ldy, int64_t N,
                                 int64_t D) {
  const int64_t total = N * D;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = idx / D, j = idx % D;
    store_from_float(y, n * ldy + j, x[n * ldx + j]);
  }
}

template <typename Out>
void copy_rows_launch(const float* x, int64_t ldx, Out* y, int64_t ldy, int64_t N, int64_t D,
                      CUstream_st* stream) {
  DM_CHECK(N >= 0 && D >= 0 && ldx >= D && ldy >= D, "mla_copy_rows: bad shape N=", N, " D=", D,
           " ldx=", ldx, " ldy=", ldy);
  if (N * D == 0) return;
  copy_rows_kernel<Out><<<grid_for(N * D), kThreads, 0, stream>>>(x, ldx, y, ldy, N, D);
  check_last_error("mla_copy_rows");
}

// Forward launches shared by the bf16 and fp32 overloads (the same grids for both).
template <typename Out>
void rmsnorm_rows_launch(const float* x, int64_t ldx, const float* w, Out* y, int64_t N, int64_t D,
                         double eps, CUstream_st* stream) {
  DM_CHECK(D > 0 && ldx >= D && N >= 0 && N <= int64_t(INT32_MAX),
           "mla_rmsnorm_rows: bad shape N=", N, " D=", D, " ldx=", ldx);
  if (N == 0) return;
  rmsnorm_rows_kernel<Out><<<unsigned(N), kRowThreads, 0, stream>>>(x, ldx, w, y, D, float(eps));
  check_last_error("mla_rmsnorm_rows");
}

template <typename Act>
void rope_queries_launch(Act* q, int64_t B, int64_t T, int64_t H, int64_t nope, int64_t rope,
                         const float* cos, const float* sin, const int32_t* doc_start,
                         CUstream_st* stream) {
  DM_CHECK(rope > 0 && rope % 2 == 0 && cos && sin, "mla_rope_queries: rotary dim ", rope,
           " must be even and positive, with tables");
  const int64_t N = B * T, total = N * H * (rope / 2);
  if (total == 0) return;
  rope_queries_kernel<Act><<<grid_for(total), kThreads, 0, stream>>>(
      q, N, T, H, nope + rope, nope, rope / 2, cos, sin, doc_start, 1.0f);
  check_last_error("mla_rope_queries");
}

template <typename Act>
void assemble_kv_launch(const Act* kv, const float* kv_a, int64_t B, int64_t T, int64_t H,
                        int64_t nope, int64_t rope, int64_t dv, int64_t kvl, const float* cos,
                        const float* sin, const int32_t* doc_start, Act* k, Act* v,
                        CUstream_st* stream) {
  DM_CHECK(nope >= 0 && rope >= 0 && dv > 0 && kvl > 0 && (!cos || (sin && rope % 2 == 0)),
           "mla_assemble_kv: bad dims nope=", nope, " rope=", rope, " dv=", dv, " kvl=", kvl);
  const int64_t N = B * T, total = N * H * (nope + rope + dv);
  if (total == 0) return;
  assemble_kv_kernel<Act><<<grid_for(total), kThreads, 0, stream>>>(
      kv, kv_a, N, T, H, nope, rope, dv, kvl, cos, sin, doc_start, k, v);
  check_last_error("mla_assemble_kv");
}

template <typename Act>
void gate_multiply_launch(Act* o, const Act* g, int64_t n, CUstream_st* stream) {
  if (n <= 0) return;
  gate_multiply_kernel<Act><<<grid_for(n), kThreads, 0, stream>>>(o, g, n);
  check_last_error("mla_gate_multiply");
}

}  // namespace

void mla_rope_tables_device(const MlaRopeFrequencies& f, int64_t T, float* cos, float* sin,
                            CUstream_st* stream) {
  DM_CHECK(f.half > 0 && f.half <= kMlaMaxRopeHalf && T >= 0,
           "mla_rope_tables_device: bad rotary half dim ", f.half, " or T ", T);
  if (T == 0) return;
  rope_table_kernel<<<grid_for(T * f.half), kThreads, 0, stream>>>(f, T, cos, sin);
  check_last_error("mla_rope_tables_device");
}

void mla_rmsnorm_rows(const float* x, int64_t ldx, const float* w, uint16_t* y, int64_t N,
                      int64_t D, double eps, CUstream_st* stream) {
  rmsnorm_rows_launch(x, ldx, w, y, N, D, eps, stream);
}
void mla_rmsnorm_rows(const float* x, int64_t ldx, const float* w, float* y, int64_t N, int64_t D,
                      double eps, CUstream_st* stream) {
  rmsnorm_rows_launch(x, ldx, w, y, N, D, eps, stream);
}

void mla_rope_queries(uint16_t* q, int64_t B, int64_t T, int64_t H, int64_t nope, int64_t rope,
                      const float* cos, const float* sin, const int32_t* doc_start,
                      CUstream_st* stream) {
  rope_queries_launch(q, B, T, H, nope, rope, cos, sin, doc_start, stream);
}
void mla_rope_queries(float* q, int64_t B, int64_t T, int64_t H, int64_t nope, int64_t rope,
                      const float* cos, const float* sin, const int32_t* doc_start,
                      CUstream_st* stream) {
  rope_queries_launch(q, B, T, H, nope, rope, cos, sin, doc_start, stream);
}

void mla_assemble_kv(const uint16_t* kv, const float* kv_a, int64_t B, int64_t T, int64_t H,
                     int64_t nope, int64_t rope, int64_t dv, int64_t kvl, const float* cos,
                     const float* sin, const int32_t* doc_start, uint16_t* k, uint16_t* v,
                     CUstream_st* stream) {
  assemble_kv_launch(kv, kv_a, B, T, H, nope, rope, dv, kvl, cos, sin, doc_start, k, v, stream);
}
void mla_assemble_kv(const float* kv, const float* kv_a, int64_t B, int64_t T, int64_t H,
                     int64_t nope, int64_t rope, int64_t dv, int64_t kvl, const float* cos,
                     const float* sin, const int32_t* doc_start, float* k, float* v,
                     CUstream_st* stream) {
  assemble_kv_launch(kv, kv_a, B, T, H, nope, rope, dv, kvl, cos, sin, doc_start, k, v, stream);
}

void mla_gate_multiply(uint16_t* o, const uint16_t* g, int64_t n, CUstream_st* stream) {
  gate_multiply_launch(o, g, n, stream);
}
void mla_gate_multiply(float* o, const float* g, int64_t n, CUstream_st* stream) {
  gate_multiply_launch(o, g, n, stream);
}

void mla_gate_multiply_into(const uint16_t* o, const uint16_t* g, uint16_t* out, int64_t n,
                            CUstream_st* stream) {
  if (n <= 0) return;
  gate_multiply_into_kernel<<<grid_for(n), kThreads, 0, stream>>>(o, g, out, n);
  check_last_error("mla_gate_multiply_into");
}

void mla_gate_backward(const float* d_out, const uint16_t* o, const uint16_t* g, uint16_t* dg,
                       uint16_t* d_o, int64_t n, CUstream_st* stream) {
  if (n <= 0) return;
  gate_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_out, o, g, dg, d_o, n);
  check_last_error("mla_gate_backward");
}

void mla_rope_queries_backward(uint16_t* dq, int64_t B, int64_t T, int64_t H, int64_t nope,
                               int64_t rope, const float* cos, const float* sin,
                               const int32_t* doc_start, CUstream_st* stream) {
  DM_CHECK(rope > 0 && rope % 2 == 0 && cos && sin, "mla_rope_queries_backward: rotary dim ",
           rope, " must be even and positive, with tables");
  const int64_t N = B * T, total = N * H * (rope / 2);
  if (total == 0) return;
  rope_queries_kernel<uint16_t><<<grid_for(total), kThreads, 0, stream>>>(
      dq, N, T, H, nope + rope, nope, rope / 2, cos, sin, doc_start, -1.0f);
  check_last_error("mla_rope_queries_backward");
}

void mla_split_kv_grad(const uint16_t* dk, const uint16_t* dv, int64_t B, int64_t T, int64_t H,
                       int64_t nope, int64_t rope, int64_t dv_dim, int64_t kvl, const float* cos,
                       const float* sin, const int32_t* doc_start, uint16_t* d_kv,
                       uint16_t* d_kv_a, CUstream_st* stream) {
  DM_CHECK(nope >= 0 && rope >= 0 && dv_dim > 0 && kvl > 0 && H > 0 &&
               (!cos || (sin && rope % 2 == 0)),
           "mla_split_kv_grad: bad dims H=", H, " nope=", nope, " rope=", rope, " dv=", dv_dim,
           " kvl=", kvl);
  const int64_t N = B * T, total = N * H * (nope + dv_dim) + N * rope;
  if (total == 0) return;
  split_kv_grad_kernel<<<grid_for(total), kThreads, 0, stream>>>(
      dk, dv, N, T, H, nope, rope, dv_dim, kvl, cos, sin, doc_start, d_kv, d_kv_a);
  check_last_error("mla_split_kv_grad");
}

void mla_copy_rows(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t N, int64_t D,
                   CUstream_st* stream) {
  copy_rows_launch(x, ldx, y, ldy, N, D, stream);
}
void mla_copy_rows(const float* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t N, int64_t D,
                   CUstream_st* stream) {
  copy_rows_launch(x, ldx, y, ldy, N, D, stream);
}

}  // namespace dm::cuda
