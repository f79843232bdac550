// Kimi Delta Attention forward on CPU (SPEC §1.1): the recurrent definition (reference and decode
// path) and the chunked WY / UT-transform form (prefill and training).
//
// Layout (row-major): q, k, g [B,T,H,K]; v, o [B,T,H,V]; beta [B,T,H]; s0, sT [B,H,K,V].
// Row index of token t of head h in batch b: row = (b·T + t)·H + h, so q_t = q + row·K.
//
// Chunked form, per chunk of c ≤ C tokens with Γ = inclusive in-chunk cumsum of g (Γ ≤ 0,
// non-increasing in i) and γ = Γ_{c−1}:
//   L_ij = β_i Σ_d k_id k_jd e^{Γ_id−Γ_jd}  (j<i)        P_ij = Σ_d q_id k_jd e^{Γ_id−Γ_jd}  (j≤i)
//   V'   = (I+L)⁻¹ · Diag(β) · (V − (K⊙e^Γ)·S)          ( = U − W·S of the SPEC, fused: one
//                                                          forward substitution over V columns
//                                                          instead of over K+V columns )
//   O    = (Q⊙e^Γ)·S + P·V'
//   S   ← Diag(e^γ)·S + (K⊙e^{γ−Γ})ᵀ·V'
// Every exponent formed is ≤ 0: Γ_i, γ−Γ_i, Γ_i−Γ_j (j≤i) are sums of g over a token range.
// e^{−Γ} would overflow once the decay of a chunk exceeds ~88 (f32) and is never formed.
#include "ops/cpu/kda.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/error.h"
#include "core/gemm.h"

