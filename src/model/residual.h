// The residual stream of SPEC §1.3 over all layers — Block AttnRes or the plain pre-norm sum —
// written once and shared by the one-shot forward and the cached prefill/decode paths; each
// caller supplies how a layer's token mixer and FFN run on normed rows.
//
// Rows are independent across depth (AttnRes mixes per token), so the same walk serves N = B·T
// prefill rows or S decode rows. p [N, d] holds the embeddings on entry; x, xn, out [N, d] and
// blocks [nb, N, d] are scratch. Returns xn = RMSNorm(final mix) [N, d].
//   mixer(i, xn_in, out)  layer i's token mixer on normed rows
//   ffn(i, xn_in, out)    layer i's FFN on normed rows
//   emit(name, i, rows)   observes intermediates (i = −1 for the un-indexed ones)
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "io/config.h"
#include "model/weights.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/rmsnorm.h"

namespace dm {

inline int residual_num_blocks(const ModelConfig& c) {
  if (c.residual != ResidualKind::AttnRes) return 0;
  return (c.num_layers + c.attn_res_block - 1) / c.attn_res_block + 1;  // sealed sums incl. embedding
}

// The stream's own operations on the CPU (the GPU walk supplies device twins with the same
// members, model/cuda/model_gpu.cpp). Weight arguments are always the HOST views of W; `Normed`
// is the element type of the normed rows the sub-layers take.
template <typename Real>
struct CpuResidualOps {
  using Normed = Real;
  void copy(Real* dst, const Real* src, int64_t n) const { std::copy(src, src + n, dst); }
  void add(Real* dst, const Real* src, int64_t n) const {
    for (int64_t k = 0; k < n; ++k) dst[k] += src[k];
  }
  void attnres(const Real* const* src, int S, const Real* query, const Real* norm, Real* out,
               int64_t N, int64_t d, float eps) const {
    attnres_forward<Real>(src, S, query, norm, out, nullptr, N, d, eps);
  }
  void rmsnorm(const Real* x, const Real* w, Normed* y, int64_t N, int64_t d, float eps) const {
    rmsnorm_forward<Real>(x, w, y, N, d, eps);
  }
};

template <typename Real, typename WReal, typename MixerFn, typename FfnFn, typename EmitFn,
          typename Ops = CpuResidualOps<Real>>
typename Ops::Normed* residual_stack_forward(const ModelConfig& c, const ModelWeightsT<WReal>& W,
                                             int64_t N, Real* p, Real* x,
                                             typename Ops::Normed* xn, Real* out, Real* blocks,
                                             MixerFn&& mixer, FfnFn&& ffn, EmitFn&& emit,
                                             const Ops& ops = {}) {
  using Normed = typename Ops::Normed;
  const int64_t d = c.hidden;
  const bool attnres = c.residual == ResidualKind::AttnRes;
  // Ops may offer add_rmsnorm(p, out, w, xn, N, d, eps): p += out, then xn = RMSNorm(p)·w, in
  // one pass (a decode step's rows are short: two launches per sub-layer cost more than the
  // work). Without AttnRes every add of a sub-layer's output is followed by the norm of p for
  // the next sub-layer (or the final norm), so the walk fuses them; the emits in between see the
  // same p either way.
  constexpr bool kFusedAddNorm =
      requires(const Ops& o, Real* a, const Real* b, const WReal* w, Normed* y) {
        o.add_rmsnorm(a, b, w, y, int64_t(0), int64_t(0), 0.0f);
      };
  const bool fuse = kFusedAddNorm && !attnres;
  bool normed_ready = false;  // xn already holds RMSNorm(p) for the next norm site
  std::vector<const Real*> sources;
  sources.reserve(size_t(std::max(1, residual_num_blocks(c))) + 1);
  int sealed = 0;       // number of sealed block sums
  bool p_empty = false;  // p restarted after a seal and not yet written
  // AttnRes([blocks…, p]; site) → dst.
  auto mix = [&](const AttnResSiteWeightsT<WReal>& site, Real* dst) {
    sources.clear();
    for (int j = 0; j < sealed; ++j) sources.push_back(blocks + int64_t(j) * N * d);
    if (!p_empty) sources.push_back(p);
    ops.attnres(sources.data(), int(sources.size()), site.query, site.norm, dst, N, d, c.rms_eps);
  };
  emit("embeddings", -1, p);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeightsT<WReal>& L = W.layers[i];
    // --- token mixer ---
    const Real* attn_in = p;
    if (attnres) {
      if (sealed > 0) {
        mix(L.attn_site, x);
        attn_in = x;
      }
      if (i % c.attn_res_block == 0) {  // seal the running block (layer 0 seals the embedding)
        ops.copy(blocks + int64_t(sealed) * N * d, p, N * d);
        ++sealed;
        p_empty = true;
        if (attn_in == p) {  // the mixer input must survive p being restarted
          ops.copy(x, p, N * d);
          attn_in = x;
        }
      }
    }
    emit("attn_in_", i, attn_in);
    if (!normed_ready) ops.rmsnorm(attn_in, L.input_norm, xn, N, d, c.rms_eps);
    normed_ready = false;
    mixer(i, static_cast<const Normed*>(xn), out);
    emit("attn_out_", i, out);
    if (p_empty) {
      ops.copy(p, out, N * d);
      p_empty = false;
    } else if (fuse) {
      if constexpr (kFusedAddNorm) ops.add_rmsnorm(p, out, L.post_norm, xn, N, d, c.rms_eps);
      normed_ready = true;
    } else {
      ops.add(p, out, N * d);
    }
    // --- channel mixer ---
    const Real* mlp_in = p;
    if (attnres) {
      mix(L.ffn_site, x);
      mlp_in = x;
    }
    emit("mlp_in_", i, mlp_in);
    if (!normed_ready) ops.rmsnorm(mlp_in, L.post_norm, xn, N, d, c.rms_eps);
    normed_ready = false;
    ffn(i, static_cast<const Normed*>(xn), out);
    emit("mlp_out_", i, out);
    if (fuse) {
      // The next norm site: layer i+1's input norm, or the final norm.
      const WReal* next_norm =
          i + 1 < c.num_layers ? W.layers[size_t(i) + 1].input_norm : W.final_norm;
      if constexpr (kFusedAddNorm) ops.add_rmsnorm(p, out, next_norm, xn, N, d, c.rms_eps);
      normed_ready = true;
    } else {
      ops.add(p, out, N * d);
    }
    emit("layer_out_", i, p);
  }
  const Real* final_in = p;
  if (attnres) {
    mix(W.output_site, x);
    final_in = x;
  }
  emit("final_norm_in", -1, final_in);
  if (!normed_ready) ops.rmsnorm(final_in, W.final_norm, xn, N, d, c.rms_eps);
  if constexpr (std::is_same_v<Normed, Real>) emit("final_hidden", -1, xn);
  return xn;
}

}  // namespace dm
