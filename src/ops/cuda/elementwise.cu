// CUDA RMSNorm, GLU and AdamW (see elementwise.h for the formulas; the softmax cross-entropy
// is in cross_entropy.cu).
//
// All of these are memory-bound (a few FLOP per byte): the kernels aim at coalesced accesses
// and enough blocks in flight, nothing more. Row kernels use one block per row; reductions are
// fixed-order tree sums in fp32 so results are
// deterministic run to run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kRowThreads = 256;  // threads per row block (a multiple of 32, ≤ 1024)
constexpr int kElementThreads = 256;

// Blocks of a grid-stride element-wise launch: enough to fill the GPU, never 0.
int element_blocks(int64_t n) {
  const int64_t wanted = (n + kElementThreads - 1) / kElementThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(wanted, 65536)));
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// One block per row. x, y [N, D]; w [D].
template <typename Storage>
__global__ void rmsnorm_forward_kernel(const Storage* x, const Storage* w, Storage* y, int64_t D,
                                       float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float reduce_scratch[32];
  const int64_t row_offset = int64_t(blockIdx.x) * D;
  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float value = load_as_float(x, row_offset + i);
    sum_squares += value * value;
  }
  sum_squares = block_sum(sum_squares, reduce_scratch);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);
  // Each thread rewrites only the elements it read: y may alias x.
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    store_from_float(y, row_offset + i,
                     load_as_float(x, row_offset + i) * inverse_rms * load_as_float(w, i));
}

// What both rows kernels below do with a row's partial sums Σ x², Σ dy·w·x: the block's sums,
// r_n = 1/rms stored to inverse_rms_out[row], and the projection (Σ dy·w·x / D)·r_n³ of
// dx = r_n·w·dy − x·projection.
struct RmsBackwardRow {
  float inverse_rms, projection;
};
__device__ __forceinline__ RmsBackwardRow rmsnorm_backward_row(float sum_squares,
                                                               float weighted_dot, int64_t D,
                                                               float eps, float* inverse_rms_out,
                                                               float* reduce_scratch) {
  sum_squares = block_sum(sum_squares, reduce_scratch);
  weighted_dot = block_sum(weighted_dot, reduce_scratch);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / float(D) + eps);
  if (threadIdx.x == 0) inverse_rms_out[blockIdx.x] = inverse_rms;
  return {inverse_rms, weighted_dot / float(D) * inverse_rms * inverse_rms * inverse_rms};
}

// One block per row: dx (accumulated, or stored when !kAccumulate) and r_n into
// inverse_rms_out [N].
template <typename Storage, bool kAccumulate>
__global__ void rmsnorm_backward_rows_kernel(const Storage* x, const Storage* w, const Storage* dy,
                                             Storage* dx, float* inverse_rms_out, int64_t D,
                                             float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float reduce_scratch[32];
  const int64_t row_offset = int64_t(blockIdx.x) * D;
  float sum_squares = 0.0f, weighted_dot = 0.0f;  // Σ x², Σ dy·w·x
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float value = load_as_float(x, row_offset + i);
    sum_squares += value * value;
    weighted_dot += load_as_float(dy, row_offset + i) * load_as_float(w, i) * value;
  }
  const RmsBackwardRow row =
      rmsnorm_backward_row(sum_squares, weighted_dot, D, eps, inverse_rms_out, reduce_scratch);
  if (dx == nullptr) return;
  const float inverse_rms = row.inverse_rms, projection = row.projection;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float gradient = inverse_rms * load_as_float(w, i) * load_as_float(dy, row_offset + i) -
                           load_as_float(x, row_offset + i) * projection;
    store_from_float(dx, row_offset + i,
                     kAccumulate ? load_as_float(dx, row_offset + i) + gradient : gradient);
  }
}