namespace dm {
namespace {

// Under the square root of the L2 norm of q and k (SPEC §1.1: z / sqrt(Σz² + 1e-6)).
constexpr double kKdaL2NormEps = 1e-6;
// Intra-chunk products are built in sub-blocks of this many tokens: pairs inside one sub-block
// use pairwise exponents (an exp per pair and channel); pairs across sub-blocks factor through
// a reference token (an exp per token and channel, then one GEMM). Smaller sub-blocks trade
// pairwise exps for reference exps and smaller GEMMs; 4 measured fastest at C = 64,
// K = V = 128 (16 was ~1.5x slower overall).
constexpr int64_t kKdaSubChunk = 4;

// exp(x) that GCC vectorises without -ffast-math (libm's exp is a call and blocks it; the chunked
// form spends most of its non-GEMM time in exp). Cody–Waite reduction x = n·ln2 + r, Taylor
// polynomial in r, then ·2ⁿ by building the exponent bits. Within ~1 ulp of std::exp for
// |x| ≤ 87 (float) / 708 (double); x below −limit returns 0 (true value is below the normal
// range), x above +limit is clamped (never happens here: every exponent formed is ≤ 0).
// Clamping and the underflow test are integer mask arithmetic, no compares: GCC does not
// if-convert a float compare-and-select under the default -ftrapping-math, and even integer
// selects stayed branches inside the larger loops here, which kept those loops scalar.
inline float kda_exp(float x) {
  const int32_t x_bits = std::bit_cast<int32_t>(x);
  const int32_t sign_bit = x_bits & int32_t(0x80000000u);
  const int32_t magnitude_bits = x_bits & 0x7fffffff;
  const int32_t limit_bits = std::bit_cast<int32_t>(87.0f);
  // All-ones masks from arithmetic shifts (C++20: >> of a negative value is arithmetic).
  const int32_t excess_bits = magnitude_bits - limit_bits;  // > 0: |x| beyond the limit
  const int32_t within_limit_mask = excess_bits >> 31;
  const int32_t negative_mask = x_bits >> 31;
  const float x_clamped =
      std::bit_cast<float>(sign_bit | (limit_bits + (excess_bits & within_limit_mask)));
  // Adding 1.5·2²³ rounds x·log2(e) to an integer n and leaves n in the low mantissa bits.
  const float shifter = 0x1.8p23f;
  const float shifted = x_clamped * 1.44269504f + shifter;
  const float n = shifted - shifter;
  const float r = (x_clamped - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 = hi + lo
  float poly = 1.f / 5040.f;
  poly = poly * r + 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  const int32_t underflow_mask = negative_mask & ~within_limit_mask;
  const int32_t two_to_n_bits =
      ((std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(shifter) + 127) << 23) &
      ~underflow_mask;
  return poly * std::bit_cast<float>(two_to_n_bits);
}

inline double kda_exp(double x) {
  const int64_t x_bits = std::bit_cast<int64_t>(x);
  const int64_t sign_bit = x_bits & int64_t(0x8000000000000000ull);
  const int64_t magnitude_bits = x_bits & int64_t(0x7fffffffffffffffll);
  const int64_t limit_bits = std::bit_cast<int64_t>(708.0);
  const int64_t excess_bits = magnitude_bits - limit_bits;
  const int64_t within_limit_mask = excess_bits >> 63;
  const int64_t negative_mask = x_bits >> 63;
  const double x_clamped =
      std::bit_cast<double>(sign_bit | (limit_bits + (excess_bits & within_limit_mask)));
  const double shifter = 0x1.8p52;
  const double shifted = x_clamped * 1.4426950408889634 + shifter;
  const double n = shifted - shifter;
  const double r = (x_clamped - n * 0x1.62e42fefa39efp-1) - n * 0x1.abc9e3b39803fp-56;
  // Taylor to r¹³: |r| ≤ ln2/2 leaves a truncation error below 1e-17.
  double poly = 1.0 / 6227020800.0;
  poly = poly * r + 1.0 / 479001600.0;
  poly = poly * r + 1.0 / 39916800.0;
  poly = poly * r + 1.0 / 3628800.0;
  poly = poly * r + 1.0 / 362880.0;
  poly = poly * r + 1.0 / 40320.0;
  poly = poly * r + 1.0 / 5040.0;
  poly = poly * r + 1.0 / 720.0;
  poly = poly * r + 1.0 / 120.0;
  poly = poly * r + 1.0 / 24.0;
  poly = poly * r + 1.0 / 6.0;
  poly = poly * r + 0.5;
  poly = poly * r + 1.0;
  poly = poly * r + 1.0;
  const int64_t underflow_mask = negative_mask & ~within_limit_mask;
  const int64_t two_to_n_bits =
      ((std::bit_cast<int64_t>(shifted) - std::bit_cast<int64_t>(shifter) + 1023) << 52) &
      ~underflow_mask;
  return poly * std::bit_cast<double>(two_to_n_bits);
}

void kda_check_shape(const KdaShape& s, const char* who) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.K > 0 && s.V > 0, who, ": bad shape B=", s.B,
           " T=", s.T, " H=", s.H, " K=", s.K, " V=", s.V);
}

// 1 / sqrt(Σ z² + eps) over n contiguous elements.
template <typename T>
T kda_inverse_l2_norm(const T* z, int64_t n) {
  T sum_squares = 0;
#pragma omp simd reduction(+ : sum_squares)
  for (int64_t i = 0; i < n; ++i) sum_squares += z[i] * z[i];
  return T(1) / std::sqrt(sum_squares + T(kKdaL2NormEps));
}

// state[K·V] ← s0 slice, or zeros when there is no initial state. s0 may alias state (in-place
// decode: s0 == sT), in which case there is nothing to copy.
template <typename T>
void kda_load_initial_state(const T* s0_slice, T* state, int64_t n) {
  if (s0_slice == nullptr) std::fill(state, state + n, T(0));
  else if (s0_slice != state) std::memcpy(state, s0_slice, size_t(n) * sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// Per-thread scratch of the chunked form. The same element counts size the workspace and carve
// it, so kda_chunk_workspace_bytes and kda_chunk_forward cannot disagree.
enum KdaChunkBuffer : int {
  kBufState,        // [K, V]  running state S of this (b, h)
  kBufQueryNorm,    // [C, K]  q̂ · scale of the chunk
  kBufKeyNorm,      // [C, K]  k̂ of the chunk
  kBufGammaCum,     // [C, K]  Γ, inclusive in-chunk cumsum of g
  kBufQueryDecay,   // [C, K]  Q⊙e^Γ       (earlier in the chunk: sub-block rows of Q vs reference)
  kBufKeyDecay,     // [C, K]  K⊙e^Γ       (earlier: sub-block rows of K vs reference)
  kBufKeyToEnd,     // [C, K]  K⊙e^{γ−Γ}   (earlier: earlier-token columns of K vs reference)
  kBufValueNew,     // [C, V]  Diag(β)(V − (K⊙e^Γ)S), then V' after the forward substitution
  kBufLowerKeyKey,  // [C, C]  L without the β_i row factor (strictly lower)
  kBufLowerQueryKey,// [C, C]  P (lower, diagonal included)
  kBufBeta,         // [C]
  kBufGammaLast,    // [K]     γ = Γ of the last token of the chunk
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
  SizeCounter counter;
  for (int64_t n : kda_chunk_buffer_elements(K, V, C)) counter.add<T>(size_t(n));
  return counter.bytes;
}

template <typename T>
struct KdaChunkScratch {
  std::array<T*, kNumKdaChunkBuffers> buf{};
  T* operator[](int i) const { return buf[i]; }
};

// Carves one thread's scratch out of `base` (64-byte aligned, kda_chunk_per_thread_bytes long).
template <typename T>
KdaChunkScratch<T> kda_chunk_carve_scratch(uint8_t* base, int64_t K, int64_t V, int64_t C) {
  KdaChunkScratch<T> scratch;
  size_t offset = 0;
  const auto elements = kda_chunk_buffer_elements(K, V, C);
  for (int i = 0; i < kNumKdaChunkBuffers; ++i) {
    scratch.buf[i] = reinterpret_cast<T*>(base + offset);
    offset += Arena::round_up(size_t(elements[i]) * sizeof(T));
  }
  return scratch;
}

// Below this many multiply-adds of state work (B·H·T·K·V) one thread does the whole call: a
// parallel region costs microseconds idle and whole scheduler ticks on a busy machine, which
// dominated small decode steps and tests.
constexpr int64_t kKdaMinParallelWork = int64_t(1) << 18;

// Threads for a call: one (b, h) per thread at most, and serial for small problems.
int kda_thread_count(const KdaShape& s) {
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total <= 1 || num_heads_total * s.T * s.K * s.V < kKdaMinParallelWork) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), num_heads_total)));
}

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

