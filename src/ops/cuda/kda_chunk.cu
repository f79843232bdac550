// Chunked KDA forward on CUDA (see kda.h for the stages and kda_common.cuh for the masks).
//
// Work and traffic per chunk of one head (C = 64, K = V = 128): prepare ≈ 1.1 MFLOP of
// intra-chunk products (+ ≈ 83 k exps) and ≈ 1.1 MFLOP of forward substitution; state ≈ 2.1 + 2.1
// MFLOP (W·S and Keᵀ·V') but sequential over chunks; output ≈ 2.1 + 1.0 MFLOP. The workspace
// round trip (W, U, Q⊙e^Γ, K⊙e^{γ−Γ}, P, V', S: ≈ 246 KB per chunk-head in fp32) is what the
// fused single-pass kernels of other implementations avoid; here clarity comes first.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_common.cuh"

namespace dm::cuda {
namespace kda_detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Stage 1: prepare (grid: num_chunks × B·H). After kda_chunk_prepare, each thread solves columns
// of (I + Diag(β)L)·[W | U] = Diag(β)·[K⊙e^Γ | V] by forward substitution with the column held
// in registers (all indices compile-time: the loops over C = 64 rows are unrolled).
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_prepare_kernel(const Storage* q, const Storage* k, const Storage* v,
                             const Storage* g, const Storage* beta, const int32_t* doc_start,
                             KdaDims d, KdaForwardWorkspace ws) {
  extern __shared__ float shared[];
  const int64_t n = blockIdx.x, bh = blockIdx.y;
  const KdaChunkShared sm = kda_chunk_shared_carve(shared, d);
  kda_chunk_prepare(q, k, g, beta, doc_start, d, bh, n, sm);

  const int tid = threadIdx.x, ldk = kda_ldk(d);
  const int64_t ch = bh * d.num_chunks + n;
  const int64_t b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
  const int c = kda_chunk_length(d, n);

  for (int col = tid; col < d.KP + d.VP; col += kThreads) {
    const bool key_column = col < d.KP;
    const int e = col - d.KP;  // value column when !key_column
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float rhs;
      if (key_column) {
        rhs = sm.seg[i] == 0 ? sm.key_norm[i * ldk + col] * expf(sm.gamma[i * ldk + col]) : 0.0f;
      } else {
        rhs = (i < c && e < d.V) ? load_as_float(v, kda_token_row(d, b, h, t0 + i) * d.V + e)
                                 : 0.0f;
      }
      float lower_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) lower_sum += sm.lower_key_key[i * kLowerStride + j] * x[j];
      x[i] = sm.beta[i] * (rhs - lower_sum);
    }
    if (key_column) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) ws.w[(ch * kChunk + i) * d.KP + col] = x[i];
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) ws.u[(ch * kChunk + i) * d.VP + e] = x[i];
    }
  }

  const int last_segment = sm.seg[kChunk - 1];
  for (int idx = tid; idx < kChunk * d.KP; idx += kThreads) {
    const int i = idx / d.KP, col = idx % d.KP;
    const float gamma = sm.gamma[i * ldk + col];
    const float gamma_last = sm.gamma[(kChunk - 1) * ldk + col];
    ws.query_decay[ch * kChunk * d.KP + idx] =
        sm.seg[i] == 0 ? sm.query_norm[i * ldk + col] * expf(gamma) : 0.0f;
    ws.key_to_end[ch * kChunk * d.KP + idx] =
        sm.seg[i] == last_segment ? sm.key_norm[i * ldk + col] * expf(gamma_last - gamma) : 0.0f;
  }
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    ws.lower_query_key[ch * kChunk * kChunk + idx] = sm.lower_query_key[i * kLowerStride + j];
    ws.lower_key_key[ch * kChunk * kChunk + idx] = j < i ? sm.lower_key_key[i * kLowerStride + j] : 0.0f;
  }
  for (int col = tid; col < d.KP; col += kThreads)
    ws.decay_whole[ch * d.KP + col] =
        last_segment == 0 ? expf(sm.gamma[(kChunk - 1) * ldk + col]) : 0.0f;
  if (tid < 2 * kChunk)
    ws.inverse_norms[ch * 2 * kChunk + tid] =
        tid < kChunk ? sm.query_inv_norm[tid] : sm.key_inv_norm[tid - kChunk];
}

