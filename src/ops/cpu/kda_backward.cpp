// Kimi Delta Attention backward on CPU (SPEC §1.1): BPTT through the recurrent definition (the
// reference) and the backward of the chunked form. Gradients are of Σ o·do + Σ sT·dsT and are
// accumulated (+=) into dq, dk (w.r.t. the raw, pre-L2-norm q and k), dv, dg, dbeta, ds0.
//
// Chunked backward, per piece (see kda_internal.h) with start state S, given dO and the gradient
// dS' of the state after the piece; R = Diag(β)·X, X = V − (K⊙e^Γ)·S, M = I + Diag(β)·L, V' = M⁻¹R:
//   S_new = Diag(e^γ)S + Keᵀ V'   →  dγ += e^γ ⊙ rowsum(S⊙dS'), dKe = V'·dS'ᵀ, dV' = Ke·dS',
//                                     dS = Diag(e^γ)·dS'
//   O = Qd·S + P·V'               →  dQd = dO·Sᵀ, dS += Qdᵀ·dO, dP = dO·V'ᵀ (j ≤ i), dV' += Pᵀ·dO
//   V' = M⁻¹R                     →  dR = M⁻ᵀ·dV' (back substitution), dM = −dR·V'ᵀ (j < i):
//                                     dL_ij = β_i·dM_ij,  dβ_i += Σ_j L_ij·dM_ij
//   R = Diag(β)·X                 →  dβ_i += dR_i·X_i, dX = Diag(β)·dR, dv += dX,
//                                     dKd = −dX·Sᵀ, dS −= Kdᵀ·dX
//   L, P (pairwise e^{Γ_i−Γ_j})   →  row/column sums of dL, dP against k̂ / q̂ with the same
//                                     pairwise exponents, factored through sub-block reference
//                                     tokens exactly like the forward products (all ≤ 0)
//   Qd = Q⊙e^Γ, Kd = K⊙e^Γ, Ke = K⊙e^{γ−Γ} → dq̂, dk̂, dΓ, dγ;  dg = reverse cumsum of dΓ + dγ
//   q̂ = scale·q/‖q‖, k̂ = k/‖k‖    →  dq, dk through the L2 norm.
// Terms whose +dΓ and −dΓ parts cancel exactly (the diagonal of P, the last token of Ke) are
// kept out of the cumsum: under strong decay the true dg is ~e^{Σg} and their rounding would
// swamp it.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/kda.h"
#include "ops/cpu/kda_internal.h"

namespace dm {
namespace {
using namespace kda_detail;

// Tokens between stored states in the recurrent backward (states in between are recomputed).
constexpr int64_t kKdaRecurrentSegment = 64;

// d_raw[n] += factor_scale·inv_norm·(d_normed − u·(u·d_normed)), u = raw·inv_norm: the backward of
// normed = factor_scale · raw / sqrt(Σ raw² + eps).
template <typename T>
void kda_l2_norm_backward_row(const T* raw, T inv_norm, T factor_scale, const T* d_normed,
                              T* d_raw, int64_t n) {
  T dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t d = 0; d < n; ++d) dot += raw[d] * d_normed[d];
  dot *= inv_norm;  // u·d_normed
  const T outer = factor_scale * inv_norm;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) d_raw[d] += outer * (d_normed[d] - raw[d] * inv_norm * dot);
}

// ---------------------------------------------------------------------------------------------
// Recurrent BPTT.

