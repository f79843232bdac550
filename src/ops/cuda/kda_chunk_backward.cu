// Backward of the chunked KDA on CUDA (kda.h): the algebra of kda_piece_backward
// (ops/cpu/kda_backward.cpp) on masked full chunks (kda_common.cuh), in four stages:
//   1-2. the forward's prepare and state stages again (chunk-start states S_n, V', W, …),
//        unless the caller's workspace already holds them (workspace_holds_forward);
//   3.   state gradient, sequential over chunks backwards, parallel over B·H and 32-column tiles
//        of V (columns of dS are independent, like those of S):
//          dS_start = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·(Ke·dS' + Pᵀ·dO),
//        which is the CPU's dS after steps 1, 2 and 4 written with W = A·Diag(β)·Kd
//        (Kdᵀ·dX = Kdᵀ·Diag(β)·M⁻ᵀ·dV' = Wᵀ·dV'); dS' of every chunk is stored. The fp32
//        kernel below is the reference; the TensorCore path runs kda_chunk_state_tf32.cu's;
//   4.   one block per chunk: every gradient of the chunk from S_n and its dS' (kda_piece_backward
//        steps 1–6), with the block-level matmul of kda_common.cuh and a per-block global
//        scratch. Pairwise sums over e^{Γ_i − Γ_j} are formed directly (an exp per pair and channel,
//        all exponents ≤ 0): clear, not fast. For bf16 inputs, KdaBackwardPath::TensorCore
//        replaces this stage with kda_chunk_backward_tc.cu (mma.sync, operands in shared memory,
//        pairwise decays factored through 16-token sub-blocks); this kernel stays the reference.
// Gradients of the masked pieces: the running reverse cumsum of dΓ restarts at each document
// start (the pairwise terms of a later document sum to zero analytically; cutting them keeps the
// rounding of one document out of the gradient of another), exactly as the CPU walks pieces.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_common.cuh"

