// Kernels of the gated MLA layer, forward and backward (shapes and formulas: mla_layer_ops.h).
//
// All memory-bound: one thread per output element (or rotary pair) with consecutive threads on
// consecutive elements, so loads and stores coalesce; the latent RMSNorm is one block per row.
// Math in fp32 (the RoPE table angle in fp64, as the CPU builds it). The four forward kernels
// are templated on the activation storage, bf16 bits (uint16_t) or fp32 (the fp32 GPU mode), so
// both precisions share one body and one launch configuration.
#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/mla_layer_ops.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/vector_access.cuh"

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
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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

// G consecutive elements from src to dst in one load and one store (G·sizeof(T) bytes aligned).
template <int G, typename T>
__device__ __forceinline__ void copy_group(const T* __restrict__ src, T* __restrict__ dst) {
  using Raw = typename RawVector<G* int(sizeof(T))>::type;
  *reinterpret_cast<Raw*>(dst) = *reinterpret_cast<const Raw*>(src);
}

// k [N, H, dq] then v [N, H, dv] in groups of G consecutive elements (one load and one store
// each; G > 1 needs nope, rope, dv multiples of G and kv, k, v aligned to G elements: the bf16
// launch takes G = 8, 16 bytes, where one element per thread spent more on its 64-bit divisions
// than on its bytes). Group index space [0, N·H·dq/G) for k, the rest for v. The rotated kr is
// recomputed per head (H small reads of the same row; cheaper than a second pass). kv, k, v
// share the Act storage, so the nope and v slices are plain copies.
template <typename Act, int G>
__global__ void assemble_kv_kernel(const Act* __restrict__ kv, const float* __restrict__ kv_a,
                                   int64_t N, int64_t T, int64_t H, int64_t nope, int64_t rope,
                                   int64_t dv, int64_t kvl, const float* __restrict__ cos,
                                   const float* __restrict__ sin,
                                   const int32_t* __restrict__ doc_start, Act* __restrict__ k,
                                   Act* __restrict__ v) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t dq_groups = (nope + rope) / G, nope_groups = nope / G, dv_groups = dv / G;
  const int64_t kv_width = nope + dv;
  const int64_t k_groups = N * H * dq_groups, total = k_groups + N * H * dv_groups;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx >= k_groups) {
      const int64_t e = idx - k_groups, row = e / dv_groups;
      copy_group<G>(kv + row * kv_width + nope + G * (e - row * dv_groups), v + G * e);
      continue;
    }
    const int64_t row = idx / dq_groups, group = idx - row * dq_groups;  // row = n·H + h
    if (group < nope_groups) {
      copy_group<G>(kv + row * kv_width + G * group, k + G * idx);
      continue;
    }
    const int64_t n = row / H, r0 = G * (group - nope_groups);
    const float* kr = kv_a + n * (kvl + rope) + kvl;  // [rope] shared by every head
    const int64_t position = cos ? token_position(n, T, doc_start) : 0;
    float values[G];
#pragma unroll
    for (int q = 0; q < G; ++q) {
      const int64_t r = r0 + q;
      if (cos) {
        const int64_t p = r / 2, table = position * (rope / 2) + p;
        const float c = cos[table], s = sin[table];
        const float x0 = kr[2 * p], x1 = kr[2 * p + 1];
        values[q] = (r % 2 == 0) ? x0 * c - x1 * s : x1 * c + x0 * s;
      } else {
        values[q] = kr[r];
      }
    }
    store_vector_from_float<G>(k, G * idx, values);
  }
}

// The output gate's element kernels take G = 4 consecutive elements a thread (one 8- or 16-byte
// load per tensor) when n is a multiple of 4 and every tensor 16-byte aligned, else G = 1.
// out[i] = o[i]·σ(g[i]); out may be o (the forward gates in place).
template <typename Act, int G>
__global__ void gate_multiply_kernel(const Act* o, const Act* __restrict__ g, Act* out, int64_t n) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t idx = G * (blockIdx.x * int64_t(blockDim.x) + threadIdx.x); idx < n;
       idx += G * int64_t(gridDim.x) * blockDim.x) {
    float ov[G], gv[G];
    load_vector_as_float<G>(o, idx, ov);
    load_vector_as_float<G>(g, idx, gv);
#pragma unroll
    for (int e = 0; e < G; ++e) ov[e] *= sigmoid_f32(gv[e]);
    store_vector_from_float<G>(out, idx, ov);
  }
}

// ---- Backward kernels ----------------------------------------------------------------------