template <typename T>
void kda_recurrent_backward_one_head(const T* q, const T* k, const T* v, const T* g,
                                     const T* beta, const T* s0_slice, const T* d_o,
                                     const T* dsT_slice, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                     T* ds0_slice, const KdaShape& s, int64_t b, int64_t h,
                                     T scale, const int32_t* doc_start, std::vector<T>& work) {
  const int64_t T_len = s.T, H = s.H, K = s.K, V = s.V, KV = K * V;
  const int64_t num_segments = (T_len + kKdaRecurrentSegment - 1) / kKdaRecurrentSegment;
  // work = [checkpoints: num_segments·KV | segment states: segment·KV | state, decayed,
  //         updated, d_state: 4·KV | vectors]
  T* checkpoints = work.data();
  T* segment_states = checkpoints + num_segments * KV;  // state before token t (after reset)
  T* state = segment_states + kKdaRecurrentSegment * KV;
  T* state_decayed = state + KV;  // S' = Diag(e^g)·S_{t−1}
  T* state_updated = state_decayed + KV;  // S_t
  T* d_state = state_updated + KV;
  T* query_hat = d_state + KV;  // [K]
  T* key_hat = query_hat + K;   // [K]
  T* d_query_hat = key_hat + K;
  T* d_key_hat = d_query_hat + K;
  T* prediction = d_key_hat + K;  // [V]  S'ᵀk̂
  T* delta = prediction + V;      // [V]  β(v − S'ᵀk̂)
  T* d_delta = delta + V;
  T* d_prediction = d_delta + V;

  // Applies token t to `state` in place (the forward recurrence, without the output).
  auto advance = [&](int64_t t) {
    const int64_t row = (b * T_len + t) * H + h;
    const T* k_t = k + row * K;
    const T* g_t = g + row * K;
    const T* v_t = v + row * V;
    const T key_factor = kda_inverse_l2_norm(k_t, K);
    std::fill(prediction, prediction + V, T(0));
    for (int64_t d = 0; d < K; ++d) {
      const T decay = std::exp(g_t[d]);
      for (int64_t e = 0; e < V; ++e) {
        state[d * V + e] *= decay;
        prediction[e] += state[d * V + e] * k_t[d] * key_factor;
      }
    }
    for (int64_t e = 0; e < V; ++e) delta[e] = beta[row] * (v_t[e] - prediction[e]);
    for (int64_t d = 0; d < K; ++d)
      for (int64_t e = 0; e < V; ++e) state[d * V + e] += k_t[d] * key_factor * delta[e];
  };

  // Forward sweep: one checkpoint per segment (the state before its first token, before reset).
  if (s0_slice) std::memcpy(state, s0_slice, size_t(KV) * sizeof(T));
  else std::fill(state, state + KV, T(0));
  for (int64_t t = 0; t < T_len; ++t) {
    if (t % kKdaRecurrentSegment == 0)
      std::memcpy(checkpoints + (t / kKdaRecurrentSegment) * KV, state, size_t(KV) * sizeof(T));
    if (kda_token_starts_document(doc_start, b, T_len, t)) std::fill(state, state + KV, T(0));
    advance(t);
  }

  if (dsT_slice) std::memcpy(d_state, dsT_slice, size_t(KV) * sizeof(T));
  else std::fill(d_state, d_state + KV, T(0));
  for (int64_t segment = num_segments - 1; segment >= 0; --segment) {
    const int64_t segment_start = segment * kKdaRecurrentSegment;
    const int64_t segment_end = std::min(T_len, segment_start + kKdaRecurrentSegment);
    std::memcpy(state, checkpoints + segment * KV, size_t(KV) * sizeof(T));
    for (int64_t t = segment_start; t < segment_end; ++t) {
      if (kda_token_starts_document(doc_start, b, T_len, t)) std::fill(state, state + KV, T(0));
      std::memcpy(segment_states + (t - segment_start) * KV, state, size_t(KV) * sizeof(T));
      advance(t);
    }
    for (int64_t t = segment_end - 1; t >= segment_start; --t) {
      const int64_t row = (b * T_len + t) * H + h;
      const T* q_t = q + row * K;
      const T* k_t = k + row * K;
      const T* g_t = g + row * K;
      const T* v_t = v + row * V;
      const T* d_o_t = d_o + row * V;
      const T beta_t = beta[row];
      const T query_inv_norm = kda_inverse_l2_norm(q_t, K);
      const T key_inv_norm = kda_inverse_l2_norm(k_t, K);
      for (int64_t d = 0; d < K; ++d) {
        query_hat[d] = scale * query_inv_norm * q_t[d];
        key_hat[d] = key_inv_norm * k_t[d];
      }
      // Recompute S', prediction, δ and S_t from the state before the token.
      const T* state_before = segment_states + (t - segment_start) * KV;
      std::fill(prediction, prediction + V, T(0));
      for (int64_t d = 0; d < K; ++d) {
        const T decay = std::exp(g_t[d]);
        for (int64_t e = 0; e < V; ++e) {
          state_decayed[d * V + e] = decay * state_before[d * V + e];
          prediction[e] += state_decayed[d * V + e] * key_hat[d];
        }
      }
      for (int64_t e = 0; e < V; ++e) delta[e] = beta_t * (v_t[e] - prediction[e]);
      for (int64_t d = 0; d < K; ++d)
        for (int64_t e = 0; e < V; ++e)
          state_updated[d * V + e] = state_decayed[d * V + e] + key_hat[d] * delta[e];

      // o_t = S_tᵀq̂: dS += q̂·doᵀ, dq̂ = S_t·do.
      for (int64_t d = 0; d < K; ++d) {
        T dot = 0;
        for (int64_t e = 0; e < V; ++e) {
          d_state[d * V + e] += query_hat[d] * d_o_t[e];
          dot += state_updated[d * V + e] * d_o_t[e];
        }
        d_query_hat[d] = dot;
      }
      // S_t = S' + k̂·δᵀ: dδ = dSᵀk̂, dk̂ = dS·δ.
      std::fill(d_delta, d_delta + V, T(0));
      for (int64_t d = 0; d < K; ++d) {
        T dot = 0;
        for (int64_t e = 0; e < V; ++e) {
          d_delta[e] += d_state[d * V + e] * key_hat[d];
          dot += d_state[d * V + e] * delta[e];
        }
        d_key_hat[d] = dot;
      }
      // δ = β(v − pred): dv = β·dδ, dβ = dδ·(v − pred), dpred = −β·dδ.
      T d_beta_t = 0;
      for (int64_t e = 0; e < V; ++e) {
        dv[row * V + e] += beta_t * d_delta[e];
        d_beta_t += d_delta[e] * (v_t[e] - prediction[e]);
        d_prediction[e] = -beta_t * d_delta[e];
      }
      dbeta[row] += d_beta_t;
      // pred = S'ᵀk̂: dS' = dS + k̂·dpredᵀ, dk̂ += S'·dpred. S' = Diag(e^g)S_{t−1}: dg = rowsum(dS'⊙S'),
      // dS_{t−1} = Diag(e^g)·dS'.
      for (int64_t d = 0; d < K; ++d) {
        const T decay = std::exp(g_t[d]);
        T dot = 0, d_gate = 0;
        for (int64_t e = 0; e < V; ++e) {
          dot += state_decayed[d * V + e] * d_prediction[e];
          const T d_state_decayed = d_state[d * V + e] + key_hat[d] * d_prediction[e];
          d_gate += d_state_decayed * state_decayed[d * V + e];
          d_state[d * V + e] = decay * d_state_decayed;
        }
        d_key_hat[d] += dot;
        dg[row * K + d] += d_gate;
      }
      // A document start cuts the dependence on the previous state (it was reset to zero).
      if (kda_token_starts_document(doc_start, b, T_len, t))
        std::fill(d_state, d_state + KV, T(0));
      kda_l2_norm_backward_row(q_t, query_inv_norm, scale, d_query_hat, dq + row * K, K);
      kda_l2_norm_backward_row(k_t, key_inv_norm, T(1), d_key_hat, dk + row * K, K);
    }
  }
  if (ds0_slice)
    for (int64_t i = 0; i < KV; ++i) ds0_slice[i] += d_state[i];
}

