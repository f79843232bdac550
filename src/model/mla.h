// Gated MLA token mixer layer, expanded form for prefill/training (SPEC §1.2): forward, saved
// activations and backward, templated on the scalar (float engine, double reference checks).
//
//   x: normed input [B, T, d]; y: output [B, T, d]; N = B·T.
//   doc_start (optional) [B, T]: packed documents (docs/backward.md); attention stays inside a
//   document and RoPE positions restart at every document start (pos = t − doc_start[t]).
//   nullptr = every row is one document with positions 0..T−1.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"
#include "ops/cpu/attention.h"

namespace dm {

// Activations the backward needs, filled by mla_layer_forward when `saved` is given. The buffers
// come from the caller's `saved_arena` and must live until mla_layer_backward returns.
// (H = num_heads, dq = qk_nope + qk_rope, dv = v_head, kvl = kv_lora, ql = q_lora)
template <typename Real>
struct MlaSaved {
  int64_t B = 0, T = 0;
  Real* q_a = nullptr;       // [N, ql]            W_qa x before its RMSNorm (nullptr without q LoRA)
  Real* kv_a = nullptr;      // [N, kvl + rope]    [c_raw ; kr], kr already rotated when RoPE is on
  Real* q = nullptr;         // [N, H, dq]         attention queries (rotated)
  Real* k = nullptr;         // [N, H, dq]         attention keys [k_nope | kr]
  Real* v = nullptr;         // [N, H, dv]
  Real* attn_out = nullptr;  // [N, H, dv]         attention output before the gate
  Real* lse = nullptr;       // [B, H, T]          softmax log-sum-exp per query row
  Real* gate_sigmoid = nullptr;  // [N, H·dv]      sigmoid(W_gate x) (nullptr without the gate)
};

// Forward. With `saved` (and `saved_arena`) the activations above are kept for the backward;
// otherwise everything is scratch from `ws`, released on return.
template <typename Real>
void mla_layer_forward(const ModelConfig& cfg, const MlaWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t B, int64_t T, Arena& ws, const int32_t* doc_start = nullptr,
                       std::type_identity_t<MlaSaved<Real>>* saved = nullptr,
                       Arena* saved_arena = nullptr);

// Backward given dy [N, d]. ACCUMULATES into dx [N, d] and into every tensor of `grad` the
// config uses (q_a, q_a_norm, q_b or q_proj; kv_a, kv_a_norm, kv_b; gate; o_proj). `saved` is
// what mla_layer_forward stored for the same x, weights and doc_start.
template <typename Real>
void mla_layer_backward(const ModelConfig& cfg, const MlaWeightsT<Real>& w,
                        MlaWeightsT<Real>& grad, const Real* x,
                        const std::type_identity_t<MlaSaved<Real>>& saved, const Real* dy,
                        Real* dx, int64_t B, int64_t T, Arena& ws,
                        const int32_t* doc_start = nullptr);

// Arena sizes (real_bytes = sizeof(Real)). Saved bytes are what one forward takes from
// `saved_arena`; the workspace sizes are the peak scratch of the forward (with or without
// `saved`: the larger) and of the backward.
size_t mla_layer_saved_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                             size_t real_bytes = sizeof(float));
size_t mla_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                 size_t real_bytes = sizeof(float));
size_t mla_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                          size_t real_bytes = sizeof(float));

// Softmax scale: (nope+rope)^-1/2, × m² under YaRN (rounded to float; the layer itself uses the
// double value).
float mla_softmax_scale(const MlaConfig& m);

// ---- Cached inference (float engine; SPEC §1.2 "Decode uses weight absorption", §5) ----
// The expanded forward of one sequence x [T, d] → y [T, d] (B = 1, positions 0..T−1) that also
// writes the decode cache rows of its T tokens: latent_cache [T, kvl] (c after its RMSNorm) and
// rope_key_cache [T, rope] (kr, rotated when RoPE is on). Scratch: mla_layer_workspace_bytes.
void mla_layer_prefill(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                       float* y, int64_t T, Arena& ws, float* latent_cache,
                       float* rope_key_cache);

// One MLA layer's paged latent cache (SPEC §5). Position t of slot s is row t % page_tokens of
// page page_table[s·pages_per_slot + t / page_tokens]. A row is [c ; kr] (kvl + rope floats),
// so the absorbed attention reads its (kvl + rope)-wide key and its kvl-wide value (the first
// kvl floats) from the same row.
struct MlaDecodeCache {
  int64_t page_tokens = 0;
  int64_t pages_per_slot = 0;
  float* pages = nullptr;               // [num_pages, page_tokens, kvl + rope]
  const int32_t* page_table = nullptr;  // [S, pages_per_slot] page ids
  const float* rope_cos = nullptr;      // [positions, rope/2] (RoPE on only; mla_rope_tables)
  const float* rope_sin = nullptr;
};
// cos/sin [positions, rope/2] for the decode cache (no-op when RoPE is off).
void mla_rope_tables(const MlaConfig& m, int64_t positions, float* cos, float* sin);
// The RoPE / YaRN parameters of an MLA config (ops/cpu/attention.h), for the GPU twins too.
RopeParams mla_rope_params(const MlaConfig& m);

// Extends slot `slot` by n tokens x [n, d] at positions start..start+n−1 → y [n, d]: their cache
// rows are written, then token i attends causally over positions 0..start+i of the slot.
// start == 0 runs the expanded form (mla_layer_prefill: fewer FLOPs per score at full size);
// start > 0 the absorbed form over the pages (the cached prefix is never up-projected). The
// pages of positions [0, start + n) must be in the slot's page table.
void mla_layer_extend(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, int64_t slot, int64_t start,
                      const MlaDecodeCache& cache, Arena& ws);
size_t mla_layer_extend_workspace_bytes(const ModelConfig& cfg, int64_t n, int64_t page_tokens);

// One token for each of n sequences, absorbed: x [n, d] → y [n, d]. Row r is sequence slot
// slots[r] at position positions[r]; its c and kr are written to the cache there, then it
// attends over positions 0..positions[r] of its slot (MQA on the kvl + rope wide latent key,
// kvl wide latent value; W_kvb's value rows applied after attention, then the gate and W_o).
void mla_layer_decode(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, const int64_t* slots, const int64_t* positions,
                      const MlaDecodeCache& cache, Arena& ws);
size_t mla_layer_decode_workspace_bytes(const ModelConfig& cfg, int64_t n, int64_t page_tokens);

}  // namespace dm