// The fp32 rows kernel with 16-byte loads (D % 4 == 0, x, dy, w and dx 16-byte aligned): the
// training step's norms over the AttnRes mixes (D = hidden, fp32) ran the scalar kernel at ~30 µs
// a call for 4096 × 2048, 56 calls a gpu_1b step, one 4-byte load per lane and array per element.
// Same formulas; each thread sums four adjacent elements before striding, so the sums' order (not
// their precision) differs from the scalar kernel's.
template <bool kAccumulate>
__global__ void rmsnorm_backward_rows_vec4_kernel(const float* x, const float* w, const float* dy,
                                                  float* dx, float* inverse_rms_out, int64_t D,
                                                  float eps) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float reduce_scratch[32];
  const int64_t row_offset = int64_t(blockIdx.x) * D, quads = D / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x + row_offset);
  const float4* dy4 = reinterpret_cast<const float4*>(dy + row_offset);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float sum_squares = 0.0f, weighted_dot = 0.0f;  // Σ x², Σ dy·w·x
  for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
    const float4 a = x4[i], g = dy4[i], v = w4[i];
    sum_squares += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    weighted_dot += g.x * v.x * a.x + g.y * v.y * a.y + g.z * v.z * a.z + g.w * v.w * a.w;
  }
  const RmsBackwardRow row =
      rmsnorm_backward_row(sum_squares, weighted_dot, D, eps, inverse_rms_out, reduce_scratch);
  if (dx == nullptr) return;
  const float inverse_rms = row.inverse_rms, projection = row.projection;
  float4* dx4 = reinterpret_cast<float4*>(dx + row_offset);
  for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
    const float4 a = x4[i], g = dy4[i], v = w4[i];
    float4 out = make_float4(
        inverse_rms * v.x * g.x - a.x * projection, inverse_rms * v.y * g.y - a.y * projection,
        inverse_rms * v.z * g.z - a.z * projection, inverse_rms * v.w * g.w - a.w * projection);
    if constexpr (kAccumulate) {
      const float4 old = dx4[i];
      out = make_float4(old.x + out.x, old.y + out.y, old.z + out.z, old.w + out.w);
    }
    dx4[i] = out;
  }
}

// dw partial sums: block (32 columns, 8 row lanes) over the rows of split blockIdx.y.
// partial [num_splits, D]. The 8 row lanes are combined in a fixed order.
constexpr int kDwColumns = 32, kDwRowLanes = 8;
template <typename Storage>
__global__ void rmsnorm_backward_dw_partial_kernel(const Storage* x, const Storage* dy,
                                                   const float* inverse_rms, float* partial,
                                                   int64_t N, int64_t D, int64_t rows_per_split) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float lane_sums[kDwRowLanes][kDwColumns];
  const int64_t column = int64_t(blockIdx.x) * kDwColumns + threadIdx.x;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_split;
  const int64_t row_end = row_begin + rows_per_split < N ? row_begin + rows_per_split : N;
  float sum = 0.0f;
  if (column < D)
    for (int64_t n = row_begin + threadIdx.y; n < row_end; n += kDwRowLanes)
      sum += load_as_float(dy, n * D + column) * load_as_float(x, n * D + column) *
             inverse_rms[n];
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && column < D) {
    float total = 0.0f;
    for (int lane = 0; lane < kDwRowLanes; ++lane) total += lane_sums[lane][threadIdx.x];
    partial[int64_t(blockIdx.y) * D + column] = total;
  }
}

// dw[i] += Σ_split partial[split, i], in split order.
__global__ void rmsnorm_backward_dw_reduce_kernel(const float* partial, float* dw, int64_t D,
                                                  int num_splits) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= D) return;
  float total = 0.0f;
  for (int split = 0; split < num_splits; ++split) total += partial[int64_t(split) * D + column];
  dw[column] += total;
}

// Row splits of the dw pass: enough blocks to fill the GPU for small D, bounded scratch.
int rmsnorm_dw_splits(int64_t N) {
  return int(std::max<int64_t>(1, std::min<int64_t>(128, (N + 63) / 64)));
}

