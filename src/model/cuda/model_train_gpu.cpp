// GpuTrainModel: the CPU training walk of model/model.cpp (forward recording each layer's input,
// fused LM head + cross-entropy, backward with per-layer recompute) on device ops.
#include "model/cuda/model_train_gpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/moe.h"
#include "model/residual.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_layer_ops.h"
#include "ops/cuda/residual_ops.h"
#include "train/balance.h"

namespace dm::cuda {
namespace {

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Rows per LM-head tile: the fp32 logits of one tile stay under DM_LM_HEAD_TILE_MIB (read once;
// default 512 MiB, plus half that for their bf16 gradient), at most 4096 rows. Each tile after the
// first adds its W_lm gradient into the fp32 [V, d] slot (262 MB at gpu_1b): at 256 MiB a
// 4096-token step took two tiles of 2097 rows, a B 4 step eight.
int64_t lm_head_rows(const ModelConfig& c, int64_t N) {
  static const int64_t tile_mib = [] {
    const char* env = std::getenv("DM_LM_HEAD_TILE_MIB");
    const int64_t mib = env && *env ? std::atoll(env) : 512;
    DM_CHECK(mib >= 1 && mib <= (int64_t(1) << 20), "DM_LM_HEAD_TILE_MIB must be 1…2^20, got '",
             env ? env : "", "'");
    return mib;
  }();
  const int64_t by_memory = std::max<int64_t>(1, (tile_mib << 20) / 4 / c.vocab_size);
  return std::max<int64_t>(1, std::min<int64_t>({N, by_memory, 4096}));
}

// Activation arena (see the carve in forward_backward): token ids, targets, doc_start; the
// layer inputs p_in [L, N, d] (layer i writes its output straight into p_in[i + 1]; a sealed
// AttnRes block is the p_in of the layer that sealed it, so blocks need no copies) and mixer
// outputs p_mid [L, N, d] (the stream after the mixer sub-layer, so the backward rebuilds a
// layer's record without running its mixer or FFN); the blocks' gradients [nb, N, d]; the last
// layer's output p, final_in, the current layer's record (x, y fp32; xn, yn bf16; without
// recompute the record is kept per layer in the kept arena instead), the stream gradients dp,
// dx, dxn, dh; final_h bf16; one LM-head tile (fp32 logits + bf16 gradient) and the per-tile
// cross-entropy results.
size_t train_activation_bytes(const ModelConfig& c, int64_t N) {
  const int64_t d = c.hidden, L = c.num_layers, V = c.vocab_size;
  const int64_t nb = std::max(1, residual_num_blocks(c));
  const int64_t rows = lm_head_rows(c, N), tiles = (N + rows - 1) / rows;
  const size_t row32 = round_up(size_t(N * d) * 4), row16 = round_up(size_t(N * d) * 2);
  size_t b = 2 * round_up(size_t(N) * 8) + round_up(size_t(N) * 4);
  b += 2 * size_t(L) * row32;                          // p_in, p_mid
  b += round_up(size_t(nb * N * d) * 4);               // dblocks
  b += 2 * row32 + 2 * row32 + 2 * row16;              // p, final_in; x, y; xn, yn
  b += 4 * row32 + row16;                              // dp, dx, dxn, dh; final_h
  if (c.residual == ResidualKind::AttnRes)  // the deferred AttnRes sites' douts, coefficients
    b += size_t(kAttnResFlushMaxSites) *
         (row32 + round_up(size_t(3 * kAttnResFlushMaxSources * N) * 4));
  b += round_up(size_t(rows * V) * 4) + round_up(size_t(rows * V) * 2);
  b += round_up(size_t(tiles) * sizeof(CrossEntropyDeviceResult));
  return b + 4096;
}

size_t train_scratch_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t N = B * T, d = c.hidden;
  size_t bytes = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA)
      bytes = std::max({bytes, kda_layer_forward_gpu_bytes(c, B, T),
                        kda_layer_backward_gpu_bytes(c, B, T)});
    else
      bytes = std::max({bytes, mla_layer_forward_gpu_bytes(c, B, T),
                        mla_layer_backward_gpu_bytes(c, B, T)});
    if (c.ffns[i] == FfnKind::MoE) {
      // The routing the sink reads sits below the layer's own scope.
      const size_t routing = round_up(size_t(N) * size_t(c.moe.num_experts) * 4) +
                             round_up(size_t(N) * 4) + round_up(size_t(N) * size_t(c.moe.top_k) * 4);
      bytes = std::max({bytes, routing + moe_layer_forward_gpu_bytes(c, N),
                        moe_layer_backward_gpu_bytes(c, N)});
    } else {
      bytes = std::max({bytes, dense_ffn_forward_gpu_bytes(c, N), dense_ffn_backward_gpu_bytes(c, N)});
    }
  }
  const int sources = std::max(1, residual_num_blocks(c)) + 1;
  bytes = std::max({bytes, round_up(attnres_backward_workspace_bytes(N, d, sources)),
                    round_up(attnres_norm_backward_workspace_bytes(N, d, sources)),
                    round_up(attnres_flush_workspace_bytes(N, d, kAttnResFlushMaxSites)),
                    round_up(rmsnorm_backward_workspace_bytes(N, d)),
                    round_up(embedding_backward_workspace_bytes(N, c.vocab_size)),
                    round_up(cross_entropy_workspace_bytes(lm_head_rows(c, N)))});
  return bytes + (size_t(1) << 20);
}

