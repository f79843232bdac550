// Kimi Delta Attention forward on CPU (SPEC §1.1): the recurrent definition (reference and decode
// path) and the chunked WY / UT-transform form (prefill and training). The backward of both lives
// in kda_backward.cpp; what they share is in kda_internal.h.
//
// Layout (row-major): q, k, g [B,T,H,K]; v, o [B,T,H,V]; beta [B,T,H]; s0, sT [B,H,K,V].
// Row index of token t of head h in batch b: row = (b·T + t)·H + h, so q_t = q + row·K.
//
// Chunked form, per piece of c ≤ C tokens (a chunk, or the part of a chunk inside one document)
// with Γ = inclusive in-piece cumsum of g (Γ ≤ 0, non-increasing in i) and γ = Γ_{c−1}:
//   L_ij = β_i Σ_d k_id k_jd e^{Γ_id−Γ_jd}  (j<i)        P_ij = Σ_d q_id k_jd e^{Γ_id−Γ_jd}  (j≤i)
//   V'   = (I+L)⁻¹ · Diag(β) · (V − (K⊙e^Γ)·S)          ( = U − W·S of the SPEC, fused: one
//                                                          forward substitution over V columns
//                                                          instead of over K+V columns )
//   O    = (Q⊙e^Γ)·S + P·V'
//   S   ← Diag(e^γ)·S + (K⊙e^{γ−Γ})ᵀ·V'
// Every exponent formed is ≤ 0: Γ_i, γ−Γ_i, Γ_i−Γ_j (j≤i) are sums of g over a token range.
// e^{−Γ} would overflow once the decay of a chunk exceeds ~88 (f32) and is never formed.
#include "ops/cpu/kda.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/kda_internal.h"