void rmsnorm_check(int64_t N, int64_t D, const char* who) {
  DM_CHECK(N >= 0 && D > 0, who, ": bad shape N=", N, " D=", D);
  DM_CHECK(N < (int64_t(1) << 31), who, ": N=", N, " rows exceed one grid dimension");
}

template <typename Storage>
void rmsnorm_forward_launch(const Storage* x, const Storage* w, Storage* y, int64_t N, int64_t D,
                            double eps, Stream stream) {
  rmsnorm_check(N, D, "cuda rmsnorm_forward");
  if (N == 0) return;
  launch_pdl(rmsnorm_forward_kernel<Storage>, unsigned(N), kRowThreads, 0, stream, x, w, y, D,
             float(eps));
  check_last_error("cuda rmsnorm_forward");
}

template <typename Storage>
void rmsnorm_backward_launch(const Storage* x, const Storage* w, const Storage* dy, Storage* dx,
                             float* dw, int64_t N, int64_t D, double eps, void* workspace,
                             Stream stream, bool accumulate_dx) {
  rmsnorm_check(N, D, "cuda rmsnorm_backward");
  if (N == 0) return;
  DM_CHECK(workspace != nullptr, "cuda rmsnorm_backward: workspace is null (size it with "
                                 "rmsnorm_backward_workspace_bytes)");
  float* inverse_rms = static_cast<float*>(workspace);          // [N]
  float* partial = inverse_rms + ((N + 63) / 64) * 64;          // [splits, D]
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if constexpr (std::is_same_v<Storage, float>) {
    if (D % 4 == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx))
      launch_pdl(accumulate_dx ? rmsnorm_backward_rows_vec4_kernel<true>
                               : rmsnorm_backward_rows_vec4_kernel<false>,
                 unsigned(N), kRowThreads, 0, stream, x, w, dy, dx, inverse_rms, D, float(eps));
    else
      launch_pdl(accumulate_dx ? rmsnorm_backward_rows_kernel<float, true>
                               : rmsnorm_backward_rows_kernel<float, false>,
                 unsigned(N), kRowThreads, 0, stream, x, w, dy, dx, inverse_rms, D, float(eps));
  } else {
    launch_pdl(accumulate_dx ? rmsnorm_backward_rows_kernel<Storage, true>
                             : rmsnorm_backward_rows_kernel<Storage, false>,
               unsigned(N), kRowThreads, 0, stream, x, w, dy, dx, inverse_rms, D, float(eps));
  }
  check_last_error("cuda rmsnorm_backward (rows)");
  if (dw == nullptr) return;
  const int splits = rmsnorm_dw_splits(N);
  const int64_t rows_per_split = (N + splits - 1) / splits;
  const dim3 grid(unsigned(ceil_div(D, kDwColumns)), unsigned(splits));
  launch_pdl(rmsnorm_backward_dw_partial_kernel<Storage>, grid, dim3(kDwColumns, kDwRowLanes), 0,
             stream, x, dy, inverse_rms, partial, N, D, rows_per_split);
  launch_pdl(rmsnorm_backward_dw_reduce_kernel, unsigned(ceil_div(D, 256)), 256, 0, stream, partial,
             dw, D, splits);
  check_last_error("cuda rmsnorm_backward (dw)");
}

// ---------------------------------------------------------------------------------------------
// GLU

void glu_check(const GluKernelParams& p, const char* who) {
  if (p.situ)
    DM_CHECK(p.beta1 > 0.0f && p.beta2 > 0.0f, who,
             ": SiTU-GLU needs beta1 > 0 and beta2 > 0, got ", p.beta1, ", ", p.beta2);
}