namespace dm::cuda {
namespace kda_detail {
namespace {

// Blocks of stage 4 (each loops over chunk-heads); its scratch is per block.
constexpr int kBackwardChunkBlocks = 264;

// Per-block global scratch of stage 4 (fp32, padded dims, row strides KP / VP / C).
struct KdaBackwardScratch {
  float* d_out;            // [C, VP]  dO of the chunk (zero padded)
  float* key_decay;        // [C, KP]  K⊙e^Γ masked to segment 0
  float* residual;         // [C, VP]  X = V − Kd·S
  float* d_value_new;      // [C, VP]  dV', then dR, then dX
  float* d_key_to_end;     // [C, KP]  dKe
  float* d_query_decay;    // [C, KP]  dQd, then dq̂
  float* d_key_decay;      // [C, KP]  dKd, then dk̂
  float* d_lower_key_key;  // [C, C]   dM, then dL
  float* d_lower_query_key;// [C, C]   dP (strictly lower, same segment)
  float* row_lower;        // [C, KP]  Σ_j dL_ij k̂_j e^{Γ_i−Γ_j}
  float* col_lower;        // [C, KP]  Σ_i dL_ij k̂_i e^{Γ_i−Γ_j}
  float* row_query_key;    // [C, KP]  Σ_j dP_ij k̂_j e^{Γ_i−Γ_j}
  float* col_query_key;    // [C, KP]  Σ_i dP_ij q̂_i e^{Γ_i−Γ_j}
  float* d_gate;           // [C, KP]  dg of the chunk before it is added to the output
};

__host__ __device__ inline int64_t kda_backward_scratch_floats(const KdaDims& d) {
  return 3 * int64_t(kChunk) * d.VP + 9 * int64_t(kChunk) * d.KP + 2 * int64_t(kChunk) * kChunk;
}

__device__ inline KdaBackwardScratch kda_backward_scratch_carve(float* base, const KdaDims& d) {
  KdaBackwardScratch s;
  float* p = base;
  const int64_t ck = int64_t(kChunk) * d.KP, cv = int64_t(kChunk) * d.VP, cc = kChunk * kChunk;
  s.d_out = p;             p += cv;
  s.key_decay = p;         p += ck;
  s.residual = p;          p += cv;
  s.d_value_new = p;       p += cv;
  s.d_key_to_end = p;      p += ck;
  s.d_query_decay = p;     p += ck;
  s.d_key_decay = p;       p += ck;
  s.d_lower_key_key = p;   p += cc;
  s.d_lower_query_key = p; p += cc;
  s.row_lower = p;         p += ck;
  s.col_lower = p;         p += ck;
  s.row_query_key = p;     p += ck;
  s.col_query_key = p;     p += ck;
  s.d_gate = p;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Stage 3: state gradient (grid: ceil(VP/32) × B·H). d_states[ch] = gradient of the state after
// chunk n (dS'); ds0 += gradient of the initial state.
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_state_backward_kernel(const Storage* d_o, const float* dsT, float* ds0, KdaDims d,
                                    KdaForwardWorkspace ws, float* d_states) {
  extern __shared__ float shared[];
  float* w_tile = shared;                                 // [C, KP]
  float* key_to_end_tile = w_tile + kChunk * d.KP;        // [C, KP]
  float* query_decay_tile = key_to_end_tile + kChunk * d.KP;  // [C, KP]
  float* lower_query_key = query_decay_tile + kChunk * d.KP;  // [C, C]
  float* d_out_tile = lower_query_key + kChunk * kChunk;  // [C, 32]
  float* d_value_new_tile = d_out_tile + kChunk * kTileV; // [C, 32]
  float* d_state = d_value_new_tile + kChunk * kTileV;    // [KP, 32]
  float* decay = d_state + d.KP * kTileV;                 // [KP]

  const int tid = threadIdx.x, tx = tid % kTileV, ty = tid / kTileV;
  constexpr int kRowLanes = kThreads / kTileV;
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  const int e = blockIdx.x * kTileV + tx;
  const bool column_real = e < d.V, column_padded = e < d.VP;

  for (int row = ty; row < d.KP; row += kRowLanes)
    d_state[row * kTileV + tx] =
        (dsT != nullptr && column_real && row < d.K) ? dsT[(bh * d.K + row) * d.V + e] : 0.0f;

  for (int64_t n = d.num_chunks - 1; n >= 0; --n) {
    const int64_t ch = bh * d.num_chunks + n;
    const int c = kda_chunk_length(d, n);
    for (int idx = tid; idx < kChunk * d.KP; idx += kThreads) {
      w_tile[idx] = ws.w[ch * kChunk * d.KP + idx];
      key_to_end_tile[idx] = ws.key_to_end[ch * kChunk * d.KP + idx];
      query_decay_tile[idx] = ws.query_decay[ch * kChunk * d.KP + idx];
    }
    for (int idx = tid; idx < kChunk * kChunk; idx += kThreads)
      lower_query_key[idx] = ws.lower_query_key[ch * kChunk * kChunk + idx];
    for (int i = ty; i < kChunk; i += kRowLanes)
      d_out_tile[i * kTileV + tx] =
          (i < c && column_real)
              ? load_as_float(d_o, kda_token_row(d, b, h, n * kChunk + i) * d.V + e)
              : 0.0f;
    for (int col = tid; col < d.KP; col += kThreads) decay[col] = ws.decay_whole[ch * d.KP + col];
    if (column_padded)
      for (int row = ty; row < d.KP; row += kRowLanes)
        d_states[(ch * d.KP + row) * d.VP + e] = d_state[row * kTileV + tx];
    __syncthreads();

    // dV'[i, e] = Σ_d Ke[i,d]·dS'[d,e] + Σ_{j≥i} P[j,i]·dO[j,e], rows i = ty + 8r.
#pragma unroll
    for (int r = 0; r < kChunk / kRowLanes; ++r) {
      const int i = ty + kRowLanes * r;
      float acc = 0.0f;
      for (int dd = 0; dd < d.KP; ++dd)
        acc += key_to_end_tile[i * d.KP + dd] * d_state[dd * kTileV + tx];
      for (int j = i; j < kChunk; ++j)
        acc += lower_query_key[j * kChunk + i] * d_out_tile[j * kTileV + tx];
      d_value_new_tile[i * kTileV + tx] = acc;
    }
    __syncthreads();

    // dS[dd, e] = e^γ·dS'[dd,e] + Σ_i Qd[i,dd]·dO[i,e] − Σ_i W[i,dd]·dV'[i,e].
#pragma unroll
    for (int r = 0; r < kKdaCudaMaxHeadDim / kRowLanes; ++r) {
      const int dd = ty + kRowLanes * r;
      if (dd < d.KP) {
        float value = decay[dd] * d_state[dd * kTileV + tx];
        for (int i = 0; i < kChunk; ++i)
          value += query_decay_tile[i * d.KP + dd] * d_out_tile[i * kTileV + tx] -
                   w_tile[i * d.KP + dd] * d_value_new_tile[i * kTileV + tx];
        d_state[dd * kTileV + tx] = value;
      }
    }
    __syncthreads();
  }
  if (ds0 != nullptr && column_real)
    for (int row = ty; row < d.K; row += kRowLanes) ds0[(bh * d.K + row) * d.V + e] += d_state[row * kTileV + tx];
}

// ---------------------------------------------------------------------------------------------
// Stage 4: per-chunk gradients. Grid: kBackwardChunkBlocks blocks (or fewer) looping over the
// chunk-heads; shared memory = the prepare views + [KP] dγ + [C] diagonal of dP + [C] dβ.
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_grad_kernel(const Storage* q, const Storage* k, const Storage* v, const Storage* g,
                          const Storage* beta, const Storage* d_o, const int32_t* doc_start,
                          float* dq, float* dk, float* dv, float* dg, float* dbeta, KdaDims d,
                          KdaForwardWorkspace ws, const float* d_states, float* scratch_base) {
  extern __shared__ float shared[];
  const KdaChunkShared sm = kda_chunk_shared_carve(shared, d);
  float* d_gamma_last = shared + kda_chunk_shared_floats(d);  // [KP]
  float* diag_query_key = d_gamma_last + d.KP;                // [C]  diagonal of dP
  float* d_beta_chunk = diag_query_key + kChunk;              // [C]
  const KdaBackwardScratch sc =
      kda_backward_scratch_carve(scratch_base + blockIdx.x * kda_backward_scratch_floats(d), d);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ldk = kda_ldk(d);
  const int KP = d.KP, VP = d.VP;
  const int64_t total = d.B * d.H * d.num_chunks;

  for (int64_t ch = blockIdx.x; ch < total; ch += gridDim.x) {
    const int64_t bh = ch / d.num_chunks, n = ch % d.num_chunks;
    const int64_t b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
    const int c = kda_chunk_length(d, n);
    kda_chunk_prepare(q, k, g, beta, doc_start, d, bh, n, sm);
    const float* state = ws.states + ch * KP * VP;          // [KP, VP]
    const float* d_state_after = d_states + ch * KP * VP;   // [KP, VP]  dS'
    const float* value_new = ws.value_new + ch * kChunk * VP;      // [C, VP]
    const float* key_to_end = ws.key_to_end + ch * kChunk * KP;    // [C, KP]
    const float* decay_whole = ws.decay_whole + ch * KP;           // [KP]
    const int last_segment = sm.seg[kChunk - 1];

    // (a) dO, V (into X), K⊙e^Γ; dγ = e^γ ⊙ rowsum(S ⊙ dS').
    for (int idx = tid; idx < kChunk * VP; idx += kThreads) {
      const int i = idx / VP, e = idx % VP;
      const bool real = i < c && e < d.V;
      const int64_t row = kda_token_row(d, b, h, t0 + i);
      sc.d_out[idx] = real ? load_as_float(d_o, row * d.V + e) : 0.0f;
      sc.residual[idx] = real ? load_as_float(v, row * d.V + e) : 0.0f;
    }
    for (int idx = tid; idx < kChunk * KP; idx += kThreads) {
      const int i = idx / KP, col = idx % KP;
      sc.key_decay[idx] =
          sm.seg[i] == 0 ? sm.key_norm[i * ldk + col] * expf(sm.gamma[i * ldk + col]) : 0.0f;
    }
    for (int col = tid; col < KP; col += kThreads) {
      float dot = 0.0f;
      for (int e = 0; e < VP; ++e) dot += state[col * VP + e] * d_state_after[col * VP + e];
      d_gamma_last[col] = decay_whole[col] * dot;
    }
    __syncthreads();

    // (b) X = V − Kd·S;  dKe = V'·dS'ᵀ;  dV' = Ke·dS';  dQd = dO·Sᵀ;  dP = dO·V'ᵀ.
    block_matmul<false, false>(kChunk, VP, KP, -1.0f, sc.key_decay, KP, state, VP, true,
                               sc.residual, VP);
    block_matmul<false, true>(kChunk, KP, VP, 1.0f, value_new, VP, d_state_after, VP, false,
                              sc.d_key_to_end, KP);
    block_matmul<false, false>(kChunk, VP, KP, 1.0f, key_to_end, KP, d_state_after, VP, false,
                               sc.d_value_new, VP);
    block_matmul<false, true>(kChunk, KP, VP, 1.0f, sc.d_out, VP, state, VP, false,
                              sc.d_query_decay, KP);
    block_matmul<false, true>(kChunk, kChunk, VP, 1.0f, sc.d_out, VP, value_new, VP, false,
                              sc.d_lower_query_key, kChunk);
    __syncthreads();

    // (c) dV' += Pᵀ·dO; dP keeps its strictly lower same-segment part, the diagonal apart (its
    //     two contributions to dΓ_i cancel exactly: it enters dq̂, dk̂ only).
    block_matmul<true, false>(kChunk, VP, kChunk, 1.0f, sm.lower_query_key, kLowerStride,
                              sc.d_out, VP, true, sc.d_value_new, VP);
    for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      if (i == j) diag_query_key[i] = sc.d_lower_query_key[idx];
      if (!(j < i && sm.seg[i] == sm.seg[j])) sc.d_lower_query_key[idx] = 0.0f;
    }
    __syncthreads();

    // (d) dR = M⁻ᵀ·dV' (M = I + Diag(β)L): back substitution in place, one column per thread
    //     (dR_j = dV'_j − Σ_{i>j} β_i L_ij dR_i, j descending; coalesced over the columns).
    for (int e = tid; e < VP; e += kThreads) {
      for (int j = kChunk - 2; j >= 0; --j) {
        float upper_sum = 0.0f;
        for (int i = j + 1; i < kChunk; ++i)
          upper_sum += sm.beta[i] * sm.lower_key_key[i * kLowerStride + j] * sc.d_value_new[i * VP + e];
        sc.d_value_new[j * VP + e] -= upper_sum;
      }
    }
    __syncthreads();

    // (e) dM = −dR·V'ᵀ;  dβ_i = dR_i·X_i (warp per row).
    block_matmul<false, true>(kChunk, kChunk, VP, -1.0f, sc.d_value_new, VP, value_new, VP, false,
                              sc.d_lower_key_key, kChunk);
    for (int i = warp; i < kChunk; i += kThreads / 32) {
      float dot = 0.0f;
      for (int e = lane; e < VP; e += 32) dot += sc.d_value_new[i * VP + e] * sc.residual[i * VP + e];
      dot = warp_sum(dot);
      if (lane == 0) d_beta_chunk[i] = dot;
    }
    __syncthreads();

    // (f) dβ_i += Σ_j L_ij·dM_ij;  dL_ij = β_i·dM_ij (j < i, same segment);  dX = β·dR; dv += dX.
    for (int i = warp; i < kChunk; i += kThreads / 32) {
      float dot = 0.0f;
      for (int j = lane; j < kChunk; j += 32) {
        const float d_m = sc.d_lower_key_key[i * kChunk + j];
        const bool structural = j < i && sm.seg[i] == sm.seg[j];
        dot += structural ? sm.lower_key_key[i * kLowerStride + j] * d_m : 0.0f;
        sc.d_lower_key_key[i * kChunk + j] = structural ? sm.beta[i] * d_m : 0.0f;
      }
      dot = warp_sum(dot);
      if (lane == 0) d_beta_chunk[i] += dot;
      const int64_t row = kda_token_row(d, b, h, t0 + i);
      for (int e = lane; e < VP; e += 32) {
        const float d_x = sm.beta[i] * sc.d_value_new[i * VP + e];
        sc.d_value_new[i * VP + e] = d_x;
        if (i < c && e < d.V) dv[row * d.V + e] += d_x;
      }
    }
    __syncthreads();

    // (g) dKd = −dX·Sᵀ; the pairwise sums of dL and dP (an exponent Γ_i − Γ_j ≤ 0 per term).
    block_matmul<false, true>(kChunk, KP, VP, -1.0f, sc.d_value_new, VP, state, VP, false,
                              sc.d_key_decay, KP);
    for (int idx = tid; idx < kChunk * KP; idx += kThreads) {
      const int i = idx / KP, col = idx % KP;
      const float gamma_i = sm.gamma[i * ldk + col];
      float rows_lower = 0.0f, rows_query_key = 0.0f;  // over j ≤ i, row i
      for (int j = 0; j < i; ++j) {
        const float w_lower = sc.d_lower_key_key[i * kChunk + j];
        const float w_query_key = sc.d_lower_query_key[i * kChunk + j];
        if (w_lower != 0.0f || w_query_key != 0.0f) {
          const float key_j = sm.key_norm[j * ldk + col] * expf(gamma_i - sm.gamma[j * ldk + col]);
          rows_lower += w_lower * key_j;
          rows_query_key += w_query_key * key_j;
        }
      }
      float cols_lower = 0.0f, cols_query_key = 0.0f;  // over i' > i, column i
      for (int later = i + 1; later < kChunk; ++later) {
        const float w_lower = sc.d_lower_key_key[later * kChunk + i];
        const float w_query_key = sc.d_lower_query_key[later * kChunk + i];
        if (w_lower != 0.0f || w_query_key != 0.0f) {
          const float decay_pair = expf(sm.gamma[later * ldk + col] - gamma_i);
          cols_lower += w_lower * sm.key_norm[later * ldk + col] * decay_pair;
          cols_query_key += w_query_key * sm.query_norm[later * ldk + col] * decay_pair;
        }
      }
      sc.row_lower[idx] = rows_lower;
      sc.row_query_key[idx] = rows_query_key;
      sc.col_lower[idx] = cols_lower;
      sc.col_query_key[idx] = cols_query_key;
    }
    __syncthreads();

    // (h) Per channel: dΓ, its reverse cumsum (restarting at document starts) plus dγ and the
    //     forward cumsum of dKe⊙Ke (Ke_i depends on g_j for i < j only); dq̂, dk̂ in place.
    for (int col = tid; col < KP; col += kThreads) {
      const float gamma_last = sm.gamma[(kChunk - 1) * ldk + col];
      float prefix = 0.0f;
      for (int i = 0; i < kChunk; ++i) {
        sc.d_gate[i * KP + col] = prefix;
        prefix += sc.d_key_to_end[i * KP + col] * key_to_end[i * KP + col];
      }
      float running = d_gamma_last[col];
      for (int i = kChunk - 1; i >= 0; --i) {
        if (i < kChunk - 1 && sm.seg[i] != sm.seg[i + 1]) running = 0.0f;
        const int at = i * KP + col, at_shared = i * ldk + col;
        const bool sees_state = sm.seg[i] == 0, feeds_end = sm.seg[i] == last_segment;
        const float query_hat = sm.query_norm[at_shared], key_hat = sm.key_norm[at_shared];
        const float gamma = sm.gamma[at_shared];
        const float decay_from_start = sees_state ? expf(gamma) : 0.0f;
        const float decay_to_end = feeds_end ? expf(gamma_last - gamma) : 0.0f;
        const float d_query_decay = sc.d_query_decay[at], d_key_decay = sc.d_key_decay[at];
        const float row_lower = sc.row_lower[at], col_lower = sc.col_lower[at];
        const float row_query_key = sc.row_query_key[at], col_query_key = sc.col_query_key[at];
        const float d_gamma = d_query_decay * query_hat * decay_from_start +
                              d_key_decay * key_hat * decay_from_start +
                              key_hat * (row_lower - col_lower - col_query_key) +
                              query_hat * row_query_key;
        running += d_gamma;
        sc.d_gate[at] += running;
        sc.d_query_decay[at] = d_query_decay * decay_from_start + row_query_key +
                               diag_query_key[i] * key_hat;
        sc.d_key_decay[at] = d_key_decay * decay_from_start +
                             sc.d_key_to_end[at] * decay_to_end + row_lower + col_lower +
                             col_query_key + diag_query_key[i] * query_hat;
      }
    }
    __syncthreads();

    // (i) Per token (warp per row): dq, dk through the L2 norm; dg; dβ.
    for (int i = warp; i < c; i += kThreads / 32) {
      const int64_t row = kda_token_row(d, b, h, t0 + i);
      float dot_q = 0.0f, dot_k = 0.0f;
      for (int col = lane; col < d.K; col += 32) {
        dot_q += load_as_float(q, row * d.K + col) * sc.d_query_decay[i * KP + col];
        dot_k += load_as_float(k, row * d.K + col) * sc.d_key_decay[i * KP + col];
      }
      const float query_inv = sm.query_inv_norm[i], key_inv = sm.key_inv_norm[i];
      dot_q = warp_sum(dot_q) * query_inv;  // u·dq̂ with u = q·inv
      dot_k = warp_sum(dot_k) * key_inv;
      for (int col = lane; col < d.K; col += 32) {
        const float q_raw = load_as_float(q, row * d.K + col);
        const float k_raw = load_as_float(k, row * d.K + col);
        dq[row * d.K + col] +=
            d.scale * query_inv * (sc.d_query_decay[i * KP + col] - q_raw * query_inv * dot_q);
        dk[row * d.K + col] += key_inv * (sc.d_key_decay[i * KP + col] - k_raw * key_inv * dot_k);
        dg[row * d.K + col] += sc.d_gate[i * KP + col];
      }
      if (lane == 0) dbeta[row] += d_beta_chunk[i];
    }
    __syncthreads();  // shared memory and scratch are reused by the next chunk-head
  }
}

size_t kda_backward_state_shared_bytes(const KdaDims& d) {
  return size_t(3 * kChunk * d.KP + kChunk * kChunk + 2 * kChunk * kTileV + d.KP * kTileV + d.KP) *
         sizeof(float);
}
size_t kda_backward_grad_shared_bytes(const KdaDims& d) {
  return size_t(kda_chunk_shared_floats(d) + d.KP + 2 * kChunk) * sizeof(float);
}
int kda_backward_grad_blocks(const KdaDims& d) {
  return int(std::min<int64_t>(kBackwardChunkBlocks, d.B * d.H * d.num_chunks));
}

// Carves the backward workspace: the forward's from `base`, then the backward's own region
// (d_states, the reference kernel's per-block scratch, the split kernels' hand-over views) after
// it, or from `own` when not null. Returns the bytes taken after the forward's (own != nullptr
// or counting with base == own == nullptr: the own region's size) plus the forward's when the
// own region follows it.
size_t kda_backward_workspace_carve(const KdaDims& d, KdaBackwardPath path, void* base, void* own,
                                    KdaForwardWorkspace* ws, float** d_states, float** scratch,
                                    KdaSplitWorkspace* split) {
  const size_t forward_bytes = kda_forward_workspace_carve(d, base, ws);
  char* region = own != nullptr ? static_cast<char*>(own) : static_cast<char*>(base);
  size_t offset = own != nullptr ? 0 : forward_bytes;
  auto take = [&](float** view, int64_t floats) {
    if (view != nullptr) *view = reinterpret_cast<float*>(region + offset);
    offset += (size_t(floats) * sizeof(float) + 255) / 256 * 256;
  };
  take(d_states, d.B * d.H * d.num_chunks * d.KP * d.VP);
  take(scratch, int64_t(kda_backward_grad_blocks(d)) * kda_backward_scratch_floats(d));
  if (path == KdaBackwardPath::TensorCoreSplit && kda_split_supported(d)) {
    const int64_t chunk_heads = d.B * d.H * d.num_chunks;
    take(split ? &split->d_query_key : nullptr, chunk_heads * 2 * kChunk * kChunk);
    take(split ? &split->d_mix : nullptr, chunk_heads * 2 * kChunk * kChunk);
    take(split ? &split->d_beta : nullptr, chunk_heads * 2 * kChunk);
    take(split ? &split->d_x : nullptr, chunk_heads * kChunk * d.VP);
  }
  return offset;
}

template <typename Storage>
void kda_chunk_backward_launch(const Storage* q, const Storage* k, const Storage* v,
                               const Storage* g, const Storage* beta, const float* s0,
                               const Storage* d_o, const float* dsT, float* dq, float* dk,
                               float* dv, float* dg, float* dbeta, float* ds0, const KdaShape& s,
                               float scale, void* workspace, const int32_t* doc_start,
                               cudaStream_t stream, KdaBackwardPath path,
                               bool workspace_holds_forward, void* backward_own,
                               bool accumulate = true) {
  const KdaDims d = kda_make_dims(s, scale, "cuda kda_chunk_backward");
  if (d.B * d.H == 0) return;
  DM_CHECK(workspace != nullptr || kda_backward_workspace_carve(d, path, nullptr, nullptr, nullptr,
                                                                nullptr, nullptr, nullptr) == 0,
           "cuda kda_chunk_backward: workspace is null (size it with "
           "kda_chunk_backward_workspace_bytes)");
  KdaForwardWorkspace ws;
  float* d_states = nullptr;
  float* scratch = nullptr;
  KdaSplitWorkspace split{};
  kda_backward_workspace_carve(d, path, workspace, backward_own, &ws, &d_states, &scratch, &split);

  // The TensorCore path (bf16) recomputes the forward and runs stage 3 with tf32 products
  // (kda_chunk_state_tf32.cu); the Reference path keeps every product in fp32 on CUDA cores.
  bool tensor_cores = false;
  if constexpr (sizeof(Storage) == 2)
    tensor_cores = path == KdaBackwardPath::TensorCore || path == KdaBackwardPath::TensorCoreSplit;
  if (!(tensor_cores && workspace_holds_forward))
    kda_chunk_prepare_and_state(q, k, v, g, beta, s0, static_cast<float*>(nullptr), d, ws,
                                doc_start, tensor_cores, stream);

  bool state_done = false;
  if constexpr (sizeof(Storage) == 2) {
    if (tensor_cores && kda_chunk_state_backward_tf32_supported(d, d_o)) {
      kda_chunk_state_backward_tf32(d_o, dsT, ds0, d, ws, d_states, stream);
      state_done = true;
    }
  }
  if (!state_done) {
    const size_t state_bytes = kda_backward_state_shared_bytes(d);
    DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_state_backward_kernel<Storage>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(state_bytes)));
    kda_chunk_state_backward_kernel<Storage>
        <<<dim3(unsigned(ceil_div(d.VP, kTileV)), unsigned(d.B * d.H)), kThreads, state_bytes,
           stream>>>(d_o, dsT, ds0, d, ws, d_states);
    check_last_error("cuda kda_chunk_backward (state gradient)");
  }
  if (d.num_chunks == 0) return;