namespace dm {
namespace kda_detail {
namespace {

// Builds the intra-chunk products of one chunk of c tokens (all matrices with leading dim c):
//   lower_key_key[i,j]   = Σ_d k_id k_jd e^{Γ_id−Γ_jd}  for j < i, 0 elsewhere
//   lower_query_key[i,j] = Σ_d q_id k_jd e^{Γ_id−Γ_jd}  for j ≤ i, 0 elsewhere
// Inside a sub-block of kKdaSubChunk tokens the exponent Γ_id−Γ_jd is formed pairwise. For a
// row block starting at token r and an earlier column j < r the factor splits through r:
//   e^{Γ_id−Γ_jd} = e^{Γ_id−Γ_rd} · e^{Γ_rd−Γ_jd},  both exponents ≤ 0 since j < r ≤ i,
// which turns the block into one GEMM. With sub-block size s the pairwise part costs c·s·K/2
// exp-dots instead of c²K/2, the reference part about c²K/(2s) exps.
// rows_query_ref, rows_key_ref: [kKdaSubChunk, K] scratch; cols_key_ref: [c, K] scratch.
template <typename T>
void kda_chunk_intra_products(int64_t c, int64_t K, const T* query_norm, const T* key_norm,
                              const T* gamma_cum, T* lower_key_key, T* lower_query_key,
                              T* rows_query_ref, T* rows_key_ref, T* cols_key_ref) {
  std::fill(lower_key_key, lower_key_key + c * c, T(0));
  std::fill(lower_query_key, lower_query_key + c * c, T(0));
  for (int64_t block_start = 0; block_start < c; block_start += kKdaSubChunk) {
    const int64_t block_len = std::min(kKdaSubChunk, c - block_start);
    // Diagonal sub-block: pairwise exponents Γ_i − Γ_j ≤ 0 for j ≤ i.
    for (int64_t i = block_start; i < block_start + block_len; ++i) {
      const T* gamma_i = gamma_cum + i * K;
      const T* query_i = query_norm + i * K;
      const T* key_i = key_norm + i * K;
      for (int64_t j = block_start; j <= i; ++j) {
        const T* gamma_j = gamma_cum + j * K;
        const T* key_j = key_norm + j * K;
        T dot_key_key = 0, dot_query_key = 0;
#pragma omp simd reduction(+ : dot_key_key, dot_query_key)
        for (int64_t d = 0; d < K; ++d) {
          const T key_j_decayed = key_j[d] * kda_exp(gamma_i[d] - gamma_j[d]);
          dot_key_key += key_i[d] * key_j_decayed;
          dot_query_key += query_i[d] * key_j_decayed;
        }
        lower_query_key[i * c + j] = dot_query_key;
        if (j < i) lower_key_key[i * c + j] = dot_key_key;
      }
    }
    if (block_start == 0) continue;
    // Rows [block_start, +block_len) against all earlier columns [0, block_start), factored
    // through the reference token r = block_start.
    const T* gamma_ref = gamma_cum + block_start * K;
    for (int64_t i = 0; i < block_len; ++i) {
      const T* gamma_i = gamma_cum + (block_start + i) * K;
      for (int64_t d = 0; d < K; ++d) {
        const T decay_from_ref = kda_exp(gamma_i[d] - gamma_ref[d]);
        rows_query_ref[i * K + d] = query_norm[(block_start + i) * K + d] * decay_from_ref;
        rows_key_ref[i * K + d] = key_norm[(block_start + i) * K + d] * decay_from_ref;
      }
    }
    for (int64_t j = 0; j < block_start; ++j) {
      const T* gamma_j = gamma_cum + j * K;
      for (int64_t d = 0; d < K; ++d)
        cols_key_ref[j * K + d] = key_norm[j * K + d] * kda_exp(gamma_ref[d] - gamma_j[d]);
    }
    // [block_len, K] · [block_start, K]ᵀ → rows block_start.. of the c×c matrices.
    gemm(false, true, block_len, block_start, K, T(1), rows_query_ref, K, cols_key_ref, K, T(0),
         lower_query_key + block_start * c, c);
    gemm(false, true, block_len, block_start, K, T(1), rows_key_ref, K, cols_key_ref, K, T(0),
         lower_key_key + block_start * c, c);
  }
}

}  // namespace

template <typename T>
void kda_piece_prepare(const T* q, const T* k, const T* v, const T* g, const T* beta,
                       const KdaShape& s, int64_t b, int64_t h, int64_t piece_start, int64_t c,
                       T scale, const T* state, const KdaPieceBuffers<T>& buf) {
  const int64_t T_len = s.T, H = s.H, K = s.K, V = s.V;
  const int64_t first_row = (b * T_len + piece_start) * H + h;
  T* query_norm = buf.query_norm;
  T* key_norm = buf.key_norm;
  T* gamma_cum = buf.gamma_cum;
  T* value_new = buf.value_new;
  T* beta_piece = buf.beta;

  // Gather the piece: normalise q, k; cumulative log-decay Γ; β.
  for (int64_t i = 0; i < c; ++i) {
    const int64_t row = first_row + i * H;
    const T* q_row = q + row * K;
    const T* k_row = k + row * K;
    const T* g_row = g + row * K;
    const T query_inv_norm = kda_inverse_l2_norm(q_row, K);
    const T key_inv_norm = kda_inverse_l2_norm(k_row, K);
    if (buf.query_inv_norm) buf.query_inv_norm[i] = query_inv_norm;
    if (buf.key_inv_norm) buf.key_inv_norm[i] = key_inv_norm;
    const T query_factor = scale * query_inv_norm;
    // Row i of Γ adds g_i to row i−1 (the first row of a piece starts from 0).
    const T* gamma_prev = i == 0 ? nullptr : gamma_cum + (i - 1) * K;
    T* gamma_row = gamma_cum + i * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      query_norm[i * K + d] = q_row[d] * query_factor;
      key_norm[i * K + d] = k_row[d] * key_inv_norm;
      gamma_row[d] = g_row[d];
    }
    if (gamma_prev != nullptr) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) gamma_row[d] += gamma_prev[d];
    }
    beta_piece[i] = beta[row];
  }
  std::memcpy(buf.gamma_last, gamma_cum + (c - 1) * K, size_t(K) * sizeof(T));

  // L (without β) and P. The decay buffers are free until the next step: use as scratch.
  kda_chunk_intra_products(c, K, query_norm, key_norm, gamma_cum, buf.lower_key_key,
                           buf.lower_query_key, buf.query_decay, buf.key_decay, buf.key_to_end);

  // Q⊙e^Γ, K⊙e^Γ, K⊙e^{γ−Γ}: all exponents ≤ 0.
  const T* gamma_last = buf.gamma_last;
  for (int64_t i = 0; i < c; ++i) {
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const T gamma = gamma_cum[i * K + d];
      const T decay_from_start = kda_exp(gamma);
      buf.query_decay[i * K + d] = query_norm[i * K + d] * decay_from_start;
      buf.key_decay[i * K + d] = key_norm[i * K + d] * decay_from_start;
      buf.key_to_end[i * K + d] = key_norm[i * K + d] * kda_exp(gamma_last[d] - gamma);
    }
  }

  // value_new[c,V] = Diag(β)·(V − (K⊙e^Γ)[c,K]·S[K,V]); the backward also keeps the residual
  // before the β scaling (dividing by β afterwards would fail at β = 0).
  for (int64_t i = 0; i < c; ++i)
    std::memcpy(value_new + i * V, v + (first_row + i * H) * V, size_t(V) * sizeof(T));
  if (state != nullptr)
    gemm(false, false, c, V, K, T(-1), buf.key_decay, K, state, V, T(1), value_new, V);
  if (buf.value_residual)
    std::memcpy(buf.value_residual, value_new, size_t(c * V) * sizeof(T));
  for (int64_t i = 0; i < c; ++i)
    for (int64_t e = 0; e < V; ++e) value_new[i * V + e] *= beta_piece[i];

  // (I + Diag(β)·L)·V' = value_new by forward substitution, in place, row by row.
  const T* lower_key_key = buf.lower_key_key;
  for (int64_t i = 1; i < c; ++i) {
    T* row_i = value_new + i * V;
    for (int64_t j = 0; j < i; ++j) {
      const T coefficient = beta_piece[i] * lower_key_key[i * c + j];
      const T* row_j = value_new + j * V;
      for (int64_t e = 0; e < V; ++e) row_i[e] -= coefficient * row_j[e];
    }
  }
}