// Where element (or 8-element group) i of g, u, dg, du sits (operator()) and of the forward's h
// (h()): GluRows in the launch's units.
struct GluIndex {
  // width 0: contiguous; h_ld 0: h contiguous; d_ld 0: dg, du where g, u are
  int64_t width = 0, ld = 0, h_ld = 0, d_ld = 0;
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    return width == 0 ? i : i / width * ld + i % width;
  }
  __device__ __forceinline__ int64_t h(int64_t i) const {
    return h_ld == 0 ? i : i / width * h_ld + i % width;
  }
  __device__ __forceinline__ int64_t d(int64_t i) const {
    return d_ld == 0 ? (*this)(i) : i / width * d_ld + i % width;
  }
};

template <typename Storage>
__global__ void glu_forward_kernel(const Storage* g, const Storage* u, Storage* h, int64_t n,
                                   GluKernelParams p, GluIndex at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr bool kBf16 = std::is_same_v<Storage, uint16_t>;  // glu.cuh's fast arithmetic
  const GluInverseBetas inv = glu_inverse_betas(p);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = at(i);
    store_from_float(h, at.h(i),
                     glu_value<kBf16>(load_as_float(g, j), load_as_float(u, j), p, inv));
  }
}

template <typename Storage>
__global__ void glu_backward_kernel(const Storage* g, const Storage* u, const Storage* dh,
                                    Storage* dg, Storage* du, int64_t n, GluKernelParams p,
                                    GluIndex at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr bool kBf16 = std::is_same_v<Storage, uint16_t>;  // glu.cuh's fast arithmetic
  const GluInverseBetas inv = glu_inverse_betas(p);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    // Every input of element i is read before dg[i] / du[i] are written: aliasing is safe.
    const int64_t j = at(i), o = at.d(i);
    float d_gate, d_up;
    glu_grads<kBf16>(load_as_float(g, j), load_as_float(u, j), load_as_float(dh, i), p, inv, d_gate,
                     d_up);
    store_from_float(dg, o, d_gate);
    store_from_float(du, o, d_up);
  }
}

// bf16 with n % 8 == 0 and 16-byte aligned pointers: 8 elements per thread per step, one 16-byte
// load per operand. The scalar kernels above issued a 2-byte load per operand and element and
// ran at ~1.2 TB/s (114 µs forward, 147 µs backward for 4096 × 5632 on the H200).
__global__ void glu_forward_bf16x8_kernel(const uint4* g, const uint4* u, uint4* h, int64_t n8,
                                          GluKernelParams p, GluIndex at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const GluInverseBetas inv = glu_inverse_betas(p);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = at(i);
    h[at.h(i)] = glu_forward_bf16x8(g[j], u[j], p, inv);
  }
}

__global__ void glu_backward_bf16x8_kernel(const uint4* g, const uint4* u, const uint4* dh,
                                           uint4* dg, uint4* du, int64_t n8, GluKernelParams p,
                                           GluIndex at) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const GluInverseBetas inv = glu_inverse_betas(p);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    // every input of element group i is read before dg[j] / du[j] are written: aliasing is safe
    const int64_t j = at(i), o = at.d(i);
    uint4 d_gate, d_up;
    glu_backward_bf16x8(g[j], u[j], dh[i], p, inv, d_gate, d_up);
    dg[o] = d_gate;
    du[o] = d_up;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void glu_rows_check(int64_t n, GluRows rows, const char* who) {
  DM_CHECK(rows.width == 0 || (rows.width > 0 && rows.ld >= rows.width && n % rows.width == 0), who,
           ": bad rows (n=", n, ", width=", rows.width, ", ld=", rows.ld, ")");
  DM_CHECK(rows.h_ld == 0 || (rows.width > 0 && rows.h_ld >= rows.width), who,
           ": bad h rows (width=", rows.width, ", h_ld=", rows.h_ld, ")");
  DM_CHECK(rows.d_ld == 0 || (rows.width > 0 && rows.d_ld >= rows.width), who,
           ": bad dg/du rows (width=", rows.width, ", d_ld=", rows.d_ld, ")");
}

