// Gated MLA layer forward on the GPU (layers.h), the twin of model/mla.cpp mla_layer_forward
// without `saved` (inference / prefill), op for op:
//
//   q      = W_qb · RMSNorm(W_qa x)   (or W_q x)                      [N, H, dq]   bf16
//   [c;kr] = W_kva x                                                  [N, kvl+rope] fp32
//   c      = RMSNorm(c)                                               [N, kvl]     bf16
//   [k_nope | v]_h = W_kvb c                                          [N, H, nope+dv] bf16
//   RoPE (when on) on q[:, :, nope:] and kr, positions restarting at document starts
//   k_h = [k_nope_h | kr],  v_h                                       [N, H, dq], [N, H, dv]
//   o = causal attention(q, k, v), scale mla_softmax_scale            [N, H, dv]   bf16
//   o ← o ⊙ sigmoid(W_gate x)   (output gate, when on)
//   y = W_o o                                                         [N, d]       fp32
//
// The two GEMMs that feed an RMSNorm (W_qa x, W_kva x) write fp32, so the norm statistics and
// the rotated shared key kr come from unrounded values; every other activation is bf16.
// Everything up to the gate pre-activation is mla_detail::mla_forward_core, which the backward
// (mla_gpu_backward.cpp) reruns to recompute the same activations.
#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/mla_gpu_internal.h"
#include "model/mla.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/mla_layer_ops.h"