  const bool split_path = sizeof(Storage) == 2 && path == KdaBackwardPath::TensorCoreSplit &&
                          split.d_x != nullptr && d.num_chunks > 0;
  if (!accumulate && !split_path) {  // the other kernels add: start the outputs from zero
    const size_t rows = size_t(d.B) * size_t(d.T) * size_t(d.H);
    const std::pair<float*, int> outputs[] = {
        {dq, d.K}, {dk, d.K}, {dg, d.K}, {dv, d.V}, {dbeta, 1}};
    for (const auto& [out, width] : outputs)
      DM_CUDA_CHECK(cudaMemsetAsync(out, 0, rows * size_t(width) * sizeof(float), stream));
  }
  split.accumulate = accumulate;
  if constexpr (sizeof(Storage) == 2) {
    if (split_path) {
      kda_chunk_grad_split(q, k, v, g, beta, d_o, doc_start, dq, dk, dv, dg, dbeta, d, ws, d_states,
                           split, stream);
      return;
    }
    if (tensor_cores) {
      kda_chunk_grad_tensor_cores(q, k, v, g, beta, d_o, doc_start, dq, dk, dv, dg, dbeta, d, ws,
                                  d_states, stream);
      return;
    }
  }
  const size_t grad_bytes = kda_backward_grad_shared_bytes(d);
  DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_grad_kernel<Storage>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(grad_bytes)));
  kda_chunk_grad_kernel<Storage><<<kda_backward_grad_blocks(d), kThreads, grad_bytes, stream>>>(
      q, k, v, g, beta, d_o, doc_start, dq, dk, dv, dg, dbeta, d, ws, d_states, scratch);
  check_last_error("cuda kda_chunk_backward (chunk gradients)");
}

}  // namespace
}  // namespace kda_detail

