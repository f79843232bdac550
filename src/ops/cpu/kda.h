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
//
// Packed documents: `doc_start` (optional, [B·T], docs/backward.md) gives for each token the
// index within its row of the first token of its document. The state is reset to zero before
// every token t > 0 with doc_start[b·T + t] == t. s0 is the state before token 0 of each row and
// sT the state after the last token of the row (i.e. the last document's final state).
//
// Backward (of the scalar Σ o·do + Σ sT·dsT): dq, dk are with respect to the raw (pre-L2-norm)
// q, k. Every gradient is accumulated (+=) into its output. dsT == nullptr means dsT = 0;
// ds0 == nullptr means the initial-state gradient is not wanted (s0 == nullptr is a zero state,
// and its gradient is still well defined if ds0 is given).
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
                           const T* s0, T* o, T* sT, const KdaShape& s, T scale,
                           const int32_t* doc_start = nullptr);

// Chunked (WY / UT-transform) form, chunk ∈ {16, 32, 64}; T need not be a multiple of chunk.
// Every exponent that is formed is ≤ 0 (pairwise factoring; e^{-Γ} never materialised).
// Scratch comes from `ws` (released on return); size it with kda_chunk_workspace_bytes (one slice
// per thread; a smaller arena runs on fewer threads, and one too small for a single slice throws
// dm::Error). chunk outside {16, 32, 64} throws dm::Error.
template <typename T>
void kda_chunk_forward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                       const T* s0, T* o, T* sT, const KdaShape& s, T scale, int chunk, Arena& ws,
                       const int32_t* doc_start = nullptr);
// Bytes kda_chunk_forward takes from `ws` with the current thread count (dm::num_threads()).
template <typename T>
size_t kda_chunk_workspace_bytes(const KdaShape& s, int chunk);

// Backpropagation through time over the recurrent definition (reference for the chunked
// backward). Keeps one state per 64 tokens and recomputes the states in between; its scratch is
// heap memory of about (T/64 + 64)·K·V per thread, allocated once per call.
// d_o [B,T,H,V], dsT [B,H,K,V] (nullable); dq, dk, dg [B,T,H,K], dv [B,T,H,V], dbeta [B,T,H],
// ds0 [B,H,K,V] (nullable). All gradients accumulate.
template <typename T>
void kda_recurrent_backward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                            const T* s0, const T* d_o, const T* dsT, T* dq, T* dk, T* dv, T* dg,
                            T* dbeta, T* ds0, const KdaShape& s, T scale,
                            const int32_t* doc_start = nullptr);

// Backward of the chunked form: a forward sweep stores the state at every chunk start (one K×V
// state per chunk, per (b, h) in flight), then chunks are walked backwards, each recomputing its
// forward quantities from its start state. Every exponent formed is ≤ 0, as in the forward.
// Parallel over B·H; scratch from `ws` sized by kda_chunk_backward_workspace_bytes (depends on T).
template <typename T>
void kda_chunk_backward(const T* q, const T* k, const T* v, const T* g, const T* beta,
                        const T* s0, const T* d_o, const T* dsT, T* dq, T* dk, T* dv, T* dg,
                        T* dbeta, T* ds0, const KdaShape& s, T scale, int chunk, Arena& ws,
                        const int32_t* doc_start = nullptr);
// Bytes kda_chunk_backward takes from `ws` with the current thread count.
template <typename T>
size_t kda_chunk_backward_workspace_bytes(const KdaShape& s, int chunk);

}  // namespace dm