// o_gated = o·σ(g): ∂/∂g = o·σ(1−σ), ∂/∂o = σ (the CPU's d_gate_preactivation and d_out ⊙ σ).
template <int G>
__global__ void gate_backward_kernel(const float* __restrict__ d_out,
                                     const uint16_t* __restrict__ o, const uint16_t* __restrict__ g,
                                     uint16_t* __restrict__ dg, uint16_t* __restrict__ d_o,
                                     int64_t n) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t idx = G * (blockIdx.x * int64_t(blockDim.x) + threadIdx.x); idx < n;
       idx += G * int64_t(gridDim.x) * blockDim.x) {
    float up[G], ov[G], gv[G], dgv[G], dov[G];
    load_vector_as_float<G>(d_out, idx, up);
    load_vector_as_float<G>(o, idx, ov);
    load_vector_as_float<G>(g, idx, gv);
#pragma unroll
    for (int e = 0; e < G; ++e) {
      const float s = sigmoid_f32(gv[e]);
      dgv[e] = up[e] * ov[e] * s * (1.0f - s);
      dov[e] = up[e] * s;
    }
    store_vector_from_float<G>(dg, idx, dgv);
    store_vector_from_float<G>(d_o, idx, dov);
  }
}

// d_kv_a's rope-key column r of token n: Σ_h dk[n, h, nope + r] (and, with RoPE, its pair
// partner's column, which the transposed rotation mixes in), stored as bf16. The partner's sum is
// recomputed rather than shared (H·2 small reads).
__device__ __forceinline__ void rope_key_grad(const uint16_t* dk, int64_t n, int64_t r, int64_t T,
                                              int64_t H, int64_t nope, int64_t rope, int64_t kvl,
                                              const float* cos, const float* sin,
                                              const int32_t* doc_start, uint16_t* d_kv_a) {
  const int64_t dq = nope + rope;
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

// d_kv [N, H, nope + dv] in groups of G consecutive elements (index space [0, N·H·(nope+dv)/G);
// G > 1 needs nope, dv multiples of G and dk, dv, d_kv aligned to G elements), then the rope-key
// columns of d_kv_a (index space N·rope after it, rope_key_grad) one element per thread.
template <int G>
__global__ void split_kv_grad_kernel(const uint16_t* __restrict__ dk,
                                     const uint16_t* __restrict__ dv, int64_t N, int64_t T,
                                     int64_t H, int64_t nope, int64_t rope, int64_t dv_dim,
                                     int64_t kvl, const float* __restrict__ cos,
                                     const float* __restrict__ sin,
                                     const int32_t* __restrict__ doc_start,
                                     uint16_t* __restrict__ d_kv, uint16_t* __restrict__ d_kv_a) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t dq = nope + rope, nope_groups = nope / G, width_groups = (nope + dv_dim) / G;
  const int64_t kv_groups = N * H * width_groups, total = kv_groups + N * rope;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < kv_groups) {
      const int64_t row = idx / width_groups, group = idx - row * width_groups;  // row = n·H + h
      const uint16_t* src = group < nope_groups ? dk + row * dq + G * group
                                                : dv + row * dv_dim + G * (group - nope_groups);
      copy_group<G>(src, d_kv + G * idx);
      continue;
    }
    const int64_t e = idx - kv_groups;
    rope_key_grad(dk, e / rope, e % rope, T, H, nope, rope, kvl, cos, sin, doc_start, d_kv_a);
  }
}

// One thread per element of y [N, D].
template <typename Out>
__global__ void copy_rows_kernel(const float* x, int64_t ldx, Out* y, int64_t ldy, int64_t N,
                                 int64_t D) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
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
  launch_pdl(copy_rows_kernel<Out>, grid_for(N * D), kThreads, 0, stream, x, ldx, y, ldy, N, D);
  check_last_error("mla_copy_rows");
}

// Forward launches shared by the bf16 and fp32 overloads (the same grids for both).
template <typename Out>
void rmsnorm_rows_launch(const float* x, int64_t ldx, const float* w, Out* y, int64_t N, int64_t D,
                         double eps, CUstream_st* stream) {
  DM_CHECK(D > 0 && ldx >= D && N >= 0 && N <= int64_t(INT32_MAX),
           "mla_rmsnorm_rows: bad shape N=", N, " D=", D, " ldx=", ldx);
  if (N == 0) return;
  launch_pdl(rmsnorm_rows_kernel<Out>, unsigned(N), kRowThreads, 0, stream, x, ldx, w, y, D,
             float(eps));
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
  launch_pdl(rope_queries_kernel<Act>, grid_for(total), kThreads, 0, stream, q, N, T, H,
             nope + rope, nope, rope / 2, cos, sin, doc_start, 1.0f);
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
  constexpr int G = 16 / int(sizeof(Act));  // 16-byte groups: 8 bf16 or 4 fp32
  if (nope % G == 0 && rope % G == 0 && dv % G == 0 && aligned_to(kv, 16) && aligned_to(k, 16) &&
      aligned_to(v, 16))
    launch_pdl(assemble_kv_kernel<Act, G>, grid_for(total / G), kThreads, 0, stream, kv, kv_a, N, T,
               H, nope, rope, dv, kvl, cos, sin, doc_start, k, v);
  else
    launch_pdl(assemble_kv_kernel<Act, 1>, grid_for(total), kThreads, 0, stream, kv, kv_a, N, T, H,
               nope, rope, dv, kvl, cos, sin, doc_start, k, v);
  check_last_error("mla_assemble_kv");
}