// ---------------------------------------------------------------------------------------------
// Stage 2: state (grid: ceil(VP/32) × B·H; sequential over chunks). Thread (tx, ty) = (column
// of the tile, row lane of 8). Shared: W, K⊙e^{γ−Γ} [C, KP], U and V' tiles [C, 32], the state
// tile [KP, 32], e^γ [KP]. Per chunk: store S, V' = U − W·S, S ← Diag(e^γ)·S + Keᵀ·V'.
__global__ void __launch_bounds__(kThreads)
    kda_chunk_state_kernel(const float* s0, float* sT, KdaDims d, KdaForwardWorkspace ws) {
  extern __shared__ float shared[];
  float* w_tile = shared;                          // [C, KP]
  float* key_to_end_tile = w_tile + kChunk * d.KP; // [C, KP]
  float* u_tile = key_to_end_tile + kChunk * d.KP; // [C, 32]
  float* value_new_tile = u_tile + kChunk * kTileV;  // [C, 32]
  float* state = value_new_tile + kChunk * kTileV;   // [KP, 32]
  float* decay = state + d.KP * kTileV;              // [KP]

  const int tid = threadIdx.x, tx = tid % kTileV, ty = tid / kTileV;
  constexpr int kRowLanes = kThreads / kTileV;  // 8
  const int64_t bh = blockIdx.y;
  const int e0 = blockIdx.x * kTileV, e = e0 + tx;
  const bool column_real = e < d.V, column_padded = e < d.VP;

  for (int row = ty; row < d.KP; row += kRowLanes)
    state[row * kTileV + tx] = (s0 != nullptr && column_real && row < d.K)
                                   ? s0[(bh * d.K + row) * d.V + e]
                                   : 0.0f;

  for (int64_t n = 0; n < d.num_chunks; ++n) {
    const int64_t ch = bh * d.num_chunks + n;
    for (int idx = tid; idx < kChunk * d.KP; idx += kThreads) {
      w_tile[idx] = ws.w[ch * kChunk * d.KP + idx];
      key_to_end_tile[idx] = ws.key_to_end[ch * kChunk * d.KP + idx];
    }
    for (int i = ty; i < kChunk; i += kRowLanes)
      u_tile[i * kTileV + tx] = column_padded ? ws.u[(ch * kChunk + i) * d.VP + e] : 0.0f;
    for (int col = tid; col < d.KP; col += kThreads) decay[col] = ws.decay_whole[ch * d.KP + col];
    if (column_padded)
      for (int row = ty; row < d.KP; row += kRowLanes)
        ws.states[(ch * d.KP + row) * d.VP + e] = state[row * kTileV + tx];
    __syncthreads();

    // V'[i, e] for rows i = ty + 8r.
    float acc[kChunk / kRowLanes];
#pragma unroll
    for (int r = 0; r < kChunk / kRowLanes; ++r) acc[r] = u_tile[(ty + kRowLanes * r) * kTileV + tx];
    for (int dd = 0; dd < d.KP; ++dd) {
      const float state_value = state[dd * kTileV + tx];
#pragma unroll
      for (int r = 0; r < kChunk / kRowLanes; ++r)
        acc[r] -= w_tile[(ty + kRowLanes * r) * d.KP + dd] * state_value;
    }
#pragma unroll
    for (int r = 0; r < kChunk / kRowLanes; ++r) {
      const int i = ty + kRowLanes * r;
      value_new_tile[i * kTileV + tx] = acc[r];
      if (column_padded) ws.value_new[(ch * kChunk + i) * d.VP + e] = acc[r];
    }
    __syncthreads();

    // S[dd, e] for rows dd = ty + 8r (KP ≤ 128: at most 16 rows per thread).
#pragma unroll
    for (int r = 0; r < kKdaCudaMaxHeadDim / kRowLanes; ++r) {
      const int dd = ty + kRowLanes * r;
      if (dd < d.KP) {
        float value = decay[dd] * state[dd * kTileV + tx];
        for (int i = 0; i < kChunk; ++i)
          value += key_to_end_tile[i * d.KP + dd] * value_new_tile[i * kTileV + tx];
        state[dd * kTileV + tx] = value;
      }
    }
    __syncthreads();
  }
  if (sT != nullptr && column_real)
    for (int row = ty; row < d.K; row += kRowLanes) sT[(bh * d.K + row) * d.V + e] = state[row * kTileV + tx];
}