// DM_GPU_TRAIN_PROFILE=1: synchronise around every phase of the step and print where the time
// went (one line per step on stderr). Off by default: the synchronisations cost time.
class PhaseTimer {
 public:
  PhaseTimer() : on_(env_flag("DM_GPU_TRAIN_PROFILE", false)) {}
  template <typename F>
  void operator()(const char* phase, CUstream_st* stream, F&& f) {
    if (!on_) {
      f();
      return;
    }
    stream_synchronize(stream);
    const auto t0 = std::chrono::steady_clock::now();
    f();
    stream_synchronize(stream);
    ms_[phase] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  void report() {
    if (!on_) return;
    std::string line = "[gpu train profile, ms]";
    for (const auto& [k, v] : ms_) line += " " + k + " " + std::to_string(int(v * 10) / 10.0).substr(0, 6);
    std::fprintf(stderr, "%s\n", line.c_str());
    ms_.clear();
  }

 private:
  bool on_;
  std::map<std::string, double> ms_;
};

}  // namespace

GpuTrainModel::GpuTrainModel(ModelWeights& host)
    : host_(host), dw_(host), grads_(host), master_(host) {
  master_.upload(host);
  // Gradients written whole by products the first of which can store (DeviceParamArena
  // store-first ranges): the step neither zeroes them nor reads them back. The experts' stacked
  // gradients (one grouped product each per micro-batch; moe_gpu_backward.cpp takes the marks)
  // and every matrix whose gradient only linear_backward's grads overload writes (its first
  // product this step stores; the LM head's row tiles then accumulate). The dense FFN's and the
  // shared experts' products accumulate, and a tied LM head shares the embedding's scattered
  // gradient: those stay zeroed.
  const ModelConfig& c = host.cfg;
  const MoeShape s = moe_shape(c);
  std::map<const float*, int64_t> numel;
  for (const auto& e : host.params) numel[e.data] = e.numel();
  auto store_first = [&](const float* p) {
    if (p) grads_.add_store_first(p, numel.at(p));
  };
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeights& L = host.layers[size_t(i)];
    if (c.mixers[size_t(i)] == MixerKind::KDA) {
      const KdaWeights& k = L.kda;
      for (const float* p :
           {k.q_proj, k.k_proj, k.v_proj, k.f_a, k.f_b, k.b_proj, k.g_a, k.g_b, k.g_full, k.o_proj})
        store_first(p);
    } else {
      const MlaWeights& m = L.mla;
      for (const float* p : {m.q_a, m.q_b, m.q_proj, m.kv_a, m.kv_b, m.gate, m.o_proj})
        store_first(p);
    }
    if (c.ffns[size_t(i)] != FfnKind::MoE) continue;
    const MoeWeights& w = L.moe;
    grads_.add_store_first(w.expert_gate, s.E * s.F * s.latent);
    grads_.add_store_first(w.expert_up, s.E * s.F * s.latent);
    grads_.add_store_first(w.expert_down, s.E * s.latent * s.F);
    for (const float* p : {w.router, w.latent_down, w.latent_up}) store_first(p);
  }
  if (host.lm_head != host.embed) store_first(host.lm_head);
}
GpuTrainModel::~GpuTrainModel() = default;

size_t GpuTrainModel::activation_bytes() const {
  return (act_ ? act_->capacity() : 0) + (run_ ? run_->scratch.capacity() : 0) +
         (kept_ ? kept_->capacity() : 0);
}

// One KDA layer's kept forward internals, rounded to the arena's alignment.
size_t kda_kept_stride(const ModelConfig& c, int64_t B, int64_t T) {
  return round_up(kda_layer_kept_gpu_bytes(c, B, T));
}

// One MLA layer's kept forward activations and lse, rounded likewise.
size_t mla_kept_stride(const ModelConfig& c, int64_t B, int64_t T) {
  return round_up(mla_layer_kept_gpu_bytes(c, B, T));
}

// One MoE layer's kept forward internals, rounded likewise.
size_t moe_kept_stride(const ModelConfig& c, int64_t N) {
  return round_up(moe_layer_kept_gpu_bytes(c, N));
}

// One dense FFN layer's kept g and u, rounded likewise.
size_t dense_kept_stride(const ModelConfig& c, int64_t N) {
  return round_up(dense_ffn_kept_gpu_bytes(c, N));
}

// One layer's kept residual record without recompute: the normed rows xn, yn (bf16) and, with
// AttnRes, the mixes x, y (fp32; with the plain residual x and y are p_in and p_mid).
size_t record_kept_stride(const ModelConfig& c, int64_t N) {
  const size_t rows = size_t(N * c.hidden);
  return 2 * round_up(rows * 2) +
         (c.residual == ResidualKind::AttnRes ? 2 * round_up(rows * 4) : 0);
}

