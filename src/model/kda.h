// KDA token mixer layer (SPEC §1.1): projections, short convs, gates, the KDA operator, the gated
// per-head RMSNorm and the output projection, forward and backward, templated on the scalar
// (float engine, double reference checks; docs/backward.md). Kernels live in
// ops/cpu/{kda,kda_prep,norm_gated}.
//
// Per token x (normed input, [d]), head h:
//   q, k, v = SiLU(ShortConv(W_{q,k,v} x))       g = gate(f_b f_a x; A_log, dt_bias)
//   β = sigmoid(b_proj x)                         o = KDA(q, k, v, g, β)  (zero initial state)
//   y = o_proj · concat_h[ RMSNorm(o_h)·o_norm ⊙ sigmoid(G x)_h ],  G = g_b g_a or g_proj (full)
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"

namespace dm {

struct KdaRunOptions {
  int chunk = 64;          // chunked form (16/32/64); 0 = recurrent reference
};

// What a training forward keeps for kda_layer_backward: views into the caller's saved arena
// (N = B·T). The rest (q, k, v after the conv, g, the normed output) is recomputed.
template <typename Real>
struct KdaSaved {
  int chunk = 64;                  // operator form of the forward; the backward uses the same
  Real* q_raw = nullptr;           // [N, H·K] W_q x, before the short conv
  Real* k_raw = nullptr;           // [N, H·K]
  Real* v_raw = nullptr;           // [N, H·K]
  Real* gate_low = nullptr;        // [N, K]   f_a x
  Real* gate_raw = nullptr;        // [N, H·K] f_b f_a x, before the gate nonlinearity
  Real* beta = nullptr;            // [N, H]   sigmoid(b_proj x)
  Real* o = nullptr;               // [N, H·K] operator output
  Real* out_gate_low = nullptr;    // [N, K]   g_a x (low-rank output gate only)
  Real* out_gate = nullptr;        // [N, H·K] output gate before the sigmoid
};

// x: normed input [B, T, d]; y: output [B, T, d] (overwritten). Scratch from ws.
// doc_start [B·T] (optional): packed documents; the convs and the KDA state reset at each
// document start. saved (optional, training): filled with views allocated from *saved_arena.
template <typename Real>
void kda_layer_forward(const ModelConfig& cfg, const KdaWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t B, int64_t T, Arena& ws, const KdaRunOptions& opt = {},
                       const int32_t* doc_start = nullptr, KdaSaved<Real>* saved = nullptr,
                       Arena* saved_arena = nullptr);
// Upper bound of the scratch kda_layer_forward takes from ws (with or without `saved`).
size_t kda_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk = 64,
                                 size_t elem_size = sizeof(float));
// Bytes kda_layer_forward takes from *saved_arena when `saved` is given.
size_t kda_layer_saved_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                             size_t elem_size = sizeof(float));

// dy [B, T, d] → grad (+= into every parameter of the layer) and dx [B, T, d] (+=). x and
// doc_start must be those of the forward that filled `saved`.
template <typename Real>
void kda_layer_backward(const ModelConfig& cfg, const KdaWeightsT<Real>& w,
                        KdaWeightsT<Real>& grad, const Real* x, const KdaSaved<Real>& saved,
                        const Real* dy, Real* dx, int64_t B, int64_t T, Arena& ws,
                        const int32_t* doc_start = nullptr);
size_t kda_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                          int chunk = 64, size_t elem_size = sizeof(float));

// ---- Cached inference (float engine) ----
// One sequence's (prefill/extend) or the whole batch's (decode) KDA cache: state [S, H, K, V] and
// the raw (pre-conv) inputs of the last Kc−1 tokens per conv [S, Kc−1, H·K]. Prefill/extend use
// S = 1 (pointers at the sequence's slot); decode indexes it by slot.
struct KdaPrefillCache {
  float* state = nullptr;
  float *conv_tail_q = nullptr, *conv_tail_k = nullptr, *conv_tail_v = nullptr;
};

// Where kda_layer_extend also copies the state and conv tails: after the first `tokens` tokens of
// the extend (1..T). The prefix cache checkpoints a prompt on its token grid with these.
struct KdaCheckpoint {
  int64_t tokens = 0;
  KdaPrefillCache copy;
};

// The chunked forward of x [T, d] → y [T, d] appended to a sequence whose state and conv tails
// are in `cache` (fresh = true: a new sequence, zero state and zero tails; the cache is only
// written). Leaves the state and tails after the last token in `cache`, and after
// checkpoints[i].tokens tokens (strictly increasing) in checkpoints[i].copy. Same code path as
// kda_layer_forward (B = 1); the operator runs piecewise between checkpoints.
// Scratch: kda_layer_workspace_bytes(cfg, 1, T, chunk).
void kda_layer_extend(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                      float* y, int64_t T, Arena& ws, const KdaPrefillCache& cache, bool fresh,
                      const KdaCheckpoint* checkpoints = nullptr, int64_t num_checkpoints = 0,
                      int chunk = 64);

// kda_layer_extend of a new sequence (fresh, no checkpoints).
void kda_layer_prefill(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                       float* y, int64_t T, Arena& ws, const KdaPrefillCache& out, int chunk = 64);

// One token for each of n sequences: x [n, d] → y [n, d]; row r belongs to cache slot
// slots[r], whose state and conv tails advance by that token (recurrent operator, in place).
void kda_layer_decode(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, const int64_t* slots, const KdaPrefillCache& cache,
                      Arena& ws);
size_t kda_layer_decode_workspace_bytes(const ModelConfig& cfg, int64_t n);

}  // namespace dm