KdaBackwardPath kda_backward_default_path() {
  static const KdaBackwardPath path = [] {
    const char* env = std::getenv("DM_KDA_BACKWARD");
    if (env == nullptr || env[0] == '\0' || std::strcmp(env, "tc-split") == 0)
      return KdaBackwardPath::TensorCoreSplit;
    if (std::strcmp(env, "tc") == 0) return KdaBackwardPath::TensorCore;
    DM_CHECK(std::strcmp(env, "ref") == 0,
             "DM_KDA_BACKWARD must be 'ref', 'tc' or 'tc-split', got '", env, "'");
    return KdaBackwardPath::Reference;
  }();
  return path;
}

KdaStage4SharedBytes kda_stage4_shared_bytes(const KdaShape& s) {
  const kda_detail::KdaDims d = kda_detail::kda_make_dims(s, 1.0f, "cuda kda_stage4_shared_bytes");
  return {kda_detail::kda_chunk_grad_tensor_cores_shared_bytes(d),
          kda_detail::kda_chunk_grad_value_shared_bytes(d),
          kda_detail::kda_chunk_grad_key_shared_bytes(d)};
}

bool kda_backward_split_supported(const KdaShape& s) {
  return kda_detail::kda_split_supported(
      kda_detail::kda_make_dims(s, 1.0f, "cuda kda_backward_split_supported"));
}