// One (b, h) through all chunks. `state` holds the initial state on entry, the final on exit.
template <typename T>
void kda_chunk_forward_one_head(const T* q, const T* k, const T* v, const T* g, const T* beta,
                                T* o, const KdaShape& s, int64_t b, int64_t h, T scale,
                                int64_t C, const KdaChunkScratch<T>& scratch) {
  const int64_t T_len = s.T, H = s.H, K = s.K, V = s.V;
  T* state = scratch[kBufState];
  T* query_norm = scratch[kBufQueryNorm];
  T* key_norm = scratch[kBufKeyNorm];
  T* gamma_cum = scratch[kBufGammaCum];
  T* query_decay = scratch[kBufQueryDecay];
  T* key_decay = scratch[kBufKeyDecay];
  T* key_to_end = scratch[kBufKeyToEnd];
  T* value_new = scratch[kBufValueNew];
  T* lower_key_key = scratch[kBufLowerKeyKey];
  T* lower_query_key = scratch[kBufLowerQueryKey];
  T* beta_chunk = scratch[kBufBeta];
  T* gamma_last = scratch[kBufGammaLast];

  for (int64_t chunk_start = 0; chunk_start < T_len; chunk_start += C) {
    const int64_t c = std::min(C, T_len - chunk_start);  // last chunk may be partial
    const int64_t first_row = (b * T_len + chunk_start) * H + h;

    // Gather the chunk: normalise q, k; cumulative log-decay Γ; β.
    for (int64_t i = 0; i < c; ++i) {
      const int64_t row = first_row + i * H;
      const T* q_row = q + row * K;
      const T* k_row = k + row * K;
      const T* g_row = g + row * K;
      const T query_factor = scale * kda_inverse_l2_norm(q_row, K);
      const T key_factor = kda_inverse_l2_norm(k_row, K);
      // Row i of Γ adds g_i to row i−1 (the first row of a chunk starts from 0).
      const T* gamma_prev = i == 0 ? nullptr : gamma_cum + (i - 1) * K;
      T* gamma_row = gamma_cum + i * K;
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) {
        query_norm[i * K + d] = q_row[d] * query_factor;
        key_norm[i * K + d] = k_row[d] * key_factor;
        gamma_row[d] = g_row[d];
      }
      if (gamma_prev != nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) gamma_row[d] += gamma_prev[d];
      }
      beta_chunk[i] = beta[row];
    }
    std::memcpy(gamma_last, gamma_cum + (c - 1) * K, size_t(K) * sizeof(T));

    // L (without β) and P. The decay buffers are free until the next step: use as scratch.
    kda_chunk_intra_products(c, K, query_norm, key_norm, gamma_cum, lower_key_key,
                             lower_query_key, query_decay, key_decay, key_to_end);

    // Q⊙e^Γ, K⊙e^Γ, K⊙e^{γ−Γ}: all exponents ≤ 0.
    for (int64_t i = 0; i < c; ++i) {
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) {
        const T gamma = gamma_cum[i * K + d];
        const T decay_from_start = kda_exp(gamma);
        query_decay[i * K + d] = query_norm[i * K + d] * decay_from_start;
        key_decay[i * K + d] = key_norm[i * K + d] * decay_from_start;
        key_to_end[i * K + d] = key_norm[i * K + d] * kda_exp(gamma_last[d] - gamma);
      }
    }

    // value_new[c,V] = Diag(β)·(V − (K⊙e^Γ)[c,K]·S[K,V])
    for (int64_t i = 0; i < c; ++i)
      std::memcpy(value_new + i * V, v + (first_row + i * H) * V, size_t(V) * sizeof(T));
    gemm(false, false, c, V, K, T(-1), key_decay, K, state, V, T(1), value_new, V);
    for (int64_t i = 0; i < c; ++i)
      for (int64_t e = 0; e < V; ++e) value_new[i * V + e] *= beta_chunk[i];

    // (I + Diag(β)·L)·V' = value_new by forward substitution, in place, row by row.
    for (int64_t i = 1; i < c; ++i) {
      T* row_i = value_new + i * V;
      for (int64_t j = 0; j < i; ++j) {
        const T coefficient = beta_chunk[i] * lower_key_key[i * c + j];
        const T* row_j = value_new + j * V;
        for (int64_t e = 0; e < V; ++e) row_i[e] -= coefficient * row_j[e];
      }
    }

    // O[c,V] = (Q⊙e^Γ)[c,K]·S[K,V] + P[c,c]·V'[c,V], written straight into o (row stride H·V).
    T* o_chunk = o + first_row * V;
    gemm(false, false, c, V, K, T(1), query_decay, K, state, V, T(0), o_chunk, H * V);
    gemm(false, false, c, V, c, T(1), lower_query_key, c, value_new, V, T(1), o_chunk, H * V);

    // S[K,V] ← Diag(e^γ)·S + (K⊙e^{γ−Γ})ᵀ[K,c]·V'[c,V]
    for (int64_t d = 0; d < K; ++d) {
      const T decay_whole_chunk = kda_exp(gamma_last[d]);
      for (int64_t e = 0; e < V; ++e) state[d * V + e] *= decay_whole_chunk;
    }
    gemm(true, false, K, V, c, T(1), key_to_end, K, value_new, V, T(1), state, V);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