namespace dm::cuda {

namespace mla_detail {

namespace {

bool rope_active(const MlaConfig& m) { return m.use_rope && m.qk_rope_dim > 0; }

// The RoPE tables of ops/cpu/rope.cpp are cos/sin(pos·f_i)·a with fp32 frequencies f_i and one
// amplitude a. Rather than repeating the YaRN frequency rules here, read them back off the CPU
// builder in double: position 0 gives a (cos 0 = 1), position 1 gives f_i = atan2(sin, cos),
// exact to ~1e-16, so rounding to float recovers the fp32 frequency bit for bit.
// (f_0 = 1 and the others are smaller for YaRN factors ≥ 1, so atan2 is unambiguous.)
MlaRopeFrequencies rope_frequencies(const MlaConfig& m) {
  const RopeParams p = mla_rope_params(m);

  MlaRopeFrequencies f;
  f.half = m.qk_rope_dim / 2;
  // [2, half] tables on the stack (no per-call heap allocation).
  std::array<double, 2 * kMlaMaxRopeHalf> cos{}, sin{};
  rope_build_tables(p, 2, cos.data(), sin.data());
  f.amplitude = cos[0];
  for (int i = 0; i < f.half; ++i) {
    const double angle = std::atan2(sin[size_t(f.half + i)], cos[size_t(f.half + i)]);
    DM_CHECK(angle >= 0.0, "mla_layer_forward_gpu: RoPE frequency ", i,
             " is outside [0, π) and cannot be recovered from the tables");
    f.freq[i] = float(angle);
  }
  return f;
}

}  // namespace

MlaDims::MlaDims(const ModelConfig& c, int64_t B_, int64_t T_)
    : B(B_), N(B_ * T_), T(T_), d(c.hidden), H(c.mla.num_heads), nope(c.mla.qk_nope_dim),
      rope(c.mla.qk_rope_dim), dq(nope + rope), dv(c.mla.v_head_dim), kvl(c.mla.kv_lora_rank),
      ql(c.mla.q_lora_rank), rope_on(rope_active(c.mla)), gate(c.mla.output_gate) {}

std::vector<size_t> MlaDims::forward_views(size_t act_bytes) const {
  const size_t e = act_bytes;
  std::vector<size_t> v;
  if (ql > 0) {
    v.push_back(size_t(N * ql) * sizeof(float));  // q_a (fp32, before its norm)
    v.push_back(size_t(N * ql) * e);              // RMSNorm(q_a)
  }
  v.push_back(size_t(N * H * dq) * e);                    // q
  v.push_back(size_t(N * (kvl + rope)) * sizeof(float));  // kv_a = [c_raw ; kr]
  v.push_back(size_t(N * kvl) * e);                       // c
  v.push_back(size_t(N * H * (nope + dv)) * e);           // kv = [k_nope | v] per head
  if (rope_on) {
    v.push_back(size_t(T * (rope / 2)) * sizeof(float));  // cos
    v.push_back(size_t(T * (rope / 2)) * sizeof(float));  // sin
  }
  v.push_back(size_t(N * H * dq) * e);            // k
  v.push_back(size_t(N * H * dv) * e);            // v
  v.push_back(size_t(N * H * dv) * e);            // attention output o
  if (gate) v.push_back(size_t(N * H * dv) * e);  // W_gate x
  return v;
}

// Same order as MlaDims::forward_views (the byte count walks that list).
template <typename A>
MlaForwardViewsT<A> MlaForwardViewsT<A>::carve(DeviceArena& a, const MlaDims& s) {
  const int64_t N = s.N, H = s.H;
  MlaForwardViewsT<A> v;
  v.q_a = s.ql > 0 ? a.alloc<float>(size_t(N * s.ql)) : nullptr;
  v.q_a_normed = s.ql > 0 ? a.alloc<A>(size_t(N * s.ql)) : nullptr;
  v.q = a.alloc<A>(size_t(N * H * s.dq));
  v.kv_a = a.alloc<float>(size_t(N * (s.kvl + s.rope)));
  v.c = a.alloc<A>(size_t(N * s.kvl));
  v.kv = a.alloc<A>(size_t(N * H * (s.nope + s.dv)));
  v.rope_cos = s.rope_on ? a.alloc<float>(size_t(s.T * (s.rope / 2))) : nullptr;
  v.rope_sin = s.rope_on ? a.alloc<float>(size_t(s.T * (s.rope / 2))) : nullptr;
  v.k = a.alloc<A>(size_t(N * H * s.dq));
  v.v = a.alloc<A>(size_t(N * H * s.dv));
  v.o = a.alloc<A>(size_t(N * H * s.dv));
  v.gate = s.gate ? a.alloc<A>(size_t(N * H * s.dv)) : nullptr;
  return v;
}
template struct MlaForwardViewsT<uint16_t>;
template struct MlaForwardViewsT<float>;

void check_dims(const MlaDims& s, const char* who) {
  DM_CHECK(s.B >= 0 && s.T >= 0, who, ": bad shape B=", s.B, " T=", s.T);
  DM_CHECK(s.d > 0 && s.H > 0 && s.kvl > 0 && s.dv > 0 && s.nope >= 0 && s.rope >= 0 &&
               s.ql >= 0 && s.dq > 0,
           who, ": bad config (hidden ", s.d, ", heads ", s.H, ", kv_lora ", s.kvl, ", v_head ",
           s.dv, ", nope ", s.nope, ", rope ", s.rope, ")");
  DM_CHECK(!s.rope_on || s.rope % 2 == 0, who, ": qk_rope_dim must be even, got ", s.rope);
  DM_CHECK(!s.rope_on || s.rope / 2 <= kMlaMaxRopeHalf, who,
           ": qk_rope_dim too large for the GPU RoPE (", s.rope, " > ", 2 * kMlaMaxRopeHalf, ")");
  DM_CHECK(s.dq % 8 == 0 && s.dv % 8 == 0, who,
           ": the GPU attention needs head dims that are multiples of 8 (qk_nope + qk_rope = ",
           s.dq, ", v_head = ", s.dv, ")");
}

// The CPU float engine uses the scale rounded to float (mla_softmax_scale_for<float>).
double mla_gpu_softmax_scale(const ModelConfig& c) { return double(mla_softmax_scale(c.mla)); }

template <typename A>
void mla_forward_core(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w, const MlaDims& s,
                      const MlaForwardViewsT<A>& a, const A* xn, const int32_t* doc_start,
                      float* lse) {
  constexpr GemmOutType kOut = activation_out<A>();
  const MlaConfig& m = dw.config().mla;
  CUstream_st* stream = run.stream;
  const int64_t N = s.N, d = s.d, H = s.H, dq = s.dq, dv = s.dv, kvl = s.kvl, ql = s.ql;
  const int64_t nope = s.nope, rope = s.rope;
  const double eps = m.latent_norm_eps;

  // q = W_qb · RMSNorm(W_qa x)  or  W_q x                                  [N, H·dq]
  if (ql > 0) {
    linear(run, xn, dw.operand<A>(w.q_a), N, d, ql, a.q_a, GemmOutType::F32);
    mla_rmsnorm_rows(a.q_a, ql, dw.f32(w.q_a_norm), a.q_a_normed, N, ql, eps, stream);
    linear(run, a.q_a_normed, dw.operand<A>(w.q_b), N, ql, H * dq, a.q, kOut);
  } else {
    linear(run, xn, dw.operand<A>(w.q_proj), N, d, H * dq, a.q, kOut);
  }
  // [c ; kr] = W_kva x (fp32);  c = RMSNorm(c) read in place with leading dim kvl + rope;
  // [k_nope | v]_h = W_kvb c
  linear(run, xn, dw.operand<A>(w.kv_a), N, d, kvl + rope, a.kv_a, GemmOutType::F32);
  mla_rmsnorm_rows(a.kv_a, kvl + rope, dw.f32(w.kv_a_norm), a.c, N, kvl, eps, stream);
  linear(run, a.c, dw.operand<A>(w.kv_b), N, kvl, H * (nope + dv), a.kv, kOut);

  // RoPE on q's rotary slice in place; kr is rotated while it is copied into every head's key.
  if (s.rope_on) {
    mla_rope_tables_device(rope_frequencies(m), s.T, a.rope_cos, a.rope_sin, stream);
    mla_rope_queries(a.q, s.B, s.T, H, nope, rope, a.rope_cos, a.rope_sin, doc_start, stream);
  }
  mla_assemble_kv(a.kv, a.kv_a, s.B, s.T, H, nope, rope, dv, kvl, a.rope_cos, a.rope_sin,
                  doc_start, a.k, a.v, stream);

  cuda::attention_causal_forward(a.q, a.k, a.v, a.o, lse, AttnShape{s.B, s.T, H, dq, dv},
                                 mla_gpu_softmax_scale(dw.config()), doc_start, stream);
  if (s.gate) linear(run, xn, dw.operand<A>(w.gate), N, d, H * dv, a.gate, kOut);
}

template void mla_forward_core<uint16_t>(GpuRun&, const DeviceWeights&, const MlaWeights&,
                                         const MlaDims&, const MlaForwardViews&, const uint16_t*,
                                         const int32_t*, float*);
template void mla_forward_core<float>(GpuRun&, const DeviceWeights&, const MlaWeights&,
                                      const MlaDims&, const MlaForwardViewsT<float>&, const float*,
                                      const int32_t*, float*);

}  // namespace mla_detail

size_t mla_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T,
                                   WeightPrecision precision) {
  const size_t act_bytes = precision == WeightPrecision::F32 ? sizeof(float) : sizeof(uint16_t);
  return mla_detail::arena_bytes(mla_detail::MlaDims(c, B, T).forward_views(act_bytes));
}