template <typename T>
void kda_piece_finish_forward(const KdaShape& s, int64_t first_row, int64_t c, T* o, T* state,
                              const KdaPieceBuffers<T>& buf) {
  const int64_t H = s.H, K = s.K, V = s.V;
  if (o != nullptr) {
    // O[c,V] = (Q⊙e^Γ)[c,K]·S[K,V] + P[c,c]·V'[c,V], written straight into o (row stride H·V).
    T* o_piece = o + first_row * V;
    gemm(false, false, c, V, K, T(1), buf.query_decay, K, state, V, T(0), o_piece, H * V);
    gemm(false, false, c, V, c, T(1), buf.lower_query_key, c, buf.value_new, V, T(1), o_piece,
         H * V);
  }
  // S[K,V] ← Diag(e^γ)·S + (K⊙e^{γ−Γ})ᵀ[K,c]·V'[c,V]
  for (int64_t d = 0; d < K; ++d) {
    const T decay_whole_piece = kda_exp(buf.gamma_last[d]);
    for (int64_t e = 0; e < V; ++e) state[d * V + e] *= decay_whole_piece;
  }
  gemm(true, false, K, V, c, T(1), buf.key_to_end, K, buf.value_new, V, T(1), state, V);
}

#define DM_KDA_PIECE_INSTANTIATE(T)                                                             \
  template void kda_piece_prepare<T>(const T*, const T*, const T*, const T*, const T*,          \
                                     const KdaShape&, int64_t, int64_t, int64_t, int64_t, T,    \
                                     const T*, const KdaPieceBuffers<T>&);                      \
  template void kda_piece_finish_forward<T>(const KdaShape&, int64_t, int64_t, T*, T*,          \
                                            const KdaPieceBuffers<T>&);