// The 8-element groups fit the rows when every row starts on a group: width and the row strides
// multiples of 8.
bool glu_rows_vectorise(GluRows rows) {
  return rows.width % 8 == 0 && rows.ld % 8 == 0 && rows.h_ld % 8 == 0 && rows.d_ld % 8 == 0;
}

template <typename Storage>
void glu_forward_launch(const Storage* g, const Storage* u, Storage* h, int64_t n,
                        const GluKernelParams& p, Stream stream, GluRows rows = {}) {
  glu_check(p, "cuda glu_forward");
  DM_CHECK(n >= 0, "cuda glu_forward: bad size ", n);
  glu_rows_check(n, rows, "cuda glu_forward");
  if (n == 0) return;
  if constexpr (std::is_same_v<Storage, uint16_t>) {
    if (n % 8 == 0 && aligned16(g) && aligned16(u) && aligned16(h) && glu_rows_vectorise(rows)) {
      launch_pdl(glu_forward_bf16x8_kernel, element_blocks(n / 8), kElementThreads, 0, stream,
                 reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u),
                 reinterpret_cast<uint4*>(h), n / 8, p,
                 GluIndex{rows.width / 8, rows.ld / 8, rows.h_ld / 8});
      check_last_error("cuda glu_forward");
      return;
    }
  }
  launch_pdl(glu_forward_kernel<Storage>, element_blocks(n), kElementThreads, 0, stream, g, u, h, n,
             p, GluIndex{rows.width, rows.ld, rows.h_ld});
  check_last_error("cuda glu_forward");
}

template <typename Storage>
void glu_backward_launch(const Storage* g, const Storage* u, const Storage* dh, Storage* dg,
                         Storage* du, int64_t n, const GluKernelParams& p, Stream stream,
                         GluRows rows = {}) {
  glu_check(p, "cuda glu_backward");
  DM_CHECK(n >= 0, "cuda glu_backward: bad size ", n);
  glu_rows_check(n, rows, "cuda glu_backward");
  DM_CHECK(rows.h_ld == 0, "cuda glu_backward: dh is contiguous (h_ld ", rows.h_ld, " given)");
  DM_CHECK(rows.d_ld == 0 || (dg != g && du != u), "cuda glu_backward: dg, du at their own row ",
           "stride cannot overwrite g, u");
  if (n == 0) return;
  if constexpr (std::is_same_v<Storage, uint16_t>) {
    if (n % 8 == 0 && aligned16(g) && aligned16(u) && aligned16(dh) && aligned16(dg) &&
        aligned16(du) && glu_rows_vectorise(rows)) {
      launch_pdl(glu_backward_bf16x8_kernel, element_blocks(n / 8), kElementThreads, 0, stream,
                 reinterpret_cast<const uint4*>(g), reinterpret_cast<const uint4*>(u),
                 reinterpret_cast<const uint4*>(dh), reinterpret_cast<uint4*>(dg),
                 reinterpret_cast<uint4*>(du), n / 8, p,
                 GluIndex{rows.width / 8, rows.ld / 8, 0, rows.d_ld / 8});
      check_last_error("cuda glu_backward");
      return;
    }
  }
  launch_pdl(glu_backward_kernel<Storage>, element_blocks(n), kElementThreads, 0, stream, g, u, dh,
             dg, du, n, p, GluIndex{rows.width, rows.ld, 0, rows.d_ld});
  check_last_error("cuda glu_backward");
}

// ---------------------------------------------------------------------------------------------
// AdamW

struct AdamWScalars {
  float lr, beta1, beta2, eps, weight_decay_lr, bias_correction1, bias_correction2;
};

AdamWScalars adamw_scalars(const AdamWStep& st) {
  DM_CHECK(st.step >= 1, "cuda adamw_update: step must be ≥ 1 (bias correction), got ", st.step);
  AdamWScalars s;
  s.lr = st.lr;
  s.beta1 = st.beta1;
  s.beta2 = st.beta2;
  s.eps = st.eps;
  s.weight_decay_lr = st.decay ? st.lr * st.weight_decay : 0.0f;
  // Same expressions as Optimizer::adamw_update (powers in double, then rounded to float).
  s.bias_correction1 = 1.0f - float(std::pow(double(st.beta1), double(st.step)));
  s.bias_correction2 = 1.0f - float(std::pow(double(st.beta2), double(st.step)));
  return s;
}