// The kept arena without recompute: every KDA, MLA, MoE and dense FFN layer's forward internals
// and every layer's residual record (so the backward rebuilds nothing).
size_t train_kept_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  int kda_layers = 0, mla_layers = 0, moe_layers = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    kda_layers += c.mixers[size_t(i)] == MixerKind::KDA;
    mla_layers += c.mixers[size_t(i)] == MixerKind::MLA;
    moe_layers += c.ffns[size_t(i)] == FfnKind::MoE;
  }
  const int dense_layers = c.num_layers - moe_layers;
  return size_t(kda_layers) * kda_kept_stride(c, B, T) +
         size_t(mla_layers) * mla_kept_stride(c, B, T) +
         size_t(moe_layers) * moe_kept_stride(c, B * T) +
         (dense_layers ? size_t(dense_layers) * dense_kept_stride(c, B * T) : 0) +
         size_t(c.num_layers) * record_kept_stride(c, B * T) + 256;
}

size_t train_activation_plan_bytes(const ModelConfig& c, int64_t B, int64_t T, bool recompute) {
  return train_activation_bytes(c, B * T) + train_scratch_bytes(c, B, T) +
         (recompute ? 0 : train_kept_bytes(c, B, T));
}

void GpuTrainModel::ensure_kept(int64_t B, int64_t T) {
  const size_t bytes = train_kept_bytes(config(), B, T);
  if (kept_ && kept_->capacity() >= bytes) return;
  kept_.reset();
  kept_ = std::make_unique<DeviceArena>(bytes);
}

void GpuTrainModel::ensure_capacity(int64_t B, int64_t T) {
  if (act_ && B <= capacity_B_ && T <= capacity_T_) return;
  B = std::max(B, capacity_B_);
  T = std::max(T, capacity_T_);
  const ModelConfig& c = config();
  run_.reset();
  act_.reset();
  act_ = std::make_unique<DeviceArena>(train_activation_bytes(c, B * T));
  run_ = std::make_unique<GpuRun>(train_scratch_bytes(c, B, T));
  capacity_B_ = B;
  capacity_T_ = T;
}

GpuRun& GpuTrainModel::run() {
  if (!run_) run_ = std::make_unique<GpuRun>(0);
  return *run_;
}

void GpuTrainModel::download_weights() { master_.download(host_); }

void GpuTrainModel::upload_router_biases() {
  const ModelConfig& c = config();
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.ffns[i] != FfnKind::MoE) continue;
    const float* bias = host_.layers[size_t(i)].moe.router_bias;
    if (!bias) continue;
    const int64_t E = c.moe.num_experts;
    copy_to_device(master_.at(bias), bias, size_t(E) * sizeof(float));
    dw_.upload_param(bias, E, run_ ? run_->stream : nullptr);
  }
}

void GpuTrainModel::report_routing_histogram(int layer, const MoeRoutingDevice& r, int64_t N,
                                             int64_t E, int64_t k, const QbHistogramRange& range,
                                             RoutingSink& sink) {
  DM_CHECK(range.bins >= 1 && range.high > range.low, "GPU training: layer ", layer,
           ": the balance sink asked for a bad histogram (", range.bins, " bins over [",
           range.low, ", ", range.high, "))");
  CUstream_st* stream = run().stream;
  const size_t count_bytes = size_t(E) * size_t(range.bins) * sizeof(int64_t);
  const size_t bytes = count_bytes + 256 + size_t(E) * sizeof(int64_t);
  if (!route_stats_ || route_stats_->capacity() < bytes)
    route_stats_ = std::make_unique<DeviceArena>(bytes + (bytes >> 2));
  route_stats_->reset();
  int64_t* counts = route_stats_->alloc<int64_t>(size_t(E) * size_t(range.bins));
  int64_t* loads = route_stats_->alloc<int64_t>(size_t(E));
  fill_zero_async(counts, count_bytes, stream);
  fill_zero_async(loads, size_t(E) * sizeof(int64_t), stream);
  qb_histogram_accumulate(r.scores, r.cutoff, N, int(E), range, counts, stream);
  expert_loads_accumulate(r.idx, N, int(k), int(E), loads, stream);
  route_counts_.resize(size_t(E) * size_t(range.bins));
  route_loads_.resize(size_t(E));
  copy_to_host_async(route_counts_.data(), counts, count_bytes, stream);
  copy_to_host_async(route_loads_.data(), loads, size_t(E) * sizeof(int64_t), stream);
  stream_synchronize(stream);
  sink.on_routing_histogram(layer, route_counts_.data(), route_loads_.data(), N, int(E), int(k));
}