DM_KDA_PIECE_INSTANTIATE(float)
DM_KDA_PIECE_INSTANTIATE(double)
#undef DM_KDA_PIECE_INSTANTIATE

}  // namespace kda_detail

namespace {
using namespace kda_detail;

// ---------------------------------------------------------------------------------------------
// Per-thread scratch of the chunked forward. The same element counts size the workspace and
// carve it, so kda_chunk_workspace_bytes and kda_chunk_forward cannot disagree.
enum KdaChunkBuffer : int {
  kBufState,        // [K, V]  running state S of this (b, h)
  kBufQueryNorm,    // [C, K]  q̂ · scale of the piece
  kBufKeyNorm,      // [C, K]  k̂ of the piece
  kBufGammaCum,     // [C, K]  Γ, inclusive in-piece cumsum of g
  kBufQueryDecay,   // [C, K]  Q⊙e^Γ       (earlier in the piece: sub-block rows of Q vs reference)
  kBufKeyDecay,     // [C, K]  K⊙e^Γ       (earlier: sub-block rows of K vs reference)
  kBufKeyToEnd,     // [C, K]  K⊙e^{γ−Γ}   (earlier: earlier-token columns of K vs reference)
  kBufValueNew,     // [C, V]  Diag(β)(V − (K⊙e^Γ)S), then V' after the forward substitution
  kBufLowerKeyKey,  // [C, C]  L without the β_i row factor (strictly lower)
  kBufLowerQueryKey,// [C, C]  P (lower, diagonal included)
  kBufBeta,         // [C]
  kBufGammaLast,    // [K]     γ = Γ of the last token of the piece
  kNumKdaChunkBuffers
};

std::array<int64_t, kNumKdaChunkBuffers> kda_chunk_buffer_elements(int64_t K, int64_t V,
                                                                   int64_t C) {
  std::array<int64_t, kNumKdaChunkBuffers> n{};
  n[kBufState] = K * V;
  n[kBufQueryNorm] = n[kBufKeyNorm] = n[kBufGammaCum] = C * K;
  n[kBufQueryDecay] = n[kBufKeyDecay] = n[kBufKeyToEnd] = C * K;
  n[kBufValueNew] = C * V;
  n[kBufLowerKeyKey] = n[kBufLowerQueryKey] = C * C;
  n[kBufBeta] = C;
  n[kBufGammaLast] = K;
  return n;
}

template <typename T>
size_t kda_chunk_per_thread_bytes(int64_t K, int64_t V, int64_t C) {
  return kda_scratch_bytes<T>(kda_chunk_buffer_elements(K, V, C));
}

// Carves one thread's scratch out of `base` (64-byte aligned, kda_chunk_per_thread_bytes long).
template <typename T>
std::array<T*, kNumKdaChunkBuffers> kda_chunk_carve_scratch(uint8_t* base, int64_t K, int64_t V,
                                                            int64_t C) {
  return kda_scratch_carve<T>(base, kda_chunk_buffer_elements(K, V, C));
}

// The piece view of the forward scratch (no inverse norms or residual: the forward needs none).
template <typename T>
KdaPieceBuffers<T> kda_forward_piece_buffers(const std::array<T*, kNumKdaChunkBuffers>& scratch) {
  KdaPieceBuffers<T> buf;
  buf.query_norm = scratch[kBufQueryNorm];
  buf.key_norm = scratch[kBufKeyNorm];
  buf.gamma_cum = scratch[kBufGammaCum];
  buf.query_decay = scratch[kBufQueryDecay];
  buf.key_decay = scratch[kBufKeyDecay];
  buf.key_to_end = scratch[kBufKeyToEnd];
  buf.value_new = scratch[kBufValueNew];
  buf.lower_key_key = scratch[kBufLowerKeyKey];
  buf.lower_query_key = scratch[kBufLowerQueryKey];
  buf.beta = scratch[kBufBeta];
  buf.gamma_last = scratch[kBufGammaLast];
  return buf;
}

// One (b, h) through all chunks. `state` holds the initial state on entry, the final on exit.
// A chunk that contains document starts is processed as several pieces, each starting at a
// chunk start or at a document start (then from the zero state).
template <typename T>
void kda_chunk_forward_one_head(const T* q, const T* k, const T* v, const T* g, const T* beta,
                                T* o, const KdaShape& s, int64_t b, int64_t h, T scale,
                                int64_t C, const int32_t* doc_start, T* state,
                                const KdaPieceBuffers<T>& buf) {
  const int64_t T_len = s.T, K = s.K, V = s.V;
  for (int64_t chunk_start = 0; chunk_start < T_len; chunk_start += C) {
    const int64_t chunk_end = std::min(T_len, chunk_start + C);  // last chunk may be partial
    for (int64_t piece_start = chunk_start; piece_start < chunk_end;) {
      const int64_t piece_end = kda_piece_end(doc_start, b, T_len, piece_start, chunk_end);
      if (kda_token_starts_document(doc_start, b, T_len, piece_start))
        std::fill(state, state + K * V, T(0));
      kda_piece_prepare(q, k, v, g, beta, s, b, h, piece_start, piece_end - piece_start, scale,
                        state, buf);
      kda_piece_finish_forward(s, (b * T_len + piece_start) * s.H + h, piece_end - piece_start,
                               o, state, buf);
      piece_start = piece_end;
    }
  }
}

// state[K·V] ← s0 slice, or zeros when there is no initial state. s0 may alias state (in-place
// decode: s0 == sT), in which case there is nothing to copy.
template <typename T>
void kda_load_initial_state(const T* s0_slice, T* state, int64_t n) {
  if (s0_slice == nullptr) std::fill(state, state + n, T(0));
  else if (s0_slice != state) std::memcpy(state, s0_slice, size_t(n) * sizeof(T));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
template <typename T>
void kda_recurrent_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* s0, T* o, T* sT, const KdaShape& s, T scale,
                           const int32_t* doc_start) {
  kda_check_shape(s, "kda_recurrent_forward");
  kda_check_doc_start(doc_start, s.B, s.T, "kda_recurrent_forward");
  const int64_t T_len = s.T, H = s.H, K = s.K, V = s.V;
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total == 0) return;
  const int thread_count = kda_thread_count(s);

#pragma omp parallel num_threads(thread_count) if (thread_count > 1)
  {
    // Per-thread, allocated once per call: the state lives in sT when the caller wants it.
    std::vector<T> private_state(sT ? size_t(0) : size_t(K * V));
    std::vector<T> value_delta(static_cast<size_t>(V));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < num_heads_total; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      T* state = sT ? sT + bh * K * V : private_state.data();
      kda_load_initial_state(s0 ? s0 + bh * K * V : nullptr, state, K * V);
      for (int64_t t = 0; t < T_len; ++t) {
        if (kda_token_starts_document(doc_start, b, T_len, t))
          std::fill(state, state + K * V, T(0));
        const int64_t row = (b * T_len + t) * H + h;
        const T* q_t = q + row * K;
        const T* k_t = k + row * K;
        const T* g_t = g + row * K;
        const T* v_t = v + row * V;
        const T beta_t = beta[row];
        T* o_t = o + row * V;
        const T key_factor = kda_inverse_l2_norm(k_t, K);
        const T query_factor = scale * kda_inverse_l2_norm(q_t, K);

        // Pass 1: S ← Diag(e^g)·S, and the prediction Sᵀk̂ (accumulated in value_delta).
        std::fill(value_delta.begin(), value_delta.end(), T(0));
        for (int64_t d = 0; d < K; ++d) {
          const T decay = std::exp(g_t[d]);
          const T key_d = k_t[d] * key_factor;
          T* state_row = state + d * V;
          for (int64_t e = 0; e < V; ++e) {
            state_row[e] *= decay;
            value_delta[e] += state_row[e] * key_d;
          }
        }
        for (int64_t e = 0; e < V; ++e) value_delta[e] = beta_t * (v_t[e] - value_delta[e]);
        // Pass 2: S ← S + k̂·δᵀ, and o_t = Sᵀ(scale·q̂) with the updated S.
        std::fill(o_t, o_t + V, T(0));
        for (int64_t d = 0; d < K; ++d) {
          const T key_d = k_t[d] * key_factor;
          const T query_d = q_t[d] * query_factor;
          T* state_row = state + d * V;
          for (int64_t e = 0; e < V; ++e) {
            state_row[e] += key_d * value_delta[e];
            o_t[e] += state_row[e] * query_d;
          }
        }
      }
    }
  }
}