template <typename Act>
void gate_multiply_launch(Act* o, const Act* g, int64_t n, CUstream_st* stream) {
  if (n <= 0) return;
  if (vectors_fit(n, 4, {{o, sizeof(Act)}, {g, sizeof(Act)}}))
    launch_pdl(gate_multiply_kernel<Act, 4>, grid_for(n / 4), kThreads, 0, stream, o, g, o, n);
  else
    launch_pdl(gate_multiply_kernel<Act, 1>, grid_for(n), kThreads, 0, stream, o, g, o, n);
  check_last_error("mla_gate_multiply");
}

}  // namespace

void mla_rope_tables_device(const MlaRopeFrequencies& f, int64_t T, float* cos, float* sin,
                            CUstream_st* stream) {
  DM_CHECK(f.half > 0 && f.half <= kMlaMaxRopeHalf && T >= 0,
           "mla_rope_tables_device: bad rotary half dim ", f.half, " or T ", T);
  if (T == 0) return;
  launch_pdl(rope_table_kernel, grid_for(T * f.half), kThreads, 0, stream, f, T, cos, sin);
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
  if (vectors_fit(n, 4, {{o, 2}, {g, 2}, {out, 2}}))
    launch_pdl(gate_multiply_kernel<uint16_t, 4>, grid_for(n / 4), kThreads, 0, stream, o, g, out,
               n);
  else
    launch_pdl(gate_multiply_kernel<uint16_t, 1>, grid_for(n), kThreads, 0, stream, o, g, out, n);
  check_last_error("mla_gate_multiply_into");
}

void mla_gate_backward(const float* d_out, const uint16_t* o, const uint16_t* g, uint16_t* dg,
                       uint16_t* d_o, int64_t n, CUstream_st* stream) {
  if (n <= 0) return;
  if (vectors_fit(n, 4, {{d_out, 4}, {o, 2}, {g, 2}, {dg, 2}, {d_o, 2}}))
    launch_pdl(gate_backward_kernel<4>, grid_for(n / 4), kThreads, 0, stream, d_out, o, g, dg, d_o,
               n);
  else
    launch_pdl(gate_backward_kernel<1>, grid_for(n), kThreads, 0, stream, d_out, o, g, dg, d_o, n);
  check_last_error("mla_gate_backward");
}

void mla_rope_queries_backward(uint16_t* dq, int64_t B, int64_t T, int64_t H, int64_t nope,
                               int64_t rope, const float* cos, const float* sin,
                               const int32_t* doc_start, CUstream_st* stream) {
  DM_CHECK(rope > 0 && rope % 2 == 0 && cos && sin, "mla_rope_queries_backward: rotary dim ",
           rope, " must be even and positive, with tables");
  const int64_t N = B * T, total = N * H * (rope / 2);
  if (total == 0) return;
  launch_pdl(rope_queries_kernel<uint16_t>, grid_for(total), kThreads, 0, stream, dq, N, T, H,
             nope + rope, nope, rope / 2, cos, sin, doc_start, -1.0f);
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
  if (nope % 8 == 0 && dv_dim % 8 == 0 && (nope + rope) % 8 == 0 && aligned_to(dk, 16) &&
      aligned_to(dv, 16) && aligned_to(d_kv, 16))
    launch_pdl(split_kv_grad_kernel<8>, grid_for(N * H * (nope + dv_dim) / 8 + N * rope), kThreads,
               0, stream, dk, dv, N, T, H, nope, rope, dv_dim, kvl, cos, sin, doc_start, d_kv,
               d_kv_a);
  else
    launch_pdl(split_kv_grad_kernel<1>, grid_for(total), kThreads, 0, stream, dk, dv, N, T, H, nope,
               rope, dv_dim, kvl, cos, sin, doc_start, d_kv, d_kv_a);
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