size_t kda_chunk_backward_workspace_bytes(const KdaShape& s, KdaBackwardPath path) {
  const kda_detail::KdaDims d = kda_detail::kda_make_dims(s, 1.0f, "cuda kda_chunk_backward");
  return kda_detail::kda_backward_workspace_carve(d, path, nullptr, nullptr, nullptr, nullptr,
                                                  nullptr, nullptr);
}

size_t kda_chunk_backward_own_bytes(const KdaShape& s, KdaBackwardPath path) {
  const kda_detail::KdaDims d = kda_detail::kda_make_dims(s, 1.0f, "cuda kda_chunk_backward");
  char probe;  // any non-null `own`: the carve then counts the own region alone
  return kda_detail::kda_backward_workspace_carve(d, path, nullptr, &probe, nullptr, nullptr,
                                                  nullptr, nullptr);
}

void kda_chunk_backward(const float* q, const float* k, const float* v, const float* g,
                        const float* beta, const float* s0, const float* d_o, const float* dsT,
                        float* dq, float* dk, float* dv, float* dg, float* dbeta, float* ds0,
                        const KdaShape& s, float scale, void* workspace,
                        const int32_t* doc_start, KdaStream stream) {
  kda_detail::kda_chunk_backward_launch(q, k, v, g, beta, s0, d_o, dsT, dq, dk, dv, dg, dbeta,
                                        ds0, s, scale, workspace, doc_start, stream,
                                        KdaBackwardPath::Reference, false, nullptr);
}
void kda_chunk_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* g,
                        const uint16_t* beta, const float* s0, const uint16_t* d_o,
                        const float* dsT, float* dq, float* dk, float* dv, float* dg, float* dbeta,
                        float* ds0, const KdaShape& s, float scale, void* workspace,
                        const int32_t* doc_start, KdaStream stream, KdaBackwardPath path,
                        bool workspace_holds_forward, void* backward_own, bool accumulate) {
  kda_detail::kda_chunk_backward_launch(q, k, v, g, beta, s0, d_o, dsT, dq, dk, dv, dg, dbeta, ds0,
                                        s, scale, workspace, doc_start, stream, path,
                                        workspace_holds_forward, backward_own, accumulate);
}

}  // namespace dm::cuda