template <typename T>
size_t kda_chunk_workspace_bytes(const KdaShape& s, int chunk) {
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total == 0) return 0;
  return kda_chunk_per_thread_bytes<T>(s.K, s.V, chunk) * size_t(kda_thread_count(s));
}

template <typename T>
void kda_chunk_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                       const T* s0, T* o, T* sT, const KdaShape& s, T scale, int chunk,
                       Arena& ws, const int32_t* doc_start) {
  kda_check_shape(s, "kda_chunk_forward");
  kda_check_doc_start(doc_start, s.B, s.T, "kda_chunk_forward");
  kda_check_chunk(chunk, "kda_chunk_forward");
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total == 0) return;
  const int64_t K = s.K, V = s.V, C = chunk;

  // One scratch slice per thread, carved up front; fewer threads if the arena is smaller than
  // kda_chunk_workspace_bytes asked for (e.g. sized before the thread count changed).
  ArenaScope scope(ws);
  const KdaThreadSlices slices =
      kda_carve_thread_slices(ws, kda_chunk_per_thread_bytes<T>(K, V, C), kda_thread_count(s),
                              "kda_chunk_forward", "kda_chunk_workspace_bytes");
  const size_t per_thread_bytes = slices.per_thread;
  const int thread_count = slices.threads;
  uint8_t* scratch_base = slices.base;
  // With a single (b, h) BLAS may keep its own threads: there is no team to compete with.
  BlasSingleThreadScope blas_single_thread(thread_count > 1);