TrainStepResult GpuTrainModel::forward_backward(const int64_t* tokens, const int64_t* targets,
                                                const int32_t* doc_start, int64_t B, int64_t T,
                                                double loss_scale, RoutingSink* sink,
                                                bool recompute) {
  const ModelConfig& c = config();
  const ModelWeights& W = host_;
  DM_CHECK(B > 0 && T > 0, "train (cuda): empty batch");
  DM_CHECK(T <= c.max_context, "train (cuda): sequence length ", T,
           " exceeds the context limit ", c.max_context);
  check_token_ids(tokens, B * T, c.vocab_size, "tokens");
  ensure_capacity(B, T);
  // Without recompute, each KDA, MLA and MoE layer's forward keeps its internals for its
  // backward (mixer_kept: the KDA or MLA layer's).
  std::vector<void*> mixer_kept(static_cast<size_t>(c.num_layers), nullptr);
  moe_kept_.resize(size_t(c.num_layers));
  std::vector<MoeKept*> moe_kept(static_cast<size_t>(c.num_layers), nullptr);
  std::vector<uint16_t*> dense_kept(static_cast<size_t>(c.num_layers), nullptr);  // g, u
  if (!recompute) {
    ensure_kept(B, T);
    kept_->reset();
    for (int i = 0; i < c.num_layers; ++i) {
      mixer_kept[size_t(i)] =
          kept_->alloc_bytes(c.mixers[size_t(i)] == MixerKind::KDA ? kda_kept_stride(c, B, T)
                                                                   : mla_kept_stride(c, B, T));
      if (c.ffns[size_t(i)] == FfnKind::MoE) {
        MoeKept& m = moe_kept_[size_t(i)];
        m.bytes = moe_kept_stride(c, B * T);
        m.device = kept_->alloc_bytes(m.bytes);
        moe_kept[size_t(i)] = &m;
      } else if (env_flag("DM_TRAIN_KEEP_GLU_INPUTS", true)) {  // moe_gpu.cpp keep_glu_inputs
        dense_kept[size_t(i)] =
            static_cast<uint16_t*>(kept_->alloc_bytes(dense_kept_stride(c, B * T)));
      }
    }
  }
  GpuRun& run = *run_;
  CUstream_st* stream = run.stream;
  DeviceArena& act = *act_;
  act.reset();
  run.scratch.reset();
  const int64_t N = B * T, d = c.hidden, V = c.vocab_size, L = c.num_layers;
  const size_t nd = size_t(N * d);
  const bool attnres = c.residual == ResidualKind::AttnRes;
  const int nb = std::max(1, residual_num_blocks(c));
  const float eps = c.rms_eps;

  // ---- carve (train_activation_bytes counts the same) ----
  int64_t* tokens_dev = act.alloc<int64_t>(size_t(N));
  int64_t* targets_dev = act.alloc<int64_t>(size_t(N));
  int32_t* doc_dev = act.alloc<int32_t>(size_t(N));
  // Rows of one document each (every start 0) need no document masks: nullptr lets the MLA
  // layers take cuDNN's fused attention, which has none.
  const bool packed = doc_start && std::any_of(doc_start, doc_start + N,
                                               [](int32_t s) { return s != 0; });
  // The batch goes up through page-locked staging, queued behind whatever the stream still runs
  // (the previous step's AdamW): a copy from pageable memory would first wait for the stream to
  // drain, leaving the GPU idle while this host code queues the forward (0.4 ms a step). The
  // staging is free again when the previous call ended with the host waiting for its loss; one
  // that threw after queuing its copies is waited for here.
  const size_t token_bytes = size_t(N) * sizeof(int64_t), doc_bytes = size_t(N) * sizeof(int32_t);
  if (upload_pending_) stream_synchronize(stream);
  upload_pending_ = false;
  if (!upload_ || upload_->bytes() < 2 * token_bytes + doc_bytes)
    upload_ = std::make_unique<PinnedBuffer>(2 * token_bytes + doc_bytes);
  uint8_t* staging = upload_->as<uint8_t>();
  std::memcpy(staging, tokens, token_bytes);
  std::memcpy(staging + token_bytes, targets, token_bytes);
  copy_to_device_async(tokens_dev, staging, token_bytes, stream);
  copy_to_device_async(targets_dev, staging + token_bytes, token_bytes, stream);
  if (packed) {
    std::memcpy(staging + 2 * token_bytes, doc_start, doc_bytes);
    copy_to_device_async(doc_dev, staging + 2 * token_bytes, doc_bytes, stream);
  } else {
    doc_dev = nullptr;
  }
  upload_pending_ = true;
  std::vector<float*> p_in(static_cast<size_t>(L));
  for (auto& q : p_in) q = act.alloc<float>(nd);
  std::vector<float*> p_mids(static_cast<size_t>(L));
  for (auto& q : p_mids) q = act.alloc<float>(nd);
  float* dblocks = act.alloc<float>(nd * size_t(nb));
  float* p = act.alloc<float>(nd);
  float* final_in = act.alloc<float>(nd);
  float* x = act.alloc<float>(nd);
  float* y = act.alloc<float>(nd);
  uint16_t* xn = act.alloc<uint16_t>(nd);
  uint16_t* yn = act.alloc<uint16_t>(nd);
  float* dp = act.alloc<float>(nd);
  float* dx = act.alloc<float>(nd);
  float* dxn = act.alloc<float>(nd);
  float* dh = act.alloc<float>(nd);
  uint16_t* final_h = act.alloc<uint16_t>(nd);
  const int64_t lm_rows = lm_head_rows(c, N), tiles = (N + lm_rows - 1) / lm_rows;
  float* logits = act.alloc<float>(size_t(lm_rows * V));
  uint16_t* dlogits = act.alloc<uint16_t>(size_t(lm_rows * V));
  auto* ce_results = act.alloc<CrossEntropyDeviceResult>(size_t(tiles));
  std::vector<float*> keep_dout, keep_coef;  // the deferred AttnRes sites' slots
  if (attnres)
    for (int k = 0; k < kAttnResFlushMaxSites; ++k) {
      keep_dout.push_back(act.alloc<float>(nd));
      keep_coef.push_back(act.alloc<float>(size_t(3 * kAttnResFlushMaxSources * N)));
    }

  // Each layer's record: the mixes x, y (fp32) and the normed rows xn, yn (bf16) its backward
  // reads. With recompute the layers share one record, rebuilt in the backward; without, each
  // layer keeps its own in the kept arena. x is p_in itself where there is nothing to mix (the
  // plain residual, and AttnRes before the first seal), y likewise p_mid with the plain residual.
  struct Record {
    float *x, *y;
    uint16_t *xn, *yn;
  };
  std::vector<Record> record(static_cast<size_t>(L), Record{x, y, xn, yn});
  if (!recompute)
    for (auto& r : record) {
      r.xn = kept_->alloc<uint16_t>(nd);
      r.yn = kept_->alloc<uint16_t>(nd);
      if (attnres) {
        r.x = kept_->alloc<float>(nd);
        r.y = kept_->alloc<float>(nd);
      }
    }
  for (int i = 0; i < L; ++i) {
    if (!attnres || i == 0) record[size_t(i)].x = p_in[size_t(i)];
    if (!attnres) record[size_t(i)].y = p_mids[size_t(i)];
  }

  PhaseTimer timer;
  std::vector<int> sealed_in(static_cast<size_t>(L), 0);
  std::vector<char> p_empty_in(static_cast<size_t>(L), 0);
  std::vector<const float*> blocks(static_cast<size_t>(nb), nullptr);  // sealed: p_in of a layer
  std::vector<const float*> srcs;
  std::vector<float*> dsrcs;
  auto sources_of = [&](int n_sealed, bool with_p, const float* pp) {
    srcs.clear();
    for (int j = 0; j < n_sealed; ++j) srcs.push_back(blocks[size_t(j)]);
    if (with_p) srcs.push_back(pp);
  };
  auto dsources_of = [&](int n_sealed, bool with_p) {
    dsrcs.clear();
    for (int j = 0; j < n_sealed; ++j) dsrcs.push_back(dblocks + size_t(j) * nd);
    if (with_p) dsrcs.push_back(dp);
  };
  auto copy = [&](float* dst, const float* src) {
    copy_device_to_device_async(dst, src, nd * sizeof(float), stream);
  };
  auto zero = [&](void* dst, size_t bytes) { fill_zero_async(dst, bytes, stream); };

  // Runs layer i's forward from p_in[i] (with sealed_in[i], p_empty_in[i]) leaving its record
  // and p_mids[i], its output in `out`; returns the sealed count after it. `report`: hand the
  // MoE routing to the sink (first pass only). `rebuild` (the backward, with recompute): only the
  // record, from the p_mids[i] the forward saved: neither the mixer (its backward recomputes what
  // it needs) nor the FFN (its output is not part of the record) runs again.
  // A site's mix and the RMSNorm after it in one kernel (attnres_forward_norm):
  // DM_ATTNRES_NORM_OUT (read at each step) = 1 (default) | 0 (attnres_forward, then
  // rmsnorm_to_bf16: the A/B reference).
  const bool norm_out = env_choice("DM_ATTNRES_NORM_OUT", {"1", "0"}) == 0;
  auto mix_norm = [&](const AttnResSiteWeights& site, float* mixed, const float* w,
                      uint16_t* normed) {
    // srcs set by the caller.
    if (norm_out) {
      attnres_forward_norm(srcs.data(), int(srcs.size()), dw_.f32(site.query), dw_.f32(site.norm),
                           mixed, dw_.f32(w), normed, N, d, eps, eps, stream);
      return;
    }
    attnres_forward(srcs.data(), int(srcs.size()), dw_.f32(site.query), dw_.f32(site.norm), mixed,
                    N, d, eps, stream);
    rmsnorm_to_bf16(mixed, dw_.f32(w), normed, N, d, eps, stream);
  };
  auto layer_forward = [&](int i, float* out, bool report, bool rebuild) {
    const LayerWeights& Lw = W.layers[size_t(i)];
    const float* in = p_in[size_t(i)];
    float* p_mid = p_mids[size_t(i)];
    const Record& rec = record[size_t(i)];
    int s = sealed_in[size_t(i)];
    bool empty = p_empty_in[size_t(i)];
    // The residual-stream work around the sub-layers (AttnRes mixes, seals, norms).
    const char* residual = rebuild ? "res_rebuild" : "res_fwd";
    timer(residual, stream, [&] {
      if (attnres && s > 0) {
        sources_of(s, !empty, in);
        mix_norm(Lw.attn_site, rec.x, Lw.input_norm, rec.xn);
      } else {  // rec.x is `in` itself (layer 0: nothing sealed yet; or the plain residual)
        rmsnorm_to_bf16(rec.x, dw_.f32(Lw.input_norm), rec.xn, N, d, eps, stream);
      }
      if (attnres && i % c.attn_res_block == 0) {  // seal: blocks[s] = in
        blocks[size_t(s)] = in;
        ++s;
        empty = true;
      }
    });
    if (!rebuild) {
      // p_mid = [in +] Mixer(xn): the residual add in the mixer's output GEMM.
      const float* residual = empty ? nullptr : in;
      if (c.mixers[size_t(i)] == MixerKind::KDA)
        timer("kda_fwd", stream, [&] {
          kda_layer_forward_gpu(run, dw_, Lw.kda, rec.xn, p_mid, B, T, doc_dev, nullptr,
                                mixer_kept[size_t(i)], residual);
        });
      else
        timer("mla_fwd", stream, [&] {
          mla_layer_forward_gpu(run, dw_, Lw.mla, rec.xn, p_mid, B, T, doc_dev,
                                mixer_kept[size_t(i)], residual);
        });
    }
    timer(residual, stream, [&] {
      if (attnres) {
        sources_of(s, true, p_mid);
        mix_norm(Lw.ffn_site, rec.y, Lw.post_norm, rec.yn);
      } else {  // rec.y is p_mid itself
        rmsnorm_to_bf16(rec.y, dw_.f32(Lw.post_norm), rec.yn, N, d, eps, stream);
      }
    });
    if (rebuild) return s;
    if (c.ffns[size_t(i)] == FfnKind::MoE) {
      DeviceArenaScope scope(run.scratch);
      MoeRoutingDevice r;
      const bool want = report && sink;
      const int64_t E = c.moe.num_experts, k = c.moe.top_k;
      if (want) {
        r.scores = run.scratch.alloc<float>(size_t(N * E));
        r.cutoff = run.scratch.alloc<float>(size_t(N));
        r.idx = run.scratch.alloc<int32_t>(size_t(N * k));
      }
      // The layer's output out = p_mid + FFN(yn): the add in the FFN's output GEMM.
      timer("moe_fwd", stream, [&] {
        moe_layer_forward_gpu(run, dw_, Lw.moe, rec.yn, out, N, want ? &r : nullptr,
                              MoeExpertsPath::Grouped, moe_kept[size_t(i)], p_mid);
      });
      double low = 0, high = 0;
      int bins = 0;
      if (want && sink->routing_histogram_range(i, &low, &high, &bins)) {
        report_routing_histogram(i, r, N, E, k, QbHistogramRange{low, high, bins}, *sink);
      } else if (want) {
        route_scores_.resize(size_t(N * E));
        route_cutoff_.resize(size_t(N));
        route_idx_.resize(size_t(N * k));
        copy_to_host_async(route_scores_.data(), r.scores, route_scores_.size() * 4, stream);
        copy_to_host_async(route_cutoff_.data(), r.cutoff, route_cutoff_.size() * 4, stream);
        copy_to_host_async(route_idx_.data(), r.idx, route_idx_.size() * 4, stream);
        stream_synchronize(stream);
        sink->on_routing(i, route_scores_.data(), route_cutoff_.data(), route_idx_.data(), N,
                         int(E), int(k));
      }
    } else {
      timer("ffn_fwd", stream, [&] {
        dense_ffn_forward_gpu(run, dw_, Lw.dense, rec.yn, out, N, p_mid, dense_kept[size_t(i)]);
      });
    }
    return s;
  };

  // ---- forward, recording each layer's input ----
  embedding_gather(dw_.bf16(W.embed), tokens_dev, N, d, p_in[0], stream);
  int sealed = 0;
  bool p_empty = false;
  for (int i = 0; i < L; ++i) {
    sealed_in[size_t(i)] = sealed;
    p_empty_in[size_t(i)] = p_empty;
    sealed = layer_forward(i, i + 1 < L ? p_in[size_t(i) + 1] : p, true, false);
    p_empty = false;
  }
  if (attnres) {
    sources_of(sealed, true, p);
    mix_norm(W.output_site, final_in, W.final_norm, final_h);
  } else {
    copy(final_in, p);
    rmsnorm_to_bf16(final_in, dw_.f32(W.final_norm), final_h, N, d, eps, stream);
  }

  // ---- fused LM head + cross-entropy, tile by tile ----
  timer("lm_head", stream, [&] {
    DeviceArenaScope scope(run.scratch);
    void* ce_ws = run.scratch.alloc_bytes(cross_entropy_workspace_bytes(lm_rows));
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * lm_rows, rows = std::min(lm_rows, N - r0);
      linear(run, final_h + r0 * d, dw_.bf16(W.lm_head), rows, d, V, logits, GemmOutType::F32);
      cross_entropy_forward_backward(logits, targets_dev + r0, dlogits, rows, V, loss_scale,
                                     ce_results + t, ce_ws, stream);  // bf16 gradient
      // dh rows = dlogits·W_lm (written), dW_lm += dlogitsᵀ·final_h.
      linear_backward(run, final_h + r0 * d, dw_.bf16(W.lm_head), dlogits, rows, d, V, dh + r0 * d,
                      GemmOutType::F32, 0.0f, grads_, W.lm_head);
    }
  });

  // ---- backward ----
  zero(dp, nd * 4);
  zero(dblocks, nd * size_t(nb) * 4);
  auto norm_backward = [&](const float* in, const float* w, const float* dy_rows) {
    // ∂L/∂in of in → RMSNorm(in)·w given dy_rows: stored in dx for the AttnRes mix's backward,
    // added straight to dp with the plain residual (in is the stream there); the norm weight's
    // gradient accumulates.
    DeviceArenaScope scope(run.scratch);
    void* ws = run.scratch.alloc_bytes(rmsnorm_backward_workspace_bytes(N, d));
    timer("norm_bwd", stream, [&] {
      rmsnorm_backward(in, dw_.f32(w), dy_rows, attnres ? dx : dp, grads_.at(w), N, d, eps, ws,
                       stream, /*accumulate_dx=*/!attnres);
    });
  };
  auto mix_backward = [&](const AttnResSiteWeights& site) {
    // srcs / dsrcs set by the caller; dx is the gradient of the mix's output.
    DeviceArenaScope scope(run.scratch);
    void* ws = run.scratch.alloc_bytes(attnres_backward_workspace_bytes(N, d, int(srcs.size())));
    timer("attnres_bwd", stream, [&] {
      attnres_backward(srcs.data(), int(srcs.size()), dw_.f32(site.query), dw_.f32(site.norm), dx,
                       dsrcs.data(), grads_.at(site.query), grads_.at(site.norm), N, d, eps, ws,
                       stream);
    });
  };
  // A site's RMSNorm backward and its mix's backward in one pass (attnres_norm_backward):
  // DM_ATTNRES_NORM_IN (read at each step) = 1 (default) | 0 (rmsnorm_backward into dx, then
  // attnres_backward: the A/B reference).
  const bool norm_in =
      env_choice("DM_ATTNRES_NORM_IN", {"1", "0"}) == 0 && d <= kAttnResNormInMaxWidth;
  // The sealed blocks' updates of a region's sites deferred to one attnres_flush before the
  // block's seal (each dblocks row read and written once a region instead of once a site):
  // DM_ATTNRES_DEFER (read at each step) = 1 (default) | 0.
  const bool defer = norm_in && attnres && d % 4 == 0 && nb <= kAttnResFlushMaxSources &&
                     env_choice("DM_ATTNRES_DEFER", {"1", "0"}) == 0;
  std::vector<AttnResFlushSite> pending;
  auto flush = [&]() {
    if (pending.empty()) return;
    const int J = pending.front().deferred;
    std::vector<const float*> fsrc(blocks.begin(), blocks.begin() + J);
    std::vector<float*> fdsrc;
    for (int j = 0; j < J; ++j) fdsrc.push_back(dblocks + size_t(j) * nd);
    DeviceArenaScope scope(run.scratch);
    void* ws = run.scratch.alloc_bytes(attnres_flush_workspace_bytes(N, d, int(pending.size())));
    timer("attnres_flush", stream, [&] {
      attnres_flush(pending.data(), int(pending.size()), fsrc.data(), fdsrc.data(), J, N, d, ws,
                    stream);
    });
    pending.clear();
  };
  auto norm_mix_backward = [&](const float* in, const float* w, const float* dy_rows,
                               const AttnResSiteWeights& site, bool with_p) {
    // srcs / dsrcs set by the caller (with_p: p last); in = the mix's output, dy_rows = ∂L/∂ its
    // normed rows.
    if (!norm_in) {
      norm_backward(in, w, dy_rows);
      mix_backward(site);
      return;
    }
    // The sealed sources (all but p) are deferred.
    const int sealed_here = int(srcs.size()) - 1;
    if (defer && with_p && sealed_here >= 1) {
      if (pending.size() == size_t(kAttnResFlushMaxSites) ||
          (!pending.empty() && pending.front().deferred != sealed_here))
        flush();
      const size_t slot = pending.size();
      DeviceArenaScope scope(run.scratch);
      void* ws =
          run.scratch.alloc_bytes(attnres_norm_backward_workspace_bytes(N, d, int(srcs.size())));
      timer("attnres_norm_bwd", stream, [&] {
        attnres_norm_backward_deferred(
            srcs.data(), int(srcs.size()), sealed_here, dw_.f32(site.query), dw_.f32(site.norm), in,
            dw_.f32(w), dy_rows, dsrcs.data(), grads_.at(site.query), grads_.at(site.norm),
            grads_.at(w), N, d, eps, eps, keep_dout[slot], keep_coef[slot], ws, stream);
      });
      AttnResFlushSite f;
      f.dout = keep_dout[slot];
      f.coef = keep_coef[slot];
      f.deferred = sealed_here;
      f.query = dw_.f32(site.query);
      f.norm_w = dw_.f32(site.norm);
      f.dquery = grads_.at(site.query);
      f.dnorm_w = grads_.at(site.norm);
      pending.push_back(f);
      return;
    }
    DeviceArenaScope scope(run.scratch);
    void* ws =
        run.scratch.alloc_bytes(attnres_norm_backward_workspace_bytes(N, d, int(srcs.size())));
    timer("attnres_norm_bwd", stream, [&] {
      attnres_norm_backward(srcs.data(), int(srcs.size()), dw_.f32(site.query), dw_.f32(site.norm),
                            in, dw_.f32(w), dy_rows, dsrcs.data(), grads_.at(site.query),
                            grads_.at(site.norm), grads_.at(w), N, d, eps, eps, ws, stream);
    });
  };
  if (attnres) {
    sources_of(sealed, true, p);
    dsources_of(sealed, true);
    norm_mix_backward(final_in, W.final_norm, dh, W.output_site, true);
  } else {
    norm_backward(final_in, W.final_norm, dh);  // adds to dp
  }
  for (int i = int(L) - 1; i >= 0; --i) {
    const LayerWeights& Lw = W.layers[size_t(i)];
    const int s_in = sealed_in[size_t(i)];
    if (recompute) layer_forward(i, nullptr, false, true);  // rebuild layer i's record
    const Record& rec = record[size_t(i)];
    const float* p_mid = p_mids[size_t(i)];
    const bool seals = attnres && i % c.attn_res_block == 0;
    const int s_mid = s_in + (seals ? 1 : 0);
    // FFN sub-layer: p_out = p_mid + FFN(norm(y)), y = mix(blocks[0..s_mid), p_mid).
    if (c.ffns[size_t(i)] == FfnKind::MoE)
      timer("moe_bwd", stream, [&] {
        moe_layer_backward_gpu(run, dw_, grads_, Lw.moe, rec.yn, dp, dxn, N, moe_kept[size_t(i)]);
      });
    else
      timer("ffn_bwd", stream, [&] {
        dense_ffn_backward_gpu(run, dw_, grads_, Lw.dense, rec.yn, dp, dxn, N,
                               dense_kept[size_t(i)]);
      });
    if (attnres) {
      sources_of(s_mid, true, p_mid);
      dsources_of(s_mid, true);
      norm_mix_backward(rec.y, Lw.post_norm, dxn, Lw.ffn_site, true);
    } else {
      norm_backward(rec.y, Lw.post_norm, dxn);  // adds to dp
    }
    // Mixer sub-layer: p_mid = [p_in +] Mixer(norm(x)); dp is now ∂L/∂p_mid = ∂L/∂(mixer out).
    if (c.mixers[size_t(i)] == MixerKind::KDA)
      timer("kda_bwd", stream, [&] {
        kda_layer_backward_gpu(run, dw_, grads_, Lw.kda, rec.xn, dp, dxn, B, T, doc_dev,
                               mixer_kept[size_t(i)]);
      });
    else
      timer("mla_bwd", stream, [&] {
        mla_layer_backward_gpu(run, dw_, grads_, Lw.mla, rec.xn, dp, dxn, B, T, doc_dev,
                               mixer_kept[size_t(i)]);
      });
    if (seals) {  // p restarted after sealing: p_in's gradient is what its sealed copy collected
      flush();    // the deferred sites' updates of blocks 0..s_in
      // That slot becomes dp (no copy): below this layer no site reads or writes slot s_in (their
      // sources are blocks 0..s_in−1 and p), and the next step zeroes every slot again.
      dp = dblocks + size_t(s_in) * nd;
    }
    if (attnres && s_in > 0) {  // x = mix(blocks[0..s_in), p_in)
      sources_of(s_in, !p_empty_in[size_t(i)], p_in[size_t(i)]);
      dsources_of(s_in, !p_empty_in[size_t(i)]);
      norm_mix_backward(rec.x, Lw.input_norm, dxn, Lw.attn_site, !p_empty_in[size_t(i)]);
    } else if (attnres) {  // layer 0: x is p_in itself (after the seal's copy into dp)
      norm_backward(rec.x, Lw.input_norm, dxn);
      add_inplace(dp, dx, int64_t(nd), stream);
    } else {
      norm_backward(rec.x, Lw.input_norm, dxn);  // adds to dp
    }
  }
  flush();  // nothing is left here (layer 0 seals), unless the config says otherwise
  {  // deterministic: rows of one token summed in position order
    DeviceArenaScope scope(run.scratch);
    void* ws = run.scratch.alloc_bytes(embedding_backward_workspace_bytes(N, V));
    timer("embed_bwd", stream, [&] { embedding_backward(tokens_dev, dp, N, d, V, grads_.at(W.embed), ws, stream); });
  }

  std::vector<CrossEntropyDeviceResult> ce(static_cast<size_t>(tiles));
  copy_to_host_async(ce.data(), ce_results, ce.size() * sizeof(CrossEntropyDeviceResult), stream);
  stream_synchronize(stream);
  upload_pending_ = false;
  check_last_error("train (cuda): forward_backward");
  timer.report();
  TrainStepResult res;
  for (const auto& r : ce) {
    res.loss_sum += r.loss_sum;
    res.count += r.count;
    res.correct += r.correct;
  }
  return res;
}

}  // namespace dm::cuda
