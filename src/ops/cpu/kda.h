// Kimi Delta Attention operator and its helpers (CPU). SPEC §1.1.
//
// Operator layout (row-major, same as ../shared/goldens/kda_op_*.safetensors):
//   q, k, g : [B, T, H, K]     v : [B, T, H, V]     beta : [B, T, H]
//   s0, sT  : [B, H, K, V]     o : [B, T, H, V]
// Semantics: q, k are L2-normalised inside (z / sqrt(Σz² + 1e-6)), q is scaled by `scale`
// (K^-1/2 by default); per token S ← Diag(exp g_t)·S; S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ; o_t = Sᵀ q_t.
// s0 == nullptr means a zero initial state; sT == nullptr means the final state is not wanted.
// s0 may equal sT (state carried in place between decode calls); otherwise buffers don't overlap.
// g is the log-decay and must be ≤ 0 (exponents formed are then ≤ 0, so nothing overflows).
// `seq_starts` (optional, may be nullptr) marks document boundaries for packed sequences: a
// sorted list of token offsets t within [0,T) where the state resets to zero (0 implied).
// Not implemented by the functions below (no seq_starts argument): callers split packed
// sequences themselves.
#pragma once
#include <cstdint>

#include "core/arena.h"

namespace dm {

struct KdaShape {
  int64_t B = 1, T = 0, H = 1, K = 0, V = 0;
};

// Reference: one token at a time (the definition). Also the decode path.
template <typename T>
void kda_recurrent_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* s0, T* o, T* sT, const KdaShape& s, T scale);

// Chunked (WY / UT-transform) form, chunk ∈ {16, 32, 64}; T need not be a multiple of chunk.
// Every exponent that is formed is ≤ 0 (pairwise factoring; e^{-Γ} never materialised).
// Scratch comes from `ws` (released on return); size it with kda_chunk_workspace_bytes (one slice
// per thread; a smaller arena runs on fewer threads, and one too small for a single slice throws
// dm::Error). chunk outside {16, 32, 64} throws dm::Error.
template <typename T>
void kda_chunk_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                       const T* s0, T* o, T* sT, const KdaShape& s, T scale, int chunk, Arena& ws);
// Bytes kda_chunk_forward takes from `ws` with the current thread count (dm::num_threads()).
template <typename T>
size_t kda_chunk_workspace_bytes(const KdaShape& s, int chunk);

}  // namespace dm