// ---------------------------------------------------------------------------------------------
// Chunked backward: pairwise helpers.

// out[i,:] += Σ_{j ≤ i} W[i,j] · Y[j,:] ⊙ e^{Γ_i − Γ_j}        W [c, c], zero above the diagonal.
// Inside a sub-block the exponent is pairwise; for rows of the block starting at r and columns
// j < r it factors through r (e^{Γ_i−Γ_r}·e^{Γ_r−Γ_j}, both ≤ 0) into one GEMM.
// ref_scratch [c, K], block_scratch [kKdaSubChunk, K].
template <typename T>
void kda_pairwise_rows_accumulate(int64_t c, int64_t K, const T* W, const T* Y, const T* gamma,
                                  T* out, T* ref_scratch, T* block_scratch) {
  for (int64_t block_start = 0; block_start < c; block_start += kKdaSubChunk) {
    const int64_t block_end = std::min(c, block_start + kKdaSubChunk);
    for (int64_t i = block_start; i < block_end; ++i) {
      const T* gamma_i = gamma + i * K;
      T* out_i = out + i * K;
      for (int64_t j = block_start; j <= i; ++j) {
        const T weight = W[i * c + j];
        if (weight == T(0)) continue;
        const T* gamma_j = gamma + j * K;
        const T* y_j = Y + j * K;
#pragma omp simd
        for (int64_t d = 0; d < K; ++d)
          out_i[d] += weight * y_j[d] * kda_exp(gamma_i[d] - gamma_j[d]);
      }
    }
    if (block_start == 0) continue;
    const T* gamma_ref = gamma + block_start * K;
    for (int64_t j = 0; j < block_start; ++j) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d)
        ref_scratch[j * K + d] = Y[j * K + d] * kda_exp(gamma_ref[d] - gamma[j * K + d]);
    }
    const int64_t block_len = block_end - block_start;
    gemm(false, false, block_len, K, block_start, T(1), W + block_start * c, c, ref_scratch, K,
         T(0), block_scratch, K);
    for (int64_t i = block_start; i < block_end; ++i) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d)
        out[i * K + d] +=
            block_scratch[(i - block_start) * K + d] * kda_exp(gamma[i * K + d] - gamma_ref[d]);
    }
  }
}