#pragma omp parallel num_threads(thread_count) if (thread_count > 1)
  {
    const int thread_index = dm::thread_index();
    const auto scratch = kda_chunk_carve_scratch<T>(
        scratch_base + size_t(thread_index) * per_thread_bytes, K, V, C);
    const KdaPieceBuffers<T> buf = kda_forward_piece_buffers<T>(scratch);
    T* state = scratch[kBufState];
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < num_heads_total; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      kda_load_initial_state(s0 ? s0 + bh * K * V : nullptr, state, K * V);
      kda_chunk_forward_one_head(q, k, v, g, beta, o, s, b, h, scale, C, doc_start, state, buf);
      if (sT) std::memcpy(sT + bh * K * V, state, size_t(K * V) * sizeof(T));
    }
  }
}

#define DM_KDA_INSTANTIATE(T)                                                                    \
  template void kda_recurrent_forward<T>(const T*, const T*, const T*, const T*, const T*,       \
                                         const T*, T*, T*, const KdaShape&, T, const int32_t*);  \
  template void kda_chunk_forward<T>(const T*, const T*, const T*, const T*, const T*, const T*, \
                                     T*, T*, const KdaShape&, T, int, Arena&, const int32_t*);   \
  template size_t kda_chunk_workspace_bytes<T>(const KdaShape&, int);
DM_KDA_INSTANTIATE(float)
DM_KDA_INSTANTIATE(double)
#undef DM_KDA_INSTANTIATE

}  // namespace dm
