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
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/mla.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/mla_layer_ops.h"

namespace dm::cuda {

namespace {

constexpr size_t kArenaAlign = 256;  // DeviceArena view alignment

size_t aligned(size_t bytes) { return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

bool rope_active(const MlaConfig& m) { return m.use_rope && m.qk_rope_dim > 0; }

// Dimensions of one call, and the scratch views in the order the forward carves them (the byte
// count below walks the same list, so the two cannot drift apart).
struct MlaDims {
  int64_t N, T, d, H, nope, rope, dq, dv, kvl, ql;
  bool rope_on, gate;

  MlaDims(const ModelConfig& c, int64_t B, int64_t T_)
      : N(B * T_), T(T_), d(c.hidden), H(c.mla.num_heads), nope(c.mla.qk_nope_dim),
        rope(c.mla.qk_rope_dim), dq(nope + rope), dv(c.mla.v_head_dim), kvl(c.mla.kv_lora_rank),
        ql(c.mla.q_lora_rank), rope_on(rope_active(c.mla)), gate(c.mla.output_gate) {}

  // Bytes of every scratch view, in allocation order.
  std::vector<size_t> views() const {
    std::vector<size_t> v;
    if (ql > 0) {
      v.push_back(size_t(N * ql) * sizeof(float));     // q_a (fp32, before its norm)
      v.push_back(size_t(N * ql) * sizeof(uint16_t));  // RMSNorm(q_a)
    }
    v.push_back(size_t(N * H * dq) * sizeof(uint16_t));          // q
    v.push_back(size_t(N * (kvl + rope)) * sizeof(float));       // kv_a = [c_raw ; kr]
    v.push_back(size_t(N * kvl) * sizeof(uint16_t));             // c
    v.push_back(size_t(N * H * (nope + dv)) * sizeof(uint16_t)); // kv = [k_nope | v] per head
    if (rope_on) {
      v.push_back(size_t(T * (rope / 2)) * sizeof(float));  // cos
      v.push_back(size_t(T * (rope / 2)) * sizeof(float));  // sin
    }
    v.push_back(size_t(N * H * dq) * sizeof(uint16_t));  // k
    v.push_back(size_t(N * H * dv) * sizeof(uint16_t));  // v
    v.push_back(size_t(N * H * dv) * sizeof(uint16_t));  // attention output o
    if (gate) v.push_back(size_t(N * H * dv) * sizeof(uint16_t));  // W_gate x
    return v;
  }
};

void check_dims(const MlaDims& s) {
  DM_CHECK(s.d > 0 && s.H > 0 && s.kvl > 0 && s.dv > 0 && s.nope >= 0 && s.rope >= 0 &&
               s.ql >= 0 && s.dq > 0,
           "mla_layer_forward_gpu: bad config (hidden ", s.d, ", heads ", s.H, ", kv_lora ", s.kvl,
           ", v_head ", s.dv, ", nope ", s.nope, ", rope ", s.rope, ")");
  DM_CHECK(!s.rope_on || s.rope % 2 == 0, "mla_layer_forward_gpu: qk_rope_dim must be even, got ",
           s.rope);
  DM_CHECK(!s.rope_on || s.rope / 2 <= kMlaMaxRopeHalf,
           "mla_layer_forward_gpu: qk_rope_dim too large for the GPU RoPE (", s.rope, " > ",
           2 * kMlaMaxRopeHalf, ")");
  DM_CHECK(s.dq % 8 == 0 && s.dv % 8 == 0,
           "mla_layer_forward_gpu: the GPU attention needs head dims that are multiples of 8 "
           "(qk_nope + qk_rope = ", s.dq, ", v_head = ", s.dv, ")");
}

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

size_t mla_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  const MlaDims s(c, B, T);
  size_t bytes = kArenaAlign;  // the first view may start mid-block
  for (size_t v : s.views()) bytes += aligned(std::max<size_t>(v, 1));
  return bytes;
}

void mla_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w,
                           const uint16_t* xn, float* y, int64_t B, int64_t T,
                           const int32_t* doc_start) {
  const ModelConfig& cfg = dw.config();
  const MlaConfig& m = cfg.mla;
  const MlaDims s(cfg, B, T);
  check_dims(s);
  DM_CHECK(B >= 0 && T >= 0, "mla_layer_forward_gpu: bad shape B=", B, " T=", T);
  if (s.N == 0) return;
  DeviceArenaScope scope(run.scratch);
  CUstream_st* stream = run.stream;
  const int64_t N = s.N, d = s.d, H = s.H, dq = s.dq, dv = s.dv, kvl = s.kvl, ql = s.ql;
  const int64_t nope = s.nope, rope = s.rope;
  const double eps = m.latent_norm_eps;

  // Scratch views, in the order of MlaDims::views.
  DeviceArena& a = run.scratch;
  float* q_a = ql > 0 ? a.alloc<float>(size_t(N * ql)) : nullptr;
  uint16_t* q_a_normed = ql > 0 ? a.alloc<uint16_t>(size_t(N * ql)) : nullptr;
  uint16_t* q = a.alloc<uint16_t>(size_t(N * H * dq));
  float* kv_a = a.alloc<float>(size_t(N * (kvl + rope)));
  uint16_t* c = a.alloc<uint16_t>(size_t(N * kvl));
  uint16_t* kv = a.alloc<uint16_t>(size_t(N * H * (nope + dv)));
  float* rope_cos = s.rope_on ? a.alloc<float>(size_t(T * (rope / 2))) : nullptr;
  float* rope_sin = s.rope_on ? a.alloc<float>(size_t(T * (rope / 2))) : nullptr;
  uint16_t* k = a.alloc<uint16_t>(size_t(N * H * dq));
  uint16_t* v = a.alloc<uint16_t>(size_t(N * H * dv));
  uint16_t* o = a.alloc<uint16_t>(size_t(N * H * dv));
  uint16_t* gate = s.gate ? a.alloc<uint16_t>(size_t(N * H * dv)) : nullptr;

  // q = W_qb · RMSNorm(W_qa x)  or  W_q x                                  [N, H·dq]
  if (ql > 0) {
    linear(run, xn, dw.bf16(w.q_a), N, d, ql, q_a, GemmOutType::F32);
    mla_rmsnorm_rows(q_a, ql, dw.f32(w.q_a_norm), q_a_normed, N, ql, eps, stream);
    linear(run, q_a_normed, dw.bf16(w.q_b), N, ql, H * dq, q, GemmOutType::Bf16);
  } else {
    linear(run, xn, dw.bf16(w.q_proj), N, d, H * dq, q, GemmOutType::Bf16);
  }
  // [c ; kr] = W_kva x (fp32);  c = RMSNorm(c) read in place with leading dim kvl + rope;
  // [k_nope | v]_h = W_kvb c
  linear(run, xn, dw.bf16(w.kv_a), N, d, kvl + rope, kv_a, GemmOutType::F32);
  mla_rmsnorm_rows(kv_a, kvl + rope, dw.f32(w.kv_a_norm), c, N, kvl, eps, stream);
  linear(run, c, dw.bf16(w.kv_b), N, kvl, H * (nope + dv), kv, GemmOutType::Bf16);

  // RoPE on q's rotary slice in place; kr is rotated while it is copied into every head's key.
  if (s.rope_on) {
    mla_rope_tables_device(rope_frequencies(m), T, rope_cos, rope_sin, stream);
    mla_rope_queries(q, B, T, H, nope, rope, rope_cos, rope_sin, doc_start, stream);
  }
  mla_assemble_kv(kv, kv_a, B, T, H, nope, rope, dv, kvl, rope_cos, rope_sin, doc_start, k, v,
                  stream);

  // The CPU float engine uses the scale rounded to float (mla_softmax_scale_for<float>).
  cuda::attention_causal_forward(q, k, v, o, nullptr, AttnShape{B, T, H, dq, dv},
                                 double(mla_softmax_scale(m)), doc_start, stream);
  if (s.gate) {
    linear(run, xn, dw.bf16(w.gate), N, d, H * dv, gate, GemmOutType::Bf16);
    mla_gate_multiply(o, gate, N * H * dv, stream);
  }
  linear(run, o, dw.bf16(w.o_proj), N, H * dv, d, y, GemmOutType::F32);
}

}  // namespace dm::cuda
