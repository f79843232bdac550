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

template <typename Real, typename MixerFn, typename FfnFn, typename EmitFn>
Real* residual_stack_forward(const ModelConfig& c, const ModelWeightsT<Real>& W, int64_t N, Real* p,
                             Real* x, Real* xn, Real* out, Real* blocks, MixerFn&& mixer, FfnFn&& ffn,
                             EmitFn&& emit) {
  const int64_t d = c.hidden;
  const bool attnres = c.residual == ResidualKind::AttnRes;
  std::vector<const Real*> sources;
  sources.reserve(size_t(std::max(1, residual_num_blocks(c))) + 1);
  int sealed = 0;       // number of sealed block sums
  bool p_empty = false;  // p restarted after a seal and not yet written
  // AttnRes([blocks…, p]; site) → dst.
  auto mix = [&](const AttnResSiteWeightsT<Real>& site, Real* dst) {
    sources.clear();
    for (int j = 0; j < sealed; ++j) sources.push_back(blocks + int64_t(j) * N * d);
    if (!p_empty) sources.push_back(p);
    attnres_forward<Real>(sources.data(), int(sources.size()), site.query, site.norm, dst, nullptr,
                          N, d, c.rms_eps);
  };
  emit("embeddings", -1, p);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeightsT<Real>& L = W.layers[i];
    // --- token mixer ---
    const Real* attn_in = p;
    if (attnres) {
      if (sealed > 0) {
        mix(L.attn_site, x);
        attn_in = x;
      }
      if (i % c.attn_res_block == 0) {  // seal the running block (layer 0 seals the embedding)
        std::copy(p, p + N * d, blocks + int64_t(sealed) * N * d);
        ++sealed;
        p_empty = true;
        if (attn_in == p) {  // the mixer input must survive p being restarted
          std::copy(p, p + N * d, x);
          attn_in = x;
        }
      }
    }
    emit("attn_in_", i, attn_in);
    rmsnorm_forward<Real>(attn_in, L.input_norm, xn, N, d, c.rms_eps);
    mixer(i, static_cast<const Real*>(xn), out);
    emit("attn_out_", i, out);
    if (p_empty) {
      std::copy(out, out + N * d, p);
      p_empty = false;
    } else {
      for (int64_t k = 0; k < N * d; ++k) p[k] += out[k];
    }
    // --- channel mixer ---
    const Real* mlp_in = p;
    if (attnres) {
      mix(L.ffn_site, x);
      mlp_in = x;
    }
    emit("mlp_in_", i, mlp_in);
    rmsnorm_forward<Real>(mlp_in, L.post_norm, xn, N, d, c.rms_eps);
    ffn(i, static_cast<const Real*>(xn), out);
    emit("mlp_out_", i, out);
    for (int64_t k = 0; k < N * d; ++k) p[k] += out[k];
    emit("layer_out_", i, p);
  }
  const Real* final_in = p;
  if (attnres) {
    mix(W.output_site, x);
    final_in = x;
  }
  emit("final_norm_in", -1, final_in);
  rmsnorm_forward<Real>(final_in, W.final_norm, xn, N, d, c.rms_eps);
  emit("final_hidden", -1, xn);
  return xn;
}

}  // namespace dm
