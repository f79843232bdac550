// Capacity and cost arithmetic of a model config (plan.h).
#include "model/plan.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace dm {

namespace {

int64_t mla_layer_count(const ModelConfig& c) {
  return std::count(c.mixers.begin(), c.mixers.end(), MixerKind::MLA);
}

}  // namespace

double train_flops_per_token(const ModelConfig& c, int64_t active_params, int64_t seq_len) {
  const double attention = 3.0 * 2.0 * 2.0 * (double(seq_len) / 2.0) * double(c.mla.num_heads) *
                           double(c.mla.qk_nope_dim + c.mla.qk_rope_dim + c.mla.v_head_dim) *
                           double(mla_layer_count(c));
  return 6.0 * double(active_params) + attention;
}

TrainStateBytes train_state_bytes(const ModelWeights& layout) {
  TrainStateBytes b;
  for (const ParamEntry& e : layout.params) {
    const double n = double(e.numel());
    b.weights += 2.0 * n + (param_init_is_matrix(e.init) ? 0.0 : 4.0 * n);
    b.master += 4.0 * n;
    b.grads += 4.0 * n;
    b.optimizer += 8.0 * n;
  }
  return b;
}

DecodeStepBytes decode_step_bytes(const ModelWeights& W, int64_t batch, int64_t ctx) {
  const ModelConfig& c = W.cfg;
  const int64_t d = c.hidden, E = c.moe.num_experts, k = c.moe.top_k, F = c.moe.expert_ffn;
  const int64_t l = c.moe.latent_dim ? c.moe.latent_dim : d;
  // Routed-expert blocks [E, F, ℓ] / [E, ℓ, F] as arena offset ranges.
  std::vector<std::pair<int64_t, int64_t>> routed;
  int moe_layers = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.ffns[size_t(i)] != FfnKind::MoE) continue;
    ++moe_layers;
    const MoeWeights& m = W.layers[size_t(i)].moe;
    for (const float* p : {m.expert_gate, m.expert_up, m.expert_down})
      routed.push_back({W.offset_of(p), W.offset_of(p) + E * F * l});
  }
  DecodeStepBytes b;
  for (const ParamEntry& e : W.params) {
    const int64_t o = W.offset_of(e.data);
    if (e.data == W.embed) {
      b.weights += double(std::min<int64_t>(batch, c.vocab_size) * d) * 2;
      continue;
    }
    bool is_routed = false;
    for (const auto& r : routed) is_routed |= o >= r.first && o < r.second;
    if (is_routed) continue;
    b.weights += double(e.numel()) * (param_init_is_matrix(e.init) ? 2 : 4);
  }
  if (moe_layers > 0 && E > 0) {
    b.experts_per_layer =
        batch == 1 ? double(k)
                   : double(E) * (1.0 - std::pow(1.0 - double(k) / double(E), double(batch)));
    b.weights += double(moe_layers) * b.experts_per_layer * double(3 * F * l) * 2;
  }
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim;
  const int64_t tail_rows = std::max(c.kda.conv_kernel - 1, 0);
  const int64_t Wd = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[size_t(i)] == MixerKind::KDA)
      b.kda += double(batch) * 2.0 * (double(H * K * K) * 4 + double(3 * tail_rows * H * K) * 2);
    else
      b.cache += double(batch) * double(ctx + 1) * double(Wd) * 2;
  }
  return b;
}

double kda_state_bytes_per_sequence(const ModelConfig& c) {
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim;
  const int64_t kda_layers = c.num_layers - mla_layer_count(c);
  return double(kda_layers) *
         (double(H * K * K) * 4 + 3.0 * double(std::max(c.kda.conv_kernel - 1, 0) * H * K) * 2);
}

double latent_bytes_per_token(const ModelConfig& c) {
  return double(mla_layer_count(c)) * double(c.mla.kv_lora_rank + c.mla.qk_rope_dim) * 2;
}

double decode_cache_bytes(const ModelConfig& c, int64_t S, int64_t Lmax) {
  const int64_t P = (Lmax + 63) / 64;
  double bytes = double(S) * double(P) * 4 + double(S) * 4;
  bytes += double(S) * kda_state_bytes_per_sequence(c);
  bytes += double(S) * double(P * 64) * latent_bytes_per_token(c);
  if (c.mla.use_rope) bytes += double(Lmax) * double(c.mla.qk_rope_dim) * 4;
  return bytes;
}

}  // namespace dm