// The update of one element (adamw_update and adamw_update_ranges share it, so both give the
// same bits).
__device__ __forceinline__ float adamw_element(float weight, float gradient, float& m, float& v,
                                               const AdamWScalars& s, float weight_decay_lr) {
  m = s.beta1 * m + (1.0f - s.beta1) * gradient;
  v = s.beta2 * v + (1.0f - s.beta2) * gradient * gradient;
  const float m_hat = m / s.bias_correction1, v_hat = v / s.bias_correction2;
  return weight - (s.lr * m_hat / (sqrtf(v_hat) + s.eps) + weight_decay_lr * weight);
}

template <typename GradStorage>
__global__ void adamw_kernel(float* p, const GradStorage* g, float* m, float* v,
                             uint16_t* p_bf16, int64_t n, AdamWScalars s) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float m_i = m[i], v_i = v[i];
    const float updated = adamw_element(p[i], load_as_float(g, i), m_i, v_i, s, s.weight_decay_lr);
    m[i] = m_i;
    v[i] = v_i;
    p[i] = updated;
    if (p_bf16) store_from_float(p_bf16, i, updated);
  }
}

template <typename GradStorage>
void adamw_launch(float* p, const GradStorage* g, float* m, float* v, uint16_t* p_bf16, int64_t n,
                  const AdamWStep& st, Stream stream) {
  DM_CHECK(n >= 0, "cuda adamw_update: bad size ", n);
  const AdamWScalars s = adamw_scalars(st);
  if (n == 0) return;
  adamw_kernel<<<element_blocks(n), kElementThreads, 0, stream>>>(p, g, m, v, p_bf16, n, s);
  check_last_error("cuda adamw_update");
}

__device__ __forceinline__ uint32_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// One tile of adamw_update_ranges: elements [begin, begin + length) of one range, inside one
// mirror (element i's fp32 copy at p_f32[i + mirror_shift]) or outside all of them.
struct AdamWTile {
  int64_t begin;
  int64_t mirror_shift;  // packed − begin of the mirror; kNoMirror: none
  int32_t length;
  int32_t decay;
};
constexpr int64_t kNoMirror = INT64_MIN;
constexpr int kAdamWTileElements = 16384;  // 256 threads × 4 × 16