// out[j,:] += Σ_{i ≥ j} W[i,j] · X[i,:] ⊙ e^{Γ_i − Γ_j}        W [c, c], zero above the diagonal.
// For columns of the block [r, e) and later rows i ≥ e the factor splits through e
// (e^{Γ_i−Γ_e}·e^{Γ_e−Γ_j}, both ≤ 0) into one GEMM with Wᵀ.
template <typename T>
void kda_pairwise_cols_accumulate(int64_t c, int64_t K, const T* W, const T* X, const T* gamma,
                                  T* out, T* ref_scratch, T* block_scratch) {
  for (int64_t block_start = 0; block_start < c; block_start += kKdaSubChunk) {
    const int64_t block_end = std::min(c, block_start + kKdaSubChunk);
    for (int64_t j = block_start; j < block_end; ++j) {
      const T* gamma_j = gamma + j * K;
      T* out_j = out + j * K;
      for (int64_t i = j; i < block_end; ++i) {
        const T weight = W[i * c + j];
        if (weight == T(0)) continue;
        const T* gamma_i = gamma + i * K;
        const T* x_i = X + i * K;
#pragma omp simd
        for (int64_t d = 0; d < K; ++d)
          out_j[d] += weight * x_i[d] * kda_exp(gamma_i[d] - gamma_j[d]);
      }
    }
    if (block_end == c) continue;
    const T* gamma_ref = gamma + block_end * K;
    for (int64_t i = block_end; i < c; ++i) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d)
        ref_scratch[(i - block_end) * K + d] = X[i * K + d] * kda_exp(gamma[i * K + d] - gamma_ref[d]);
    }
    const int64_t block_len = block_end - block_start;
    // [block_len, K] = W[block_end:c, block_start:block_end]ᵀ · ref_scratch[c − block_end, K]
    gemm(true, false, block_len, K, c - block_end, T(1), W + block_end * c + block_start, c,
         ref_scratch, K, T(0), block_scratch, K);
    for (int64_t j = block_start; j < block_end; ++j) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d)
        out[j * K + d] +=
            block_scratch[(j - block_start) * K + d] * kda_exp(gamma_ref[d] - gamma[j * K + d]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Chunked backward: per-thread scratch. The same element counts size the workspace and carve it.
enum KdaBackwardBuffer : int {
  kBwdChunkStates,    // [num_chunks, K, V]  state at every chunk start (after a reset there)
  kBwdState,          // [K, V]  running state of the forward sweep
  kBwdDState,         // [K, V]  running gradient of the state
  kBwdQueryNorm,      // [C, K]  piece buffers (KdaPieceBuffers)
  kBwdKeyNorm,
  kBwdQueryInvNorm,   // [C]
  kBwdKeyInvNorm,     // [C]
  kBwdGammaCum,       // [C, K]
  kBwdQueryDecay,
  kBwdKeyDecay,
  kBwdKeyToEnd,
  kBwdValueResidual,  // [C, V]
  kBwdValueNew,       // [C, V]
  kBwdLowerKeyKey,    // [C, C]
  kBwdLowerQueryKey,  // [C, C]
  kBwdBeta,           // [C]
  kBwdGammaLast,      // [K]
  kBwdDQueryDecay,    // [C, K]  dQd, then dq̂
  kBwdDKeyDecay,      // [C, K]  dKd, then dk̂
  kBwdDKeyToEnd,      // [C, K]  dKe
  kBwdRowLower,       // [C, K]  Σ_j dL_ij k̂_j e^{Γ_i−Γ_j}
  kBwdColLower,       // [C, K]  Σ_i dL_ij k̂_i e^{Γ_i−Γ_j}
  kBwdRowQueryKey,    // [C, K]  Σ_j dP_ij k̂_j e^{Γ_i−Γ_j}
  kBwdColQueryKey,    // [C, K]  Σ_i dP_ij q̂_i e^{Γ_i−Γ_j}
  kBwdDValueNew,      // [C, V]  dV', then dR, then dX
  kBwdDLowerKeyKey,   // [C, C]  dR·V'ᵀ, then dL
  kBwdDLowerQueryKey, // [C, C]  dP
  kBwdDGammaLast,     // [K]     dγ, then the running reverse cumsum of dΓ
  kBwdKeyToEndPrefix, // [K]     Σ_{i<j} dKe_i⊙Ke_i (forward cumsum)
  kBwdDiagQueryKey,   // [C]     diagonal of dP
  kBwdPairRef,        // [C, K]  pairwise helper scratch
  kBwdPairBlock,      // [kKdaSubChunk, K]
  kNumKdaBackwardBuffers
};

std::array<int64_t, kNumKdaBackwardBuffers> kda_backward_buffer_elements(int64_t T_len, int64_t K,
                                                                         int64_t V, int64_t C) {
  std::array<int64_t, kNumKdaBackwardBuffers> n{};
  const int64_t num_chunks = (T_len + C - 1) / C;
  n[kBwdChunkStates] = std::max<int64_t>(1, num_chunks) * K * V;
  n[kBwdState] = n[kBwdDState] = K * V;
  for (int i : {kBwdQueryNorm, kBwdKeyNorm, kBwdGammaCum, kBwdQueryDecay, kBwdKeyDecay,
                kBwdKeyToEnd, kBwdDQueryDecay, kBwdDKeyDecay, kBwdDKeyToEnd, kBwdRowLower,
                kBwdColLower, kBwdRowQueryKey, kBwdColQueryKey, kBwdPairRef})
    n[i] = C * K;
  n[kBwdQueryInvNorm] = n[kBwdKeyInvNorm] = n[kBwdBeta] = n[kBwdDiagQueryKey] = C;
  n[kBwdValueResidual] = n[kBwdValueNew] = n[kBwdDValueNew] = C * V;
  n[kBwdLowerKeyKey] = n[kBwdLowerQueryKey] = n[kBwdDLowerKeyKey] = n[kBwdDLowerQueryKey] = C * C;
  n[kBwdGammaLast] = n[kBwdDGammaLast] = n[kBwdKeyToEndPrefix] = K;
  n[kBwdPairBlock] = kKdaSubChunk * K;
  return n;
}

template <typename T>
size_t kda_backward_per_thread_bytes(int64_t T_len, int64_t K, int64_t V, int64_t C) {
  return kda_scratch_bytes<T>(kda_backward_buffer_elements(T_len, K, V, C));
}

template <typename T>
std::array<T*, kNumKdaBackwardBuffers> kda_backward_carve_scratch(uint8_t* base, int64_t T_len,
                                                                  int64_t K, int64_t V,
                                                                  int64_t C) {
  return kda_scratch_carve<T>(base, kda_backward_buffer_elements(T_len, K, V, C));
}

template <typename T>
KdaPieceBuffers<T> kda_backward_piece_buffers(const std::array<T*, kNumKdaBackwardBuffers>& sc) {
  KdaPieceBuffers<T> buf;
  buf.query_norm = sc[kBwdQueryNorm];
  buf.key_norm = sc[kBwdKeyNorm];
  buf.query_inv_norm = sc[kBwdQueryInvNorm];
  buf.key_inv_norm = sc[kBwdKeyInvNorm];
  buf.gamma_cum = sc[kBwdGammaCum];
  buf.query_decay = sc[kBwdQueryDecay];
  buf.key_decay = sc[kBwdKeyDecay];
  buf.key_to_end = sc[kBwdKeyToEnd];
  buf.value_residual = sc[kBwdValueResidual];
  buf.value_new = sc[kBwdValueNew];
  buf.lower_key_key = sc[kBwdLowerKeyKey];
  buf.lower_query_key = sc[kBwdLowerQueryKey];
  buf.beta = sc[kBwdBeta];
  buf.gamma_last = sc[kBwdGammaLast];
  return buf;
}

// Backward of one piece of c tokens starting at `first_row`, after kda_piece_prepare from the
// piece's start state (state == nullptr: zero). d_state holds dS' (gradient of the state after
// the piece) on entry and the gradient of the start state on exit.
template <typename T>
void kda_piece_backward(const T* q, const T* k, const T* d_o, T* dq, T* dk, T* dv, T* dg,
                        T* dbeta, const KdaShape& s, int64_t first_row, int64_t c, T scale,
                        const T* state, T* d_state, const KdaPieceBuffers<T>& buf,
                        const std::array<T*, kNumKdaBackwardBuffers>& sc) {
  const int64_t H = s.H, K = s.K, V = s.V, HV = H * V;
  const T* d_o_piece = d_o + first_row * V;  // token i at + i·HV
  const T* beta_piece = buf.beta;
  const T* lower_key_key = buf.lower_key_key;
  const T* value_new = buf.value_new;
  T* d_query_decay = sc[kBwdDQueryDecay];
  T* d_key_decay = sc[kBwdDKeyDecay];
  T* d_key_to_end = sc[kBwdDKeyToEnd];
  T* d_value_new = sc[kBwdDValueNew];
  T* d_lower_key_key = sc[kBwdDLowerKeyKey];
  T* d_lower_query_key = sc[kBwdDLowerQueryKey];
  T* d_gamma_last = sc[kBwdDGammaLast];

  // 1. S_new = Diag(e^γ)·S + Keᵀ·V'.
  for (int64_t d = 0; d < K; ++d) {
    T dot = 0;
    if (state != nullptr) {
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < V; ++e) dot += state[d * V + e] * d_state[d * V + e];
    }
    d_gamma_last[d] = kda_exp(buf.gamma_last[d]) * dot;
  }
  gemm(false, true, c, K, V, T(1), value_new, V, d_state, V, T(0), d_key_to_end, K);
  gemm(false, false, c, V, K, T(1), buf.key_to_end, K, d_state, V, T(0), d_value_new, V);

  // 2. O = Qd·S + P·V'.
  gemm(true, false, c, V, c, T(1), buf.lower_query_key, c, d_o_piece, HV, T(1), d_value_new, V);
  if (state != nullptr)
    gemm(false, true, c, K, V, T(1), d_o_piece, HV, state, V, T(0), d_query_decay, K);
  else
    std::fill(d_query_decay, d_query_decay + c * K, T(0));
  gemm(false, true, c, c, V, T(1), d_o_piece, HV, value_new, V, T(0), d_lower_query_key, c);
  // P is lower triangular. Its diagonal (exponent 0) is kept apart: its two contributions to dΓ_i
  // cancel exactly, and leaving them in the sums would leave rounding noise of the size of
  // q̂·k̂ in dg where the true value can be ~e^{Σg} (strong decay).
  T* diag_query_key = sc[kBwdDiagQueryKey];
  for (int64_t i = 0; i < c; ++i) {
    diag_query_key[i] = d_lower_query_key[i * c + i];
    for (int64_t j = i; j < c; ++j) d_lower_query_key[i * c + j] = 0;
  }
  for (int64_t d = 0; d < K; ++d) {
    const T decay_whole_piece = kda_exp(buf.gamma_last[d]);
    for (int64_t e = 0; e < V; ++e) d_state[d * V + e] *= decay_whole_piece;
  }
  gemm(true, false, K, V, c, T(1), buf.query_decay, K, d_o_piece, HV, T(1), d_state, V);

  // 3. V' = M⁻¹R: solve Mᵀ·dR = dV' (unit upper triangular) by back substitution, in place.
  for (int64_t j = c - 2; j >= 0; --j) {
    T* row_j = d_value_new + j * V;
    for (int64_t i = j + 1; i < c; ++i) {
      const T coefficient = beta_piece[i] * lower_key_key[i * c + j];
      const T* row_i = d_value_new + i * V;
#pragma omp simd
      for (int64_t e = 0; e < V; ++e) row_j[e] -= coefficient * row_i[e];
    }
  }
  // dM = −dR·V'ᵀ on the strictly lower part: dL_ij = β_i·dM_ij, dβ_i += Σ_j L_ij·dM_ij.
  gemm(false, true, c, c, V, T(-1), d_value_new, V, value_new, V, T(0), d_lower_key_key, c);
  for (int64_t i = 0; i < c; ++i) {
    T d_beta_i = 0;
    for (int64_t j = 0; j < i; ++j) {
      d_beta_i += lower_key_key[i * c + j] * d_lower_key_key[i * c + j];
      d_lower_key_key[i * c + j] *= beta_piece[i];
    }
    for (int64_t j = i; j < c; ++j) d_lower_key_key[i * c + j] = 0;
    dbeta[first_row + i * H] += d_beta_i;
  }

  // 4. R = Diag(β)·X, X = V − Kd·S.
  for (int64_t i = 0; i < c; ++i) {
    T* d_row = d_value_new + i * V;
    const T* residual_row = buf.value_residual + i * V;
    T* dv_row = dv + (first_row + i * H) * V;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t e = 0; e < V; ++e) dot += d_row[e] * residual_row[e];
    dbeta[first_row + i * H] += dot;
#pragma omp simd
    for (int64_t e = 0; e < V; ++e) {
      d_row[e] *= beta_piece[i];  // now dX
      dv_row[e] += d_row[e];
    }
  }
  if (state != nullptr)
    gemm(false, true, c, K, V, T(-1), d_value_new, V, state, V, T(0), d_key_decay, K);
  else
    std::fill(d_key_decay, d_key_decay + c * K, T(0));
  gemm(true, false, K, V, c, T(-1), buf.key_decay, K, d_value_new, V, T(1), d_state, V);

  // 5. L and P through their pairwise exponents.
  T* row_lower = sc[kBwdRowLower];
  T* col_lower = sc[kBwdColLower];
  T* row_query_key = sc[kBwdRowQueryKey];
  T* col_query_key = sc[kBwdColQueryKey];
  for (T* p : {row_lower, col_lower, row_query_key, col_query_key}) std::fill(p, p + c * K, T(0));
  const T* gamma_cum = buf.gamma_cum;
  const T* key_norm = buf.key_norm;
  const T* query_norm = buf.query_norm;
  T* pair_ref = sc[kBwdPairRef];
  T* pair_block = sc[kBwdPairBlock];
  kda_pairwise_rows_accumulate(c, K, d_lower_key_key, key_norm, gamma_cum, row_lower, pair_ref,
                               pair_block);
  kda_pairwise_cols_accumulate(c, K, d_lower_key_key, key_norm, gamma_cum, col_lower, pair_ref,
                               pair_block);
  kda_pairwise_rows_accumulate(c, K, d_lower_query_key, key_norm, gamma_cum, row_query_key,
                               pair_ref, pair_block);
  kda_pairwise_cols_accumulate(c, K, d_lower_query_key, query_norm, gamma_cum, col_query_key,
                               pair_ref, pair_block);

  // 6. Qd, Kd, Ke → dq̂, dk̂, dΓ, dγ; dg_j = dγ + Σ_{i≥j} dΓ_i (Γ_i = Σ_{j≤i} g_j, γ = Γ_{c−1}).
  // Ke_i = k̂_i e^{γ−Γ_i} depends on g_j through γ − Γ_i = Σ_{i<j'≤c−1} g_j', i.e. only for i < j:
  // its term goes in as the forward cumsum Σ_{i<j} dKe_i⊙Ke_i rather than as +dγ and −dΓ_i,
  // which would cancel the O(1) term of the last token only up to rounding.
  T* key_to_end_prefix = sc[kBwdKeyToEndPrefix];
  std::fill(key_to_end_prefix, key_to_end_prefix + K, T(0));
  for (int64_t i = 0; i < c; ++i) {
    T* dg_row = dg + (first_row + i * H) * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      dg_row[d] += key_to_end_prefix[d];
      key_to_end_prefix[d] += d_key_to_end[i * K + d] * buf.key_to_end[i * K + d];
    }
  }
  T* running = d_gamma_last;
  for (int64_t i = c - 1; i >= 0; --i) {
    const int64_t row = first_row + i * H;
    T* dg_row = dg + row * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const int64_t at = i * K + d;
      const T gamma = gamma_cum[at];
      const T decay_from_start = kda_exp(gamma);
      const T decay_to_end = kda_exp(buf.gamma_last[d] - gamma);
      const T d_gamma = d_query_decay[at] * buf.query_decay[at] +
                        d_key_decay[at] * buf.key_decay[at] +
                        key_norm[at] * (row_lower[at] - col_lower[at] - col_query_key[at]) +
                        query_norm[at] * row_query_key[at];
      running[d] += d_gamma;
      dg_row[d] += running[d];
      // dq̂, dk̂ (the diagonal of dP enters here only)
      d_query_decay[at] = d_query_decay[at] * decay_from_start + row_query_key[at] +
                          diag_query_key[i] * key_norm[at];
      d_key_decay[at] = d_key_decay[at] * decay_from_start + d_key_to_end[at] * decay_to_end +
                        row_lower[at] + col_lower[at] + col_query_key[at] +
                        diag_query_key[i] * query_norm[at];
    }
    kda_l2_norm_backward_row(q + row * K, buf.query_inv_norm[i], scale, d_query_decay + i * K,
                             dq + row * K, K);
    kda_l2_norm_backward_row(k + row * K, buf.key_inv_norm[i], T(1), d_key_decay + i * K,
                             dk + row * K, K);
  }
}