template <typename T>
void kda_recurrent_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* s0, T* o, T* sT, const KdaShape& s, T scale) {
  kda_check_shape(s, "kda_recurrent_forward");
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
                       Arena& ws) {
  kda_check_shape(s, "kda_chunk_forward");
  DM_CHECK(chunk == 16 || chunk == 32 || chunk == 64,
           "kda_chunk_forward: chunk must be 16, 32 or 64, got ", chunk);
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total == 0) return;
  const int64_t K = s.K, V = s.V, C = chunk;

  // One scratch slice per thread, carved up front; fewer threads if the arena is smaller than
  // kda_chunk_workspace_bytes asked for (e.g. sized before the thread count changed).
  ArenaScope scope(ws);
  const size_t per_thread_bytes = kda_chunk_per_thread_bytes<T>(K, V, C);
  const size_t free_bytes = ws.capacity() - ws.used();
  const int thread_count =
      int(std::min<size_t>(size_t(kda_thread_count(s)), free_bytes / per_thread_bytes));
  DM_CHECK(thread_count >= 1, "kda_chunk_forward: workspace arena '", ws.name(), "' has ",
           free_bytes, " bytes free, needs at least ", per_thread_bytes,
           " (size it with kda_chunk_workspace_bytes)");
  uint8_t* scratch_base =
      static_cast<uint8_t*>(ws.alloc_bytes(per_thread_bytes * size_t(thread_count)));
  // With a single (b, h) BLAS may keep its own threads: there is no team to compete with.
  BlasSingleThreadScope blas_single_thread(thread_count > 1);

#pragma omp parallel num_threads(thread_count) if (thread_count > 1)
  {
#ifdef _OPENMP
    const int thread_index = omp_get_thread_num();
#else
    const int thread_index = 0;
#endif
    const KdaChunkScratch<T> scratch =
        kda_chunk_carve_scratch<T>(scratch_base + size_t(thread_index) * per_thread_bytes, K, V, C);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < num_heads_total; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      kda_load_initial_state(s0 ? s0 + bh * K * V : nullptr, scratch[kBufState], K * V);
      kda_chunk_forward_one_head(q, k, v, g, beta, o, s, b, h, scale, C, scratch);
      if (sT) std::memcpy(sT + bh * K * V, scratch[kBufState], size_t(K * V) * sizeof(T));
    }
  }
}

#define DM_KDA_INSTANTIATE(T)                                                                    \
  template void kda_recurrent_forward<T>(const T*, const T*, const T*, const T*, const T*,       \
                                         const T*, T*, T*, const KdaShape&, T);                  \
  template void kda_chunk_forward<T>(const T*, const T*, const T*, const T*, const T*, const T*, \
                                     T*, T*, const KdaShape&, T, int, Arena&);                   \
  template size_t kda_chunk_workspace_bytes<T>(const KdaShape&, int);
DM_KDA_INSTANTIATE(float)
DM_KDA_INSTANTIATE(double)
#undef DM_KDA_INSTANTIATE

}  // namespace dm
