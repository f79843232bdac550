// Internals shared by the KDA forward (kda.cpp) and backward (kda_backward.cpp). Not a public
// interface: include ops/cpu/kda.h instead.
//
// A "piece" is the unit of work of the chunked form: a run of c ≤ C consecutive tokens of one
// (b, h) that lies inside one chunk [m·C, (m+1)·C) and inside one document. Without doc_start a
// piece is a whole chunk; a document start inside a chunk splits it into two pieces, and the
// piece that begins at a document start begins from the zero state. Chunk boundaries stay at
// multiples of C, so the backward can keep one state per chunk: every piece starts either at a
// chunk start (its state is the stored one) or at a document start (its state is zero).
#pragma once
#include "core/fastmath.h"
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/kda.h"

namespace dm::kda_detail {

// Under the square root of the L2 norm of q and k (SPEC §1.1: z / sqrt(Σ z² + 1e-6)).
constexpr double kKdaL2NormEps = 1e-6;
// Intra-chunk products are built in sub-blocks of this many tokens: pairs inside one sub-block
// use pairwise exponents (an exp per pair and channel); pairs across sub-blocks factor through
// a reference token (an exp per token and channel, then one GEMM). Smaller sub-blocks trade
// pairwise exps for reference exps and smaller GEMMs; 4 measured fastest at C = 64,
// K = V = 128 (16 was ~1.5x slower overall).
constexpr int64_t kKdaSubChunk = 4;
// Below this many multiply-adds of state work (B·H·T·K·V) one thread does the whole call: a
// parallel region costs microseconds idle and whole scheduler ticks on a busy machine, which
// dominated small decode steps and tests.
constexpr int64_t kKdaMinParallelWork = int64_t(1) << 18;

// exp that vectorises: see core/fastmath.h.
template <typename Real>
inline Real kda_exp(Real x) {
  return fast_exp(x);
}

// One scratch slice per thread carved from `ws` (inside the caller's ArenaScope): fewer threads
// than `wanted` when the arena has less room than the sizing function asked for (e.g. sized
// before the thread count changed); none at all is an error naming `who` and the sizer.
struct KdaThreadSlices {
  uint8_t* base = nullptr;
  size_t per_thread = 0;
  int threads = 0;
};
inline KdaThreadSlices kda_carve_thread_slices(Arena& ws, size_t per_thread, int wanted,
                                               const char* who, const char* sizer) {
  const size_t free_bytes = ws.capacity() - ws.used();
  KdaThreadSlices t;
  t.per_thread = per_thread;
  t.threads = int(std::min<size_t>(size_t(wanted), free_bytes / per_thread));
  DM_CHECK(t.threads >= 1, who, ": workspace arena '", ws.name(), "' has ", free_bytes,
           " bytes free, needs at least ", per_thread, " (size it with ", sizer, ")");
  t.base = static_cast<uint8_t*>(ws.alloc_bytes(per_thread * size_t(t.threads)));
  return t;
}

// A thread's scratch is a fixed list of buffers of `elements[i]` values each, 64-byte aligned,
// laid out back to back; the forward and the backward each have their own list.
template <typename T, size_t N>
size_t kda_scratch_bytes(const std::array<int64_t, N>& elements) {
  SizeCounter counter;
  for (int64_t n : elements) counter.add<T>(size_t(n));
  return counter.bytes;
}
template <typename T, size_t N>
std::array<T*, N> kda_scratch_carve(uint8_t* base, const std::array<int64_t, N>& elements) {
  std::array<T*, N> scratch{};
  size_t offset = 0;
  for (size_t i = 0; i < N; ++i) {
    scratch[i] = reinterpret_cast<T*>(base + offset);
    offset += Arena::round_up(size_t(elements[i]) * sizeof(T));
  }
  return scratch;
}

inline void kda_check_shape(const KdaShape& s, const char* who) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.K > 0 && s.V > 0, who, ": bad shape B=", s.B,
           " T=", s.T, " H=", s.H, " K=", s.K, " V=", s.V);
}

inline void kda_check_chunk(int chunk, const char* who) {
  DM_CHECK(chunk == 16 || chunk == 32 || chunk == 64, who, ": chunk must be 16, 32 or 64, got ",
           chunk);
}

// 1 / sqrt(Σ z² + eps) over n contiguous elements.
template <typename T>
T kda_inverse_l2_norm(const T* z, int64_t n) {
  T sum_squares = 0;
#pragma omp simd reduction(+ : sum_squares)
  for (int64_t i = 0; i < n; ++i) sum_squares += z[i] * z[i];
  return T(1) / std::sqrt(sum_squares + T(kKdaL2NormEps));
}