// One block per tile; the 4-aligned middle of the tile with float4 loads (uint2 bf16 stores),
// the unaligned ends element by element.
__global__ void adamw_tiles_kernel(const AdamWTile* tiles, float* p, const float* g, float* m,
                                   float* v, uint16_t* p_bf16, float* p_f32, AdamWScalars s,
                                   float grad_scale) {
  const AdamWTile tile = tiles[blockIdx.x];
  // The fp32 copy of this tile's elements, at p_f32[i + shift] (unaligned in general: written
  // element by element).
  const int64_t shift = tile.mirror_shift;
  const bool mirrored = p_f32 != nullptr && shift != kNoMirror;
  const float weight_decay_lr = tile.decay ? s.weight_decay_lr : 0.0f;
  const int64_t begin = tile.begin, end = tile.begin + tile.length;
  const int64_t up = (begin + 3) & ~int64_t(3), down = end & ~int64_t(3);
  const int64_t vec_begin = up < end ? up : end;
  const int64_t vec_end = down > vec_begin ? down : vec_begin;
  auto scalar = [&](int64_t i) {
    float m_i = m[i], v_i = v[i];
    const float updated = adamw_element(p[i], g[i] * grad_scale, m_i, v_i, s, weight_decay_lr);
    m[i] = m_i;
    v[i] = v_i;
    p[i] = updated;
    if (p_bf16) store_from_float(p_bf16, i, updated);
    if (mirrored) p_f32[i + shift] = updated;
  };
  if (threadIdx.x < vec_begin - begin) scalar(begin + threadIdx.x);
  if (threadIdx.x < end - vec_end) scalar(vec_end + threadIdx.x);
  for (int64_t i = vec_begin + 4 * int64_t(threadIdx.x); i < vec_end; i += 4 * int64_t(blockDim.x)) {
    float4 weight = *reinterpret_cast<const float4*>(p + i);
    const float4 gradient = *reinterpret_cast<const float4*>(g + i);
    float4 m4 = *reinterpret_cast<const float4*>(m + i);
    float4 v4 = *reinterpret_cast<const float4*>(v + i);
    weight.x = adamw_element(weight.x, gradient.x * grad_scale, m4.x, v4.x, s, weight_decay_lr);
    weight.y = adamw_element(weight.y, gradient.y * grad_scale, m4.y, v4.y, s, weight_decay_lr);
    weight.z = adamw_element(weight.z, gradient.z * grad_scale, m4.z, v4.z, s, weight_decay_lr);
    weight.w = adamw_element(weight.w, gradient.w * grad_scale, m4.w, v4.w, s, weight_decay_lr);
    *reinterpret_cast<float4*>(p + i) = weight;
    *reinterpret_cast<float4*>(m + i) = m4;
    *reinterpret_cast<float4*>(v + i) = v4;
    if (p_bf16) {
      uint2 packed;
      packed.x = uint32_t(bf16_bits(weight.x)) | (uint32_t(bf16_bits(weight.y)) << 16);
      packed.y = uint32_t(bf16_bits(weight.z)) | (uint32_t(bf16_bits(weight.w)) << 16);
      *reinterpret_cast<uint2*>(p_bf16 + i) = packed;
    }
    if (mirrored) {
      p_f32[i + shift] = weight.x;
      p_f32[i + shift + 1] = weight.y;
      p_f32[i + shift + 2] = weight.z;
      p_f32[i + shift + 3] = weight.w;
    }
  }
}

}  // namespace

AdamWRangePlan::AdamWRangePlan(const std::vector<AdamWRange>& ranges,
                               const std::vector<AdamWMirror>& mirrors) {
  std::vector<AdamWMirror> sorted = mirrors;
  std::sort(sorted.begin(), sorted.end(),
            [](const AdamWMirror& a, const AdamWMirror& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < sorted.size(); ++i)
    DM_CHECK(sorted[i].begin <= sorted[i].end && (i == 0 || sorted[i - 1].end <= sorted[i].begin),
             "AdamWRangePlan: mirrors must be disjoint ranges");
  std::vector<AdamWTile> tiles;
  // Tiles of ≤ kAdamWTileElements over [begin, end), none across a mirror's bounds.
  auto cut = [&](int64_t begin, int64_t end, int64_t shift, bool decay) {
    for (int64_t at = begin; at < end; at += kAdamWTileElements)
      tiles.push_back(
          {at, shift, int32_t(std::min<int64_t>(kAdamWTileElements, end - at)), decay ? 1 : 0});
  };
  for (const AdamWRange& r : ranges) {
    DM_CHECK(r.begin >= 0 && r.end >= r.begin, "AdamWRangePlan: bad range [", r.begin, ", ",
             r.end, ")");
    elements_ += r.end - r.begin;
    // The mirrors overlapping r, in order, split it into mirrored and plain pieces.
    auto it = std::upper_bound(sorted.begin(), sorted.end(), r.begin,
                               [](int64_t x, const AdamWMirror& m) { return x < m.end; });
    int64_t at = r.begin;
    for (; it != sorted.end() && it->begin < r.end; ++it) {
      const int64_t b = std::max(at, it->begin), e = std::min(r.end, it->end);
      if (b >= e) continue;
      cut(at, b, kNoMirror, r.decay);
      cut(b, e, it->packed - it->begin, r.decay);
      at = e;
    }
    cut(at, r.end, kNoMirror, r.decay);
  }
  tiles_ = int64_t(tiles.size());
  DM_CHECK(tiles_ < (int64_t(1) << 31), "AdamWRangePlan: too many tiles (", tiles_, ")");
  table_ = std::make_unique<DeviceArena>(std::max<size_t>(256, tiles.size() * sizeof(AdamWTile)));
  void* device_tiles = table_->alloc_bytes(tiles.size() * sizeof(AdamWTile));
  if (!tiles.empty()) copy_to_device(device_tiles, tiles.data(), tiles.size() * sizeof(AdamWTile));
  device_tiles_ = device_tiles;
}

AdamWRangePlan::~AdamWRangePlan() = default;

void adamw_update_ranges(const AdamWRangePlan& plan, float* p, const float* g, float* m, float* v,
                         uint16_t* p_bf16, float* p_f32, const AdamWStep& st, float grad_scale,
                         Stream stream) {
  const AdamWScalars s = adamw_scalars(st);
  if (plan.tiles() == 0) return;
  adamw_tiles_kernel<<<unsigned(plan.tiles()), kElementThreads, 0, stream>>>(
      static_cast<const AdamWTile*>(plan.device_tiles()), p, g, m, v, p_bf16, p_f32, s, grad_scale);
  check_last_error("cuda adamw_update_ranges");
}

// ---------------------------------------------------------------------------------------------
// Public entry points.

void rmsnorm_forward(const float* x, const float* w, float* y, int64_t N, int64_t D, double eps,
                     Stream stream) {
  rmsnorm_forward_launch(x, w, y, N, D, eps, stream);
}
void rmsnorm_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t D,
                     double eps, Stream stream) {
  rmsnorm_forward_launch(x, w, y, N, D, eps, stream);
}