// One (b, h): forward sweep storing chunk-start states, then chunks and their pieces backwards.
template <typename T>
void kda_chunk_backward_one_head(const T* q, const T* k, const T* v, const T* g, const T* beta,
                                 const T* s0_slice, const T* d_o, const T* dsT_slice, T* dq,
                                 T* dk, T* dv, T* dg, T* dbeta, T* ds0_slice, const KdaShape& s,
                                 int64_t b, int64_t h, T scale, int64_t C,
                                 const int32_t* doc_start,
                                 const std::array<T*, kNumKdaBackwardBuffers>& sc) {
  const int64_t T_len = s.T, K = s.K, V = s.V, KV = K * V;
  const KdaPieceBuffers<T> buf = kda_backward_piece_buffers<T>(sc);
  T* chunk_states = sc[kBwdChunkStates];
  T* state = sc[kBwdState];
  T* d_state = sc[kBwdDState];
  const int64_t num_chunks = (T_len + C - 1) / C;

  if (s0_slice) std::memcpy(state, s0_slice, size_t(KV) * sizeof(T));
  else std::fill(state, state + KV, T(0));
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t chunk_start = chunk * C, chunk_end = std::min(T_len, chunk_start + C);
    for (int64_t piece_start = chunk_start; piece_start < chunk_end;) {
      const int64_t piece_end = kda_piece_end(doc_start, b, T_len, piece_start, chunk_end);
      if (kda_token_starts_document(doc_start, b, T_len, piece_start))
        std::fill(state, state + KV, T(0));
      if (piece_start == chunk_start)
        std::memcpy(chunk_states + chunk * KV, state, size_t(KV) * sizeof(T));
      kda_piece_prepare(q, k, v, g, beta, s, b, h, piece_start, piece_end - piece_start, scale,
                        state, buf);
      kda_piece_finish_forward<T>(s, (b * T_len + piece_start) * s.H + h,
                                  piece_end - piece_start, nullptr, state, buf);
      piece_start = piece_end;
    }
  }

  if (dsT_slice) std::memcpy(d_state, dsT_slice, size_t(KV) * sizeof(T));
  else std::fill(d_state, d_state + KV, T(0));
  for (int64_t chunk = num_chunks - 1; chunk >= 0; --chunk) {
    const int64_t chunk_start = chunk * C, chunk_end = std::min(T_len, chunk_start + C);
    for (int64_t piece_end = chunk_end; piece_end > chunk_start;) {
      // The last piece before piece_end begins at the last document start after chunk_start.
      int64_t piece_start = piece_end - 1;
      while (piece_start > chunk_start &&
             !kda_token_starts_document(doc_start, b, T_len, piece_start))
        --piece_start;
      // A piece inside the chunk begins at a document start, i.e. from the zero state.
      const T* piece_state = piece_start == chunk_start ? chunk_states + chunk * KV : nullptr;
      const int64_t c = piece_end - piece_start;
      kda_piece_prepare(q, k, v, g, beta, s, b, h, piece_start, c, scale, piece_state, buf);
      kda_piece_backward(q, k, d_o, dq, dk, dv, dg, dbeta, s, (b * T_len + piece_start) * s.H + h,
                         c, scale, piece_state, d_state, buf, sc);
      if (kda_token_starts_document(doc_start, b, T_len, piece_start))
        std::fill(d_state, d_state + KV, T(0));
      piece_end = piece_start;
    }
  }
  if (ds0_slice)
    for (int64_t i = 0; i < KV; ++i) ds0_slice[i] += d_state[i];
}

}  // namespace

