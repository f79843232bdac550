#include "model/model.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/norm.h"

namespace dm {

void check_token_ids(const int64_t* tokens, int64_t n, int64_t vocab, const std::string& origin) {
  for (int64_t i = 0; i < n; ++i)
    DM_CHECK(tokens[i] >= 0 && tokens[i] < vocab, origin, ": token id ", tokens[i],
             " at position ", i, " is outside the vocabulary [0, ", vocab, ")");
}

Model::Model(std::unique_ptr<ModelWeights> w) : w_(std::move(w)) {}

std::unique_ptr<Model> Model::load(const std::string& dir) {
  return std::make_unique<Model>(weights_load(dir));
}

namespace {
int num_attnres_blocks(const ModelConfig& c) {
  if (c.residual != ResidualKind::AttnRes) return 0;
  return (c.num_layers + c.attn_res_block - 1) / c.attn_res_block + 1;  // sealed blocks incl. embedding
}
}  // namespace

size_t Model::activation_bytes(int64_t B, int64_t T) const {
  const ModelConfig& c = w_->cfg;
  const int64_t N = B * T, d = c.hidden;
  SizeCounter s;
  s.add<float>(N * d);  // p: residual stream / current block partial sum
  s.add<float>(N * d);  // x: sub-layer input (AttnRes mix)
  s.add<float>(N * d);  // normed input
  s.add<float>(N * d);  // sub-layer output
  s.add<float>(N * d * std::max(1, num_attnres_blocks(c)));  // sealed block sums
  size_t layer = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    layer = std::max(layer, c.mixers[i] == MixerKind::KDA ? kda_layer_workspace_bytes(c, B, T)
                                                           : mla_layer_workspace_bytes(c, B, T));
    layer = std::max(layer, c.ffns[i] == FfnKind::MoE ? moe_layer_workspace_bytes(c, N)
                                                      : dense_ffn_workspace_bytes(c, N));
  }
  return s.bytes + layer + 4096;
}

void Model::ensure_activations(int64_t B, int64_t T) {
  if (B * T <= act_B_ * act_T_ && T <= act_T_ && B <= act_B_) return;
  act_B_ = std::max(B, act_B_);
  act_T_ = std::max(T, act_T_);
  act_.reserve(activation_bytes(act_B_, act_T_), "activations");
}

void Model::forward(const int64_t* tokens, int64_t B, int64_t T, float* logits,
                    ForwardObserver* obs, const ForwardOptions& opt) {
  const ModelConfig& c = w_->cfg;
  const ModelWeights& W = *w_;
  DM_CHECK(B > 0 && T > 0, "forward: empty batch");
  DM_CHECK(T <= c.max_context, "forward: sequence length ", T, " exceeds the context limit ",
           c.max_context);
  check_token_ids(tokens, B * T, c.vocab_size, "input_ids");
  ensure_activations(B, T);
  act_.reset();
  const int64_t N = B * T, d = c.hidden;
  float* p = act_.alloc<float>(N * d);
  float* x = act_.alloc<float>(N * d);
  float* xn = act_.alloc<float>(N * d);
  float* out = act_.alloc<float>(N * d);
  const int nb = std::max(1, num_attnres_blocks(c));
  float* blocks = act_.alloc<float>(N * d * nb);
  std::vector<const float*> sources;
  sources.reserve(nb + 1);
  auto emit = [&](const std::string& name, const float* t) {
    if (obs) obs->on_tensor(name, t, N, d);
  };

  for (int64_t n = 0; n < N; ++n)
    std::memcpy(p + n * d, W.embed + tokens[n] * d, d * sizeof(float));
  emit("embeddings", p);

  const bool attnres = c.residual == ResidualKind::AttnRes;
  int sealed = 0;      // number of sealed block sums
  bool p_empty = false;
  // AttnRes([blocks…, p]; site) → dst; with no sealed blocks the mix is p itself.
  auto mix = [&](const AttnResSiteWeights& site, float* dst) {
    sources.clear();
    for (int j = 0; j < sealed; ++j) sources.push_back(blocks + int64_t(j) * N * d);
    if (!p_empty) sources.push_back(p);
    attnres_forward(sources.data(), int(sources.size()), site.query, site.norm, dst, nullptr, N, d,
                    c.rms_eps);
  };

  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeights& L = W.layers[i];
    const std::string si = std::to_string(i);
    // --- token mixer ---
    const float* attn_in = p;
    if (attnres) {
      if (sealed > 0) {
        mix(L.attn_site, x);
        attn_in = x;
      }
      if (i % c.attn_res_block == 0) {  // seal the running block (layer 0 seals the embedding)
        std::memcpy(blocks + int64_t(sealed) * N * d, p, N * d * sizeof(float));
        ++sealed;
        p_empty = true;
        if (attn_in == p) {  // the mixer input must survive p being restarted
          std::memcpy(x, p, N * d * sizeof(float));
          attn_in = x;
        }
      }
    }
    emit("attn_in_" + si, attn_in);
    rmsnorm_forward(attn_in, L.input_norm, xn, N, d, c.rms_eps);
    if (c.mixers[i] == MixerKind::KDA)
      kda_layer_forward(c, L.kda, xn, out, B, T, act_, KdaRunOptions{opt.kda_chunk});
    else
      mla_layer_forward(c, L.mla, xn, out, B, T, act_);
    emit("attn_out_" + si, out);
    if (p_empty) {
      std::memcpy(p, out, N * d * sizeof(float));
      p_empty = false;
    } else {
      add_inplace(p, out, N * d);
    }
    // --- channel mixer ---
    const float* mlp_in = p;
    if (attnres) {
      mix(L.ffn_site, x);
      mlp_in = x;
    }
    emit("mlp_in_" + si, mlp_in);
    rmsnorm_forward(mlp_in, L.post_norm, xn, N, d, c.rms_eps);
    if (c.ffns[i] == FfnKind::MoE) {
      const size_t mark = act_.mark();
      MoeRouting r;
      moe_layer_forward(c, L.moe, xn, out, N, act_, &r);
      if (obs) obs->on_router(i, r.idx, r.weight, N, c.moe.top_k);
      act_.release(mark);
    } else {
      dense_ffn_forward(c, L.dense, xn, out, N, act_);
    }
    emit("mlp_out_" + si, out);
    add_inplace(p, out, N * d);
    emit("layer_out_" + si, p);
  }

  const float* final_in = p;
  if (attnres) {
    mix(W.output_site, x);
    final_in = x;
  }
  emit("final_norm_in", final_in);
  rmsnorm_forward(final_in, W.final_norm, xn, N, d, c.rms_eps);
  emit("final_hidden", xn);
  linear(logits, xn, W.lm_head, N, d, c.vocab_size);
}

}  // namespace dm