// Threads for a call: one (b, h) per thread at most, and serial for small problems.
inline int kda_thread_count(const KdaShape& s) {
  const int64_t num_heads_total = s.B * s.H;
  if (num_heads_total <= 1 || num_heads_total * s.T * s.K * s.V < kKdaMinParallelWork) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), num_heads_total)));
}

// True when token t (> 0) of batch row b begins a new document: the state before it is reset to
// zero. Token 0 never resets (its state is s0). doc_start == nullptr: one document per row.
inline bool kda_token_starts_document(const int32_t* doc_start, int64_t b, int64_t T_len,
                                      int64_t t) {
  return doc_start != nullptr && t > 0 && doc_start[b * T_len + t] == t;
}

// doc_start must describe documents: doc_start[0] = 0 and, for t > 0, either t (a new document)
// or doc_start[t−1] (the same one). Anything else would silently make the forms disagree.
inline void kda_check_doc_start(const int32_t* doc_start, int64_t B, int64_t T_len,
                                const char* who) {
  if (doc_start == nullptr) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_len; ++t) {
      const int32_t start = doc_start[b * T_len + t];
      const bool valid = t == 0 ? start == 0
                                : start == t || start == doc_start[b * T_len + t - 1];
      DM_CHECK(valid, who, ": doc_start[", b, ", ", t, "] = ", start,
               " is neither ", t, " nor the previous token's document start");
    }
}

// End (exclusive) of the piece that begins at piece_start inside the chunk ending at chunk_end:
// the next document start, or the chunk end.
inline int64_t kda_piece_end(const int32_t* doc_start, int64_t b, int64_t T_len,
                             int64_t piece_start, int64_t chunk_end) {
  int64_t piece_end = piece_start + 1;
  while (piece_end < chunk_end && !kda_token_starts_document(doc_start, b, T_len, piece_end))
    ++piece_end;
  return piece_end;
}

// Forward quantities of one piece of c tokens (row-major, leading dimension K, V or c).
template <typename T>
struct KdaPieceBuffers {
  T* query_norm = nullptr;       // [C, K]  q̂·scale
  T* key_norm = nullptr;         // [C, K]  k̂
  T* query_inv_norm = nullptr;   // [C]     1/sqrt(Σq² + eps) (backward only; may be nullptr)
  T* key_inv_norm = nullptr;     // [C]     1/sqrt(Σk² + eps) (backward only; may be nullptr)
  T* gamma_cum = nullptr;        // [C, K]  Γ, inclusive in-piece cumsum of g
  T* query_decay = nullptr;      // [C, K]  Q⊙e^Γ       (scratch while the products are built)
  T* key_decay = nullptr;        // [C, K]  K⊙e^Γ       (scratch while the products are built)
  T* key_to_end = nullptr;       // [C, K]  K⊙e^{γ−Γ}   (scratch while the products are built)
  T* value_residual = nullptr;   // [C, V]  V − (K⊙e^Γ)·S (backward only; may be nullptr)
  T* value_new = nullptr;        // [C, V]  V' = (I + Diag(β)L)⁻¹ Diag(β) (V − (K⊙e^Γ)·S)
  T* lower_key_key = nullptr;    // [c, c]  L without the β_i row factor (strictly lower)
  T* lower_query_key = nullptr;  // [c, c]  P (lower, diagonal included)
  T* beta = nullptr;             // [C]
  T* gamma_last = nullptr;       // [K]     γ = Γ of the last token of the piece
};

// Gathers the piece [piece_start, piece_start + c) of head (b, h) and builds everything up to V'
// from the state S [K, V] at its start (state == nullptr: zero state).
template <typename T>
void kda_piece_prepare(const T* q, const T* k, const T* v, const T* g, const T* beta,
                       const KdaShape& s, int64_t b, int64_t h, int64_t piece_start, int64_t c,
                       T scale, const T* state, const KdaPieceBuffers<T>& buf);

// After kda_piece_prepare: writes o for the piece (o == nullptr: skipped) and advances the
// state in place to the state after the piece.
template <typename T>
void kda_piece_finish_forward(const KdaShape& s, int64_t first_row, int64_t c, T* o, T* state,
                              const KdaPieceBuffers<T>& buf);

}  // namespace dm::kda_detail
