// Causal softmax attention for MLA prefill/training (expanded form), CPU. SPEC §1.2.
//   q : [B, T, H, Dqk]   k : [B, T, H, Dqk]   v : [B, T, H, Dv]   o : [B, T, H, Dv]
//   lse (optional) : [B, H, T]  log-sum-exp of the scaled scores per query row (for backward)
//   doc_start (optional) : [B, T]  packed documents (docs/backward.md): query t sees keys j with
//                          doc_start[t] ≤ j ≤ t; nullptr = each row is one document.
// Templated on the scalar (float for the engine, double for reference checks; explicit
// instantiations for both). Pointer parameters that callers commonly pass as nullptr are
// `std::type_identity_t<Real>*` so a literal nullptr does not break template deduction.
//
// attention_causal_forward is flash-style: key blocks of `block` rows, online softmax, no T×T
// buffer. attention_causal_backward is FlashAttention-2 style (recomputes P tile by tile from the
// lse the forward saved). The *_reference functions form full score rows/matrices in double
// (tests only).
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/arena.h"

namespace dm {

struct AttnShape {
  int64_t B = 1, T = 0, H = 1, Dqk = 0, Dv = 0;
};

// Checks 0 ≤ doc_start[b·T + t] ≤ t for every token (throws dm::Error naming the first bad one).
// nullptr is accepted (one document per row).
void attention_check_doc_start(const int32_t* doc_start, int64_t B, int64_t T);

template <typename Real>
void attention_causal_forward(const Real* q, const Real* k, const Real* v, Real* o,
                              std::type_identity_t<Real>* lse, const AttnShape& s, double scale,
                              Arena& ws, int block = 64, const int32_t* doc_start = nullptr);
// Bytes attention_causal_forward takes from `ws` (released on return) at the current
// num_threads(): one slice per thread of scores [block, block], accumulator [block, Dv],
// running max and running sum [block]. real_bytes = sizeof(Real).
size_t attention_causal_workspace_bytes(const AttnShape& s, int block = 64,
                                        size_t real_bytes = sizeof(float));

// Gradients of o (given dout [B,T,H,Dv]) with respect to q, k, v; they ACCUMULATE into
// dq [B,T,H,Dqk], dk [B,T,H,Dqk], dv [B,T,H,Dv] (callers zero them). o and lse are the forward's
// outputs for the same inputs, block and doc_start (any block works; lse is block-independent).
// Deterministic: the result does not depend on the thread count (every gradient row is summed in
// a fixed order of tiles).
template <typename Real>
void attention_causal_backward(const Real* q, const Real* k, const Real* v, const Real* o,
                               const Real* lse, const Real* dout, Real* dq, Real* dk, Real* dv,
                               const AttnShape& s, double scale, Arena& ws, int block = 64,
                               const int32_t* doc_start = nullptr);
// Bytes attention_causal_backward takes from `ws` (released on return): Δ [B,H,T] plus per thread
// the probability and dP tiles [block, block].
size_t attention_causal_backward_workspace_bytes(const AttnShape& s, int block = 64,
                                                 size_t real_bytes = sizeof(float));

// References (tests only): full score rows in double, outputs cast to Real.
template <typename Real>
void attention_causal_reference(const Real* q, const Real* k, const Real* v, Real* o,
                                const AttnShape& s, double scale,
                                const int32_t* doc_start = nullptr);
// Full T×T probability matrix per (b, h) in double; accumulates into dq, dk, dv like the kernel.
template <typename Real>
void attention_causal_reference_backward(const Real* q, const Real* k, const Real* v,
                                         const Real* dout, Real* dq, Real* dk, Real* dv,
                                         const AttnShape& s, double scale,
                                         const int32_t* doc_start = nullptr);

// Rotary tables for interleaved-pair RoPE (adjacent dims (2i, 2i+1) rotate together), with
// optional YaRN frequency interpolation (SPEC §1.2).
//   cos, sin : [P, D/2] for positions 0..P-1, D = rotary dim.
struct RopeParams {
  int dim = 0;
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0, original_max_position = 4096, beta_fast = 32, beta_slow = 1;
  double mscale = 1.0, mscale_all_dim = 0.0;
};
template <typename Real>
void rope_build_tables(const RopeParams& p, int64_t positions, Real* cos, Real* sin);
// Softmax scale multiplier under YaRN (m² with m = 0.1·mscale_all_dim·ln(s) + 1); 1 otherwise.
double rope_softmax_scale_factor(const RopeParams& p);
// Rotates x in place: x rows [N] of `stride` values; the rotary slice starts at `offset` and is
// D = dim wide; row r has position pos[r]. Pairs (offset+2i, offset+2i+1) rotate by angle
// pos·f_i (by −pos·f_i when `inverse`). (The HF "interleave" de-interleaves first; dot products
// of q and k are identical.)
// Backward: the forward map is a·R(θ) (a = the YaRN amplitude the tables carry, 1 without YaRN),
// so its transpose is a·R(−θ), i.e. the negative-angle rotation with the same tables applied to
// the gradient: rope_apply_interleaved_inverse(dx, ...) (an exact inverse only when a = 1).
template <typename Real>
void rope_apply_interleaved(Real* x, int64_t N, int64_t stride, int64_t offset, int dim,
                            const int64_t* pos, const Real* cos, const Real* sin,
                            bool inverse = false);
template <typename Real>
void rope_apply_interleaved_inverse(Real* x, int64_t N, int64_t stride, int64_t offset, int dim,
                                    const int64_t* pos, const Real* cos, const Real* sin) {
  rope_apply_interleaved(x, N, stride, offset, dim, pos, cos, sin, /*inverse=*/true);
}
// pos [B·T] = t − doc_start[b·T + t] (positions restart at every document), or t when doc_start
// is nullptr. Every position is < T, so tables of T positions suffice.
void rope_positions_from_doc_start(const int32_t* doc_start, int64_t B, int64_t T, int64_t* pos);

}  // namespace dm