// ---------------------------------------------------------------------------------------------
template <typename T>
void kda_recurrent_backward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                            const T* s0, const T* d_o, const T* dsT, T* dq, T* dk, T* dv, T* dg,
                            T* dbeta, T* ds0, const KdaShape& s, T scale,
                            const int32_t* doc_start) {
  kda_check_shape(s, "kda_recurrent_backward");
  kda_check_doc_start(doc_start, s.B, s.T, "kda_recurrent_backward");
  const int64_t num_heads_total = s.B * s.H, K = s.K, V = s.V, KV = K * V;
  if (num_heads_total == 0 || s.T == 0) {
    if (ds0 && dsT)  // no tokens: sT = s0
      for (int64_t i = 0; i < num_heads_total * KV; ++i) ds0[i] += dsT[i];
    return;
  }
  const int thread_count = kda_thread_count(s);
  const int64_t num_segments = (s.T + kKdaRecurrentSegment - 1) / kKdaRecurrentSegment;
  const size_t work_elements =
      size_t((num_segments + kKdaRecurrentSegment + 4) * KV + 4 * K + 4 * V);

#pragma omp parallel num_threads(thread_count) if (thread_count > 1)
  {
    std::vector<T> work(work_elements);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < num_heads_total; ++bh) {
      kda_recurrent_backward_one_head(q, k, v, g, beta, s0 ? s0 + bh * KV : nullptr, d_o,
                                      dsT ? dsT + bh * KV : nullptr, dq, dk, dv, dg, dbeta,
                                      ds0 ? ds0 + bh * KV : nullptr, s, bh / s.H, bh % s.H,
                                      scale, doc_start, work);
    }
  }
}