// ---------------------------------------------------------------------------------------------
// Stage 3: output (grid: num_chunks × B·H × ceil(VP/32)). O[i, e] = Σ_d Qd[i,d]·S[d,e] +
// Σ_{j≤i} P[i,j]·V'[j,e], rows i = ty + 8r.
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_output_kernel(Storage* o, KdaDims d, KdaForwardWorkspace ws) {
  extern __shared__ float shared[];
  float* query_decay = shared;                          // [C, KP]
  float* state = query_decay + kChunk * d.KP;           // [KP, 32]
  float* lower_query_key = state + d.KP * kTileV;       // [C, C]
  float* value_new_tile = lower_query_key + kChunk * kChunk;  // [C, 32]

  const int tid = threadIdx.x, tx = tid % kTileV, ty = tid / kTileV;
  constexpr int kRowLanes = kThreads / kTileV;
  const int64_t n = blockIdx.x, bh = blockIdx.y;
  const int64_t ch = bh * d.num_chunks + n;
  const int e0 = blockIdx.z * kTileV, e = e0 + tx;
  const bool column_padded = e < d.VP;

  for (int idx = tid; idx < kChunk * d.KP; idx += kThreads)
    query_decay[idx] = ws.query_decay[ch * kChunk * d.KP + idx];
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads)
    lower_query_key[idx] = ws.lower_query_key[ch * kChunk * kChunk + idx];
  for (int row = ty; row < d.KP; row += kRowLanes)
    state[row * kTileV + tx] = column_padded ? ws.states[(ch * d.KP + row) * d.VP + e] : 0.0f;
  for (int i = ty; i < kChunk; i += kRowLanes)
    value_new_tile[i * kTileV + tx] = column_padded ? ws.value_new[(ch * kChunk + i) * d.VP + e] : 0.0f;
  __syncthreads();

  const int64_t b = bh / d.H, h = bh % d.H;
  const int c = kda_chunk_length(d, n);
#pragma unroll
  for (int r = 0; r < kChunk / kRowLanes; ++r) {
    const int i = ty + kRowLanes * r;
    float acc = 0.0f;
    for (int dd = 0; dd < d.KP; ++dd) acc += query_decay[i * d.KP + dd] * state[dd * kTileV + tx];
    for (int j = 0; j <= i; ++j) acc += lower_query_key[i * kChunk + j] * value_new_tile[j * kTileV + tx];
    if (i < c && e < d.V) store_from_float(o, kda_token_row(d, b, h, n * kChunk + i) * d.V + e, acc);
  }
}

size_t kda_prepare_shared_bytes(const KdaDims& d) {
  return size_t(kda_chunk_shared_floats(d)) * sizeof(float);
}
size_t kda_state_shared_bytes(const KdaDims& d) {
  return size_t(2 * kChunk * d.KP + 2 * kChunk * kTileV + d.KP * kTileV + d.KP) * sizeof(float);
}
size_t kda_output_shared_bytes(const KdaDims& d) {
  return size_t(kChunk * d.KP + d.KP * kTileV + kChunk * kChunk + kChunk * kTileV) * sizeof(float);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host side shared with the backward (declared in kda_common.cuh).

KdaDims kda_make_dims(const KdaShape& s, float scale, const char* who) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.K > 0 && s.V > 0, who, ": bad shape B=", s.B,
           " T=", s.T, " H=", s.H, " K=", s.K, " V=", s.V);
  DM_CHECK(s.K <= kKdaCudaMaxHeadDim && s.V <= kKdaCudaMaxHeadDim, who, ": K=", s.K, " V=", s.V,
           " (the chunked CUDA kernels take K, V ≤ ", kKdaCudaMaxHeadDim, ")");
  DM_CHECK(s.B * s.H < 65536, who, ": B·H=", s.B * s.H, " exceeds one grid dimension (65535)");
  KdaDims d;
  d.B = s.B;
  d.T = s.T;
  d.H = s.H;
  d.K = int(s.K);
  d.V = int(s.V);
  d.KP = int((s.K + 15) / 16 * 16);
  d.VP = int((s.V + 15) / 16 * 16);
  d.num_chunks = (s.T + kChunk - 1) / kChunk;
  d.scale = scale;
  return d;
}