size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t D) {
  if (N <= 0) return 0;
  return (size_t((N + 63) / 64 * 64) + size_t(rmsnorm_dw_splits(N)) * size_t(D)) * sizeof(float);
}
void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                      int64_t N, int64_t D, double eps, void* workspace, Stream stream,
                      bool accumulate_dx) {
  rmsnorm_backward_launch(x, w, dy, dx, dw, N, D, eps, workspace, stream, accumulate_dx);
}
void rmsnorm_backward(const uint16_t* x, const uint16_t* w, const uint16_t* dy, uint16_t* dx,
                      float* dw, int64_t N, int64_t D, double eps, void* workspace, Stream stream,
                      bool accumulate_dx) {
  rmsnorm_backward_launch(x, w, dy, dx, dw, N, D, eps, workspace, stream, accumulate_dx);
}

void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluKernelParams& a,
                 Stream stream) {
  glu_forward_launch(g, u, h, n, a, stream);
}
void glu_forward(const uint16_t* g, const uint16_t* u, uint16_t* h, int64_t n,
                 const GluKernelParams& a, Stream stream, GluRows rows) {
  glu_forward_launch(g, u, h, n, a, stream, rows);
}
void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                  int64_t n, const GluKernelParams& a, Stream stream) {
  glu_backward_launch(g, u, dh, dg, du, n, a, stream);
}
void glu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dh, uint16_t* dg,
                  uint16_t* du, int64_t n, const GluKernelParams& a, Stream stream, GluRows rows) {
  glu_backward_launch(g, u, dh, dg, du, n, a, stream, rows);
}

void adamw_update(float* p, const float* g, float* m, float* v, uint16_t* p_bf16, int64_t n,
                  const AdamWStep& s, Stream stream) {
  adamw_launch(p, g, m, v, p_bf16, n, s, stream);
}
void adamw_update(float* p, const uint16_t* g, float* m, float* v, uint16_t* p_bf16, int64_t n,
                  const AdamWStep& s, Stream stream) {
  adamw_launch(p, g, m, v, p_bf16, n, s, stream);
}

}  // namespace dm::cuda
