// One element of the GLU, h = a(g)·b(u) (SiTU: a = β1 tanh(g/β1) σ(g), b = β2 tanh(u/β2);
// SwiGLU: a = g σ(g), b = u), and its gradients, for every kernel that applies it: the
// element-wise GLU kernels (elementwise.cu) and the epilogues of the grouped expert products
// that fuse it (moe_grouped_gemm_wgmma*.cu). One definition, so the fused and the separate
// passes give the same bits. Included only by nvcc-compiled files.
//
// The tanh arguments g/β1, u/β2 are taken as g·(1/β1), u·(1/β2) with the reciprocals formed once
// per thread (glu_inverse_betas): an fp32 division per element and operand cost more issue
// slots than the element's loads. (Exact for β1 = 4; within an ulp of the quotient otherwise.)
//
// Two kinds of arithmetic: kFast = false uses the libm-accurate tanhf / expf and the correctly
// rounded reciprocal (the fp32 GPU mode, which matches the CPU to ~1e-6); kFast = true, for
// every bf16 GLU, builds tanh, 1 − tanh² and σ from one ex2.approx and one rcp.approx each
// (~2e-7 relative, ~1e-6 near tanh's zero), far below the bf16 rounding (2^-9) every bf16 output
// gets. The SiTU element with libm tanhf cost ~75 instructions forward and ~100 backward: the
// element-wise GLU passes were bound by that arithmetic (65 / 97 µs at 24576 × 1024 on an H200,
// 2.3 / 2.6 TB/s), and inside a product's epilogue it outweighed the product's own MMAs.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/elementwise.h"  // GluKernelParams
#include "ops/cuda/elementwise_storage.cuh"

namespace dm::cuda {

struct GluInverseBetas {
  float beta1, beta2;
};
__device__ __forceinline__ GluInverseBetas glu_inverse_betas(const GluKernelParams& p) {
  return {1.0f / p.beta1, 1.0f / p.beta2};
}

// tanh(x) and 1 − tanh²(x) from e = e^{−2|x|} ∈ (0, 1]: tanh|x| = (1 − e)/(1 + e),
// 1 − tanh² = 4e/(1 + e)² (no cancellation where |tanh| → 1).
struct TanhPair {
  float tanh, sech2;
};
__device__ __forceinline__ TanhPair tanh_pair_fast(float x) {
  const float e = __expf(-2.0f * fabsf(x));
  const float inverse = __fdividef(1.0f, 1.0f + e);
  return {copysignf((1.0f - e) * inverse, x), 4.0f * e * inverse * inverse};
}
// σ(g) and 1 − σ(g) from e = e^{−g}: σ = 1/(1 + e); 1 − σ = e·σ for g ≥ 0, else 1 − σ (both
// without cancellation; e = ∞ below g ≈ −88 gives σ = 0, 1 − σ = 1).
struct SigmoidPair {
  float sig, complement;
};
__device__ __forceinline__ SigmoidPair sigmoid_pair_fast(float g) {
  const float e = __expf(-g);
  const float sig = __fdividef(1.0f, 1.0f + e);
  return {sig, g >= 0.0f ? e * sig : 1.0f - sig};
}

template <bool kFast = false>
__device__ __forceinline__ float glu_value(float gate, float up, const GluKernelParams& p,
                                           const GluInverseBetas& inv) {
  if constexpr (kFast) {
    const float sig = sigmoid_pair_fast(gate).sig;
    if (!p.situ) return gate * sig * up;
    return (p.beta1 * tanh_pair_fast(gate * inv.beta1).tanh * sig) *
           (p.beta2 * tanh_pair_fast(up * inv.beta2).tanh);
  } else {
    const float sig = sigmoid_f32(gate);
    return p.situ ? (p.beta1 * tanhf(gate * inv.beta1) * sig) * (p.beta2 * tanhf(up * inv.beta2))
                  : gate * sig * up;
  }
}

template <bool kFast = false>
__device__ __forceinline__ void glu_grads(float gate, float up, float d_h, const GluKernelParams& p,
                                          const GluInverseBetas& inv, float& d_gate, float& d_up) {
  float sig, sig_complement;  // σ(g), 1 − σ(g) without cancellation
  if constexpr (kFast) {
    const SigmoidPair s = sigmoid_pair_fast(gate);
    sig = s.sig;
    sig_complement = s.complement;
  } else {
    sig = sigmoid_f32(gate);
    sig_complement = sigmoid_f32(-gate);
  }
  if (p.situ) {
    float tanh_g, tanh_u, sech2_g, sech2_u;
    if constexpr (kFast) {
      const TanhPair tg = tanh_pair_fast(gate * inv.beta1), tu = tanh_pair_fast(up * inv.beta2);
      tanh_g = tg.tanh, sech2_g = tg.sech2, tanh_u = tu.tanh, sech2_u = tu.sech2;
    } else {
      tanh_g = tanhf(gate * inv.beta1), tanh_u = tanhf(up * inv.beta2);
      sech2_g = 1.0f - tanh_g * tanh_g, sech2_u = 1.0f - tanh_u * tanh_u;
    }
    const float gate_half = p.beta1 * tanh_g * sig;
    const float up_half = p.beta2 * tanh_u;
    // a'(g) = (1 − tanh²(g/β1))σ(g) + β1 tanh(g/β1) σ(g)(1 − σ(g)); b'(u) = 1 − tanh²(u/β2)
    d_gate = d_h * (sech2_g * sig + gate_half * sig_complement) * up_half;
    d_up = d_h * gate_half * sech2_u;
  } else {
    d_gate = d_h * up * sig * (1.0f + gate * sig_complement);  // SiLU'(g) = σ(1 + g(1 − σ))
    d_up = d_h * gate * sig;
  }
}

// Eight bf16 in one 16-byte word (element 2i in the low half of word i) ↔ fp32; the pack rounds
// to nearest even.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    words[i] = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i]))) |
               (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1]))) << 16);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// h = act(g, u) for eight bf16 of each, rounded to bf16 (the fast arithmetic).
__device__ __forceinline__ uint4 glu_forward_bf16x8(const uint4& g, const uint4& u,
                                                    const GluKernelParams& p,
                                                    const GluInverseBetas& inv) {
  float gate[8], up[8], value[8];
  unpack_bf16x8(g, gate);
  unpack_bf16x8(u, up);
#pragma unroll
  for (int e = 0; e < 8; ++e) value[e] = glu_value<true>(gate[e], up[e], p, inv);
  return pack_bf16x8(value);
}

// (dg, du) of eight bf16 of g, u and dh, rounded to bf16 (the fast arithmetic).
__device__ __forceinline__ void glu_backward_bf16x8(const uint4& g, const uint4& u, const uint4& dh,
                                                    const GluKernelParams& p,
                                                    const GluInverseBetas& inv, uint4& dg,
                                                    uint4& du) {
  float gate[8], up[8], d_h[8], d_gate[8], d_up[8];
  unpack_bf16x8(g, gate);
  unpack_bf16x8(u, up);
  unpack_bf16x8(dh, d_h);
#pragma unroll
  for (int e = 0; e < 8; ++e) glu_grads<true>(gate[e], up[e], d_h[e], p, inv, d_gate[e], d_up[e]);
  dg = pack_bf16x8(d_gate);
  du = pack_bf16x8(d_up);
}

}  // namespace dm::cuda