size_t mla_layer_kept_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  return mla_detail::MlaKeptViews::bytes(mla_detail::MlaDims(c, B, T));
}

namespace mla_detail {

size_t MlaKeptViews::bytes(const MlaDims& s) {
  std::vector<size_t> views = s.forward_views();
  views.push_back(size_t(s.B * s.H * s.T) * sizeof(float));
  return arena_bytes(views);
}

MlaKeptViews MlaKeptViews::carve(void* kept, const MlaDims& s) {
  DeviceArena arena(kept, bytes(s));
  MlaKeptViews v;
  v.f = MlaForwardViews::carve(arena, s);
  v.lse = arena.alloc<float>(size_t(s.B * s.H * s.T));
  return v;
}

}  // namespace mla_detail

template <typename A>
void mla_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w, const A* xn,
                           float* y, int64_t B, int64_t T, const int32_t* doc_start, void* kept,
                           const float* residual) {
  using namespace mla_detail;
  const MlaDims s(dw.config(), B, T);
  check_dims(s, "mla_layer_forward_gpu");
  if (s.N == 0) return;
  DeviceArenaScope scope(run.scratch);
  const int64_t hdv = s.N * s.H * s.dv;
  if constexpr (std::is_same_v<A, uint16_t>) {
    if (kept) {
      // Training without recompute: the activations and the lse stay in `kept`; W_o reads a
      // gated copy so that the backward finds the ungated o.
      const MlaKeptViews k = MlaKeptViews::carve(kept, s);
      mla_forward_core<A>(run, dw, w, s, k.f, xn, doc_start, k.lse);
      const uint16_t* o = k.f.o;
      if (s.gate) {
        uint16_t* gated = run.scratch.alloc<uint16_t>(size_t(hdv));
        mla_gate_multiply_into(k.f.o, k.f.gate, gated, hdv, run.stream);
        o = gated;
      }
      linear_plus(run, o, dw.bf16(w.o_proj), s.N, s.H * s.dv, s.d, y, residual);
      return;
    }
  } else {
    DM_CHECK(!kept, "mla_layer_forward_gpu: the fp32 mode keeps nothing");
  }
  const MlaForwardViewsT<A> a = MlaForwardViewsT<A>::carve(run.scratch, s);
  mla_forward_core<A>(run, dw, w, s, a, xn, doc_start, /*lse=*/nullptr);
  // Inference gates o in place (nothing needs the ungated output afterwards).
  if (s.gate) mla_gate_multiply(a.o, a.gate, hdv, run.stream);
  linear_plus(run, a.o, dw.operand<A>(w.o_proj), s.N, s.H * s.dv, s.d, y, residual);
}

template void mla_layer_forward_gpu<uint16_t>(GpuRun&, const DeviceWeights&, const MlaWeights&,
                                              const uint16_t*, float*, int64_t, int64_t,
                                              const int32_t*, void*, const float*);
template void mla_layer_forward_gpu<float>(GpuRun&, const DeviceWeights&, const MlaWeights&,
                                           const float*, float*, int64_t, int64_t, const int32_t*,
                                           void*, const float*);

}  // namespace dm::cuda