template <typename T>
size_t kda_chunk_backward_workspace_bytes(const KdaShape& s, int chunk) {
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total == 0 || s.T == 0) return 0;
  return kda_backward_per_thread_bytes<T>(s.T, s.K, s.V, chunk) * size_t(kda_thread_count(s));
}

template <typename T>
void kda_chunk_backward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                        const T* s0, const T* d_o, const T* dsT, T* dq, T* dk, T* dv, T* dg,
                        T* dbeta, T* ds0, const KdaShape& s, T scale, int chunk, Arena& ws,
                        const int32_t* doc_start) {
  kda_check_shape(s, "kda_chunk_backward");
  kda_check_doc_start(doc_start, s.B, s.T, "kda_chunk_backward");
  kda_check_chunk(chunk, "kda_chunk_backward");
  const int64_t num_heads_total = s.B * s.H, K = s.K, V = s.V, KV = K * V, C = chunk;
  if (num_heads_total == 0 || s.T == 0) {
    if (ds0 && dsT)  // no tokens: sT = s0
      for (int64_t i = 0; i < num_heads_total * KV; ++i) ds0[i] += dsT[i];
    return;
  }

  ArenaScope scope(ws);
  const KdaThreadSlices slices = kda_carve_thread_slices(
      ws, kda_backward_per_thread_bytes<T>(s.T, K, V, C), kda_thread_count(s),
      "kda_chunk_backward", "kda_chunk_backward_workspace_bytes");
  const size_t per_thread_bytes = slices.per_thread;
  const int thread_count = slices.threads;
  uint8_t* scratch_base = slices.base;
  BlasSingleThreadScope blas_single_thread(thread_count > 1);

#pragma omp parallel num_threads(thread_count) if (thread_count > 1)
  {
    const int thread_index = dm::thread_index();
    const auto scratch = kda_backward_carve_scratch<T>(
        scratch_base + size_t(thread_index) * per_thread_bytes, s.T, K, V, C);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < num_heads_total; ++bh) {
      kda_chunk_backward_one_head(q, k, v, g, beta, s0 ? s0 + bh * KV : nullptr, d_o,
                                  dsT ? dsT + bh * KV : nullptr, dq, dk, dv, dg, dbeta,
                                  ds0 ? ds0 + bh * KV : nullptr, s, bh / s.H, bh % s.H, scale, C,
                                  doc_start, scratch);
    }
  }
}

#define DM_KDA_BACKWARD_INSTANTIATE(T)                                                          \
  template void kda_recurrent_backward<T>(const T*, const T*, const T*, const T*, const T*,     \
                                          const T*, const T*, const T*, T*, T*, T*, T*, T*, T*, \
                                          const KdaShape&, T, const int32_t*);                  \
  template void kda_chunk_backward<T>(const T*, const T*, const T*, const T*, const T*,         \
                                      const T*, const T*, const T*, T*, T*, T*, T*, T*, T*,     \
                                      const KdaShape&, T, int, Arena&, const int32_t*);         \
  template size_t kda_chunk_backward_workspace_bytes<T>(const KdaShape&, int);
DM_KDA_BACKWARD_INSTANTIATE(float)
DM_KDA_BACKWARD_INSTANTIATE(double)
#undef DM_KDA_BACKWARD_INSTANTIATE

}  // namespace dm