// Carves the forward workspace from base (nullptr: only counts); returns the bytes.
size_t kda_forward_workspace_carve(const KdaDims& d, void* base, KdaForwardWorkspace* ws) {
  const int64_t chunk_heads = d.B * d.H * d.num_chunks;
  size_t offset = 0;
  auto take = [&](float** view, int64_t floats) {
    if (ws != nullptr) *view = reinterpret_cast<float*>(static_cast<char*>(base) + offset);
    offset += (size_t(floats) * sizeof(float) + 255) / 256 * 256;
  };
  KdaForwardWorkspace unused;
  KdaForwardWorkspace* out = ws != nullptr ? ws : &unused;
  take(&out->w, chunk_heads * kChunk * d.KP);
  take(&out->u, chunk_heads * kChunk * d.VP);
  take(&out->query_decay, chunk_heads * kChunk * d.KP);
  take(&out->key_to_end, chunk_heads * kChunk * d.KP);
  take(&out->lower_query_key, chunk_heads * kChunk * kChunk);
  take(&out->lower_key_key, chunk_heads * kChunk * kChunk);
  take(&out->decay_whole, chunk_heads * d.KP);
  take(&out->value_new, chunk_heads * kChunk * d.VP);
  take(&out->states, chunk_heads * d.KP * d.VP);
  take(&out->inverse_norms, chunk_heads * 2 * kChunk);
  return offset;
}

template <typename Storage>
void kda_chunk_prepare_and_state(const Storage* q, const Storage* k, const Storage* v,
                                 const Storage* g, const Storage* beta, const float* s0,
                                 float* sT, const KdaDims& d, const KdaForwardWorkspace& ws,
                                 const int32_t* doc_start, bool tensor_cores,
                                 cudaStream_t stream) {
  const int64_t bh_count = d.B * d.H;
  // bf16 inputs with tensor cores take the tensor-core prepare; DM_KDA_PREPARE=fp32 forces the
  // fp32 kernel (comparisons).
  static const bool prepare_fp32_forced = [] {
    return env_choice("DM_KDA_PREPARE", {"tc", "fp32"}) == 1;
  }();
  if constexpr (sizeof(Storage) == 2) {
    if (tensor_cores && !prepare_fp32_forced) {
      kda_chunk_prepare_tensor_cores(q, k, v, g, beta, doc_start, d, ws, stream);
      kda_chunk_state_tf32(s0, sT, d, ws, stream);
      return;
    }
  }
  if (d.num_chunks > 0) {
    const size_t prepare_bytes = kda_prepare_shared_bytes(d);
    DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_prepare_kernel<Storage>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(prepare_bytes)));
    kda_chunk_prepare_kernel<Storage><<<dim3(unsigned(d.num_chunks), unsigned(bh_count)),
                                        kThreads, prepare_bytes, stream>>>(q, k, v, g, beta,
                                                                           doc_start, d, ws);
    check_last_error("cuda kda_chunk_forward (prepare)");
  }
  if (tensor_cores) {
    kda_chunk_state_tf32(s0, sT, d, ws, stream);
    return;
  }
  const size_t state_bytes = kda_state_shared_bytes(d);
  DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_state_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(state_bytes)));
  kda_chunk_state_kernel<<<dim3(unsigned(ceil_div(d.VP, kTileV)), unsigned(bh_count)), kThreads,
                           state_bytes, stream>>>(s0, sT, d, ws);
  check_last_error("cuda kda_chunk_forward (state)");
}

template void kda_chunk_prepare_and_state<float>(const float*, const float*, const float*,
                                                 const float*, const float*, const float*,
                                                 float*, const KdaDims&,
                                                 const KdaForwardWorkspace&, const int32_t*,
                                                 bool, cudaStream_t);
template void kda_chunk_prepare_and_state<uint16_t>(const uint16_t*, const uint16_t*,
                                                    const uint16_t*, const uint16_t*,
                                                    const uint16_t*, const float*, float*,
                                                    const KdaDims&, const KdaForwardWorkspace&,
                                                    const int32_t*, bool, cudaStream_t);

template <typename Storage>
void kda_chunk_forward_launch(const Storage* q, const Storage* k, const Storage* v,
                              const Storage* g, const Storage* beta, const float* s0, Storage* o,
                              float* sT, const KdaShape& s, float scale, void* workspace,
                              const int32_t* doc_start, cudaStream_t stream) {
  const KdaDims d = kda_make_dims(s, scale, "cuda kda_chunk_forward");
  if (d.B * d.H == 0) return;
  DM_CHECK(workspace != nullptr || kda_forward_workspace_carve(d, nullptr, nullptr) == 0,
           "cuda kda_chunk_forward: workspace is null (size it with "
           "kda_chunk_forward_workspace_bytes)");
  KdaForwardWorkspace ws;
  kda_forward_workspace_carve(d, workspace, &ws);
  // bf16 inputs: the state and output products on tensor cores; fp32 inputs: fp32 throughout.
  const bool tensor_cores = sizeof(Storage) == 2;
  kda_chunk_prepare_and_state(q, k, v, g, beta, s0, sT, d, ws, doc_start, tensor_cores, stream);
  if (d.num_chunks == 0) return;
  if (tensor_cores) {
    kda_chunk_output_tensor_cores(o, d, ws, stream);
    return;
  }
  const size_t output_bytes = kda_output_shared_bytes(d);
  DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_output_kernel<Storage>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(output_bytes)));
  kda_chunk_output_kernel<Storage>
      <<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H), unsigned(ceil_div(d.VP, kTileV))),
         kThreads, output_bytes, stream>>>(o, d, ws);
  check_last_error("cuda kda_chunk_forward (output)");
}

}  // namespace kda_detail

size_t kda_chunk_forward_workspace_bytes(const KdaShape& s) {
  const kda_detail::KdaDims d = kda_detail::kda_make_dims(s, 1.0f, "cuda kda_chunk_forward");
  return kda_detail::kda_forward_workspace_carve(d, nullptr, nullptr);
}

void kda_chunk_forward_state_at(const void* workspace, const KdaShape& s, int64_t b, int64_t chunk,
                                float* dst, KdaStream stream) {
  const kda_detail::KdaDims d =
      kda_detail::kda_make_dims(s, 1.0f, "cuda kda_chunk_forward_state_at");
  DM_CHECK(b >= 0 && b < d.B && chunk >= 0 && chunk < d.num_chunks,
           "cuda kda_chunk_forward_state_at: (b ", b, ", chunk ", chunk, ") outside (", d.B, ", ",
           d.num_chunks, ")");
  DM_CHECK(workspace && dst, "cuda kda_chunk_forward_state_at: null argument");
  kda_detail::KdaForwardWorkspace ws;
  kda_detail::kda_forward_workspace_carve(d, const_cast<void*>(workspace), &ws);
  // states[(ch·KP + row)·VP + e], ch = (b·H + h)·num_chunks + chunk: per head a [K, V] block of
  // rows VP apart; the heads' blocks are num_chunks·KP·VP apart. Unpadded (the usual head dims):
  // one 2-D copy of H contiguous blocks; padded: one per head.
  const float* first = ws.states + ((b * d.H * d.num_chunks + chunk) * d.KP) * d.VP;
  if (d.KP == d.K && d.VP == d.V) {
    DM_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(d.K) * d.V * sizeof(float), first,
                                    size_t(d.num_chunks) * d.KP * d.VP * sizeof(float),
                                    size_t(d.K) * d.V * sizeof(float), size_t(d.H),
                                    cudaMemcpyDefault, stream));
    return;
  }
  for (int64_t h = 0; h < d.H; ++h) {
    const float* src = ws.states + (((b * d.H + h) * d.num_chunks + chunk) * d.KP) * d.VP;
    DM_CUDA_CHECK(cudaMemcpy2DAsync(dst + h * d.K * d.V, size_t(d.V) * sizeof(float), src,
                                    size_t(d.VP) * sizeof(float), size_t(d.V) * sizeof(float),
                                    size_t(d.K), cudaMemcpyDefault, stream));
  }
}

void kda_chunk_forward(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, const float* s0, float* o, float* sT,
                       const KdaShape& s, float scale, void* workspace,
                       const int32_t* doc_start, KdaStream stream) {
  kda_detail::kda_chunk_forward_launch(q, k, v, g, beta, s0, o, sT, s, scale, workspace,
                                       doc_start, stream);
}
void kda_chunk_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                       const uint16_t* g, const uint16_t* beta, const float* s0, uint16_t* o,
                       float* sT, const KdaShape& s, float scale, void* workspace,
                       const int32_t* doc_start, KdaStream stream) {
  kda_detail::kda_chunk_forward_launch(q, k, v, g, beta, s0, o, sT, s, scale, workspace,
                                       doc_start, stream);
}

}  // namespace dm::cuda
