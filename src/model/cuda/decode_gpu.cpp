// GpuDecoder: the decode step of infer/decode.cpp on the device (layout in decode_gpu.h).
//
// Per step, n active rows (slot slots[r] at position positions[r]):
//   KDA (model/kda.cpp kda_layer_decode):
//     raw_{q,k,v} = W_{q,k,v} x                                   [n, H·K] bf16
//     q, k, v = SiLU(conv(tail_slot ; raw)), tail_slot advances     (decode_kda_conv_step)
//     o = KDA recurrent step, T = 1, state in place (s0 == sT)     [n, H, K] bf16, fp32 state
//         with g = gate(W_f↑ W_f↓ x), β = sigmoid(W_β x) applied inside its kernel
//     y = W_o [RMSNorm(o_h)·o_norm ⊙ sigmoid(G x)_h]
//   MLA (model/mla_decode.cpp mla_layer_decode), Wd = kvl + rope:
//     q = W_qb RMSNorm(W_qa x) (or W_q x)                         [n, H, nope + rope] bf16
//     [c ; kr] = W_kva x → row [RMSNorm(c) ; RoPE(kr, pos)] written to the slot's page
//     q_abs[r, h] = [q_nope[r, h]·W_k,h | RoPE(q_rope[r, h], pos)]  [n, H, Wd] bf16
//     latent = softmax(scale·q_abs·rowsᵀ)·rows[:, :kvl] over positions 0..pos  (paged kernel)
//     o_h = W_v,h latent_h; o ← o ⊙ sigmoid(W_gate x); y = W_o o
//   FFN: layers.h moe_layer_forward_gpu (routed experts Gathered, or Grouped per the options) /
//   dense_ffn_forward_gpu on the n rows.
// Graph capture needs every op of record_step on the decoder's stream, asynchronous and
// allocation-free: the scratch is carved from the arena (host bookkeeping only), the residual
// stream's copies are cudaMemcpyAsync (DecodeResidualOps), GEMMs are cuBLASLt calls with the
// GemmContext's fixed workspace (algorithm lookup on the host), the MLA decode plan depends on n
// only, and kernels that need a slot, position or length read it from device memory.
#include "model/cuda/decode_gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/decode_gpu_internal.h"
#include "model/cuda/layers.h"
#include "model/cuda/moe_gpu_internal.h"
#include "model/cuda/residual_gpu.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/residual.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/mla_layer_ops.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_decode.h"
#include "ops/cuda/random_fill.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {

// One step's own buffers (before the sub-layers carve theirs).
struct DecodeStepBuffers {
  int32_t* meta = nullptr;       // [2n] ids | slots (uploaded)
  int32_t* positions = nullptr;  // [n]
  int32_t* seq_len = nullptr;    // [n]
  int32_t* row_table = nullptr;  // [n, P]
  float *p = nullptr, *x = nullptr, *out = nullptr;  // [n, d] residual stream
  uint16_t* xn = nullptr;                            // [n, d] normed rows
  float* blocks = nullptr;                           // [nb, n, d] AttnRes block sums
  float* logits = nullptr;                           // [n, V]
};

// A captured step for one (n, logits wanted) and the buffers it was captured with.
struct GpuDecoder::StepGraph {
  bool warmed = false;  // ran once directly (kernels loaded, GEMM algorithms cached)
  CapturedGraph graph;
  const int32_t* meta = nullptr;
  const float* logits = nullptr;
};

using namespace decode_detail;

namespace {

// GpuResidualOps with the stream copies queued on the decoder's stream (its copy is a
// synchronous legacy-stream cudaMemcpy, which a graph capture cannot contain).
struct DecodeResidualOps : GpuResidualOps {
  void copy(float* dst, const float* src, int64_t n) const {
    copy_device_to_device_async(dst, src, size_t(n) * sizeof(float), stream);
  }
};

bool any_moe(const ModelConfig& c) {
  return std::find(c.ffns.begin(), c.ffns.end(), FfnKind::MoE) != c.ffns.end();
}

DecodeStepBuffers carve_step(Carver& cv, const ModelConfig& c, int64_t n, int64_t P) {
  const int64_t d = c.hidden;
  DecodeStepBuffers b;
  b.meta = cv.take<int32_t>(2 * n);
  b.positions = cv.take<int32_t>(n);
  b.seq_len = cv.take<int32_t>(n);
  b.row_table = cv.take<int32_t>(n * P);
  b.p = cv.take<float>(n * d);
  b.x = cv.take<float>(n * d);
  b.out = cv.take<float>(n * d);
  b.xn = cv.take<uint16_t>(n * d);
  b.blocks = cv.take<float>(n * d * std::max(1, residual_num_blocks(c)));
  b.logits = cv.take<float>(n * int64_t(c.vocab_size));
  return b;
}

// Cache views in one fixed order (counted, then carved).
struct CacheViews {
  std::vector<float*> state;
  std::vector<uint16_t*> tail_q, tail_k, tail_v, pages;
  int32_t* page_table = nullptr;
  int32_t* lengths = nullptr;
  float *cos = nullptr, *sin = nullptr;
};

CacheViews carve_cache(Carver& cv, const ModelConfig& c, int64_t S, int64_t Lmax, int64_t P) {
  const size_t L = size_t(c.num_layers);
  CacheViews v;
  v.state.assign(L, nullptr);
  for (auto* t : {&v.tail_q, &v.tail_k, &v.tail_v, &v.pages}) t->assign(L, nullptr);
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  const int64_t tail_rows = std::max(c.kda.conv_kernel - 1, 0);
  const int64_t Wd = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  bool any_mla = false;
  for (size_t i = 0; i < L; ++i) {
    if (c.mixers[i] == MixerKind::KDA) {
      v.state[i] = cv.take<float>(S * H * K * K);
      for (auto* t : {&v.tail_q, &v.tail_k, &v.tail_v}) (*t)[i] = cv.take<uint16_t>(S * tail_rows * HK);
    } else {
      any_mla = true;
      v.pages[i] = cv.take<uint16_t>(S * P * kPageTokens * Wd);
    }
  }
  v.page_table = cv.take<int32_t>(S * P);
  v.lengths = cv.take<int32_t>(S);
  if (any_mla && rope_on(c.mla)) {
    v.cos = cv.take<float>(Lmax * (c.mla.qk_rope_dim / 2));
    v.sin = cv.take<float>(Lmax * (c.mla.qk_rope_dim / 2));
  }
  return v;
}

void check_decode_config(const ModelConfig& c, int64_t S, int64_t Lmax) {
  DM_CHECK(S > 0 && Lmax > 0, "GpuDecoder: need ≥ 1 slot and max length ≥ 1 (got ", S, ", ", Lmax,
           ")");
  DM_CHECK(Lmax <= c.max_context, "GpuDecoder: max length ", Lmax, " exceeds the context limit ",
           c.max_context);
  DM_CHECK(S <= 65535, "GpuDecoder: at most 65535 slots, got ", S);
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA) {
      DM_CHECK(c.kda.head_dim > 0 && c.kda.head_dim <= kKdaCudaRecurrentMaxK && c.kda.conv_kernel >= 1,
               "GpuDecoder: KDA head_dim ", c.kda.head_dim, " (≤ ", kKdaCudaRecurrentMaxK,
               ") / conv kernel ", c.kda.conv_kernel, " not supported");
    } else {
      const MlaConfig& m = c.mla;
      const int64_t Wd = m.kv_lora_rank + m.qk_rope_dim;
      DM_CHECK(m.kv_lora_rank % 8 == 0 && Wd % 8 == 0,
               "GpuDecoder: the paged MLA decode needs kv_lora and kv_lora + qk_rope to be "
               "multiples of 8 (got ", m.kv_lora_rank, ", ", Wd, ")");
      DM_CHECK(!rope_on(m) || m.qk_rope_dim % 2 == 0, "GpuDecoder: qk_rope_dim must be even");
    }
  }
}

}  // namespace

GpuDecodeOptions GpuDecodeOptions::from_env() {
  GpuDecodeOptions o;
  if (const char* v = std::getenv("DM_DECODE_GRAPHS")) {
    const std::string s = v;
    if (s == "0" || s == "off" || s == "false" || s == "no") o.graphs = false;
    else DM_CHECK(s.empty() || s == "1" || s == "on" || s == "true" || s == "yes",
                  "DM_DECODE_GRAPHS: expected 0/1 (off/on), got '", s, "'");
  }
  if (const char* v = std::getenv("DM_DECODE_MOE")) {
    const std::string s = v;
    if (s == "grouped") o.moe = Moe::Grouped;
    else if (s == "gathered") o.moe = Moe::Gathered;
    else DM_CHECK(s.empty() || s == "auto", "DM_DECODE_MOE: expected auto, grouped or gathered, "
                  "got '", s, "'");
  }
  o.fused_kda = env_flag("DM_KDA_DECODE_FUSED", o.fused_kda);
  o.mla_own_products = env_choice("DM_MLA_DECODE_PRODUCTS", {"ours", "cublas"}) == 0;
  return o;
}

GpuDecoder::GpuDecoder(const ModelWeights& host, int64_t num_slots, int64_t max_length,
                       const GpuDecodeOptions& options)
    : options_(options), owned_(std::make_unique<DeviceWeights>(host)), dw_(owned_.get()),
      S_(num_slots), max_length_(max_length) {
  init();
}

GpuDecoder::GpuDecoder(const DeviceWeights& dw, int64_t num_slots, int64_t max_length,
                       const GpuDecodeOptions& options)
    : options_(options), dw_(&dw), S_(num_slots), max_length_(max_length) {
  init();
}

GpuDecoder::~GpuDecoder() = default;

void GpuDecoder::init() {
  if (env_flag("DM_DECODE_PROFILE", false))
    marks_ = std::make_unique<StreamMarks>(4 * config().num_layers + 2);
  const ModelConfig& c = config();
  check_decode_config(c, S_, max_length_);
  has_moe_ = any_moe(c);
  if (has_moe_ && options_.moe == GpuDecodeOptions::Moe::Gathered) {
    const ExpertWeightsBf16 ew = moe_gpu::expert_weights(nullptr, nullptr, moe_shape(c));
    DM_CHECK(moe_decode_supported(S_, int(c.moe.top_k), ew), "GpuDecoder: the gathered MoE "
             "kernels do not take this shape (E=", ew.E, " k=", c.moe.top_k, " ℓ=", ew.Din,
             " F=", ew.F, "); use DM_DECODE_MOE=grouped");
  }
  pages_per_slot_ = (max_length_ + kPageTokens - 1) / kPageTokens;
  num_sms_ = device_multiprocessors();
  stream_ = std::make_unique<OwnedStream>();
  const int64_t S = S_, P = pages_per_slot_;

  Carver counter;
  carve_cache(counter, c, S, max_length_, P);
  cache_ = std::make_unique<DeviceArena>(counter.bytes);
  // Zero states, tails, pages and lengths at once: a fresh arena's empty view is its base.
  fill_zero(cache_->alloc_bytes(0), cache_->capacity());
  Carver carver{cache_.get()};
  CacheViews v = carve_cache(carver, c, S, max_length_, P);
  kda_state_ = std::move(v.state);
  kda_tail_q_ = std::move(v.tail_q);
  kda_tail_k_ = std::move(v.tail_k);
  kda_tail_v_ = std::move(v.tail_v);
  mla_pages_ = std::move(v.pages);
  page_table_ = v.page_table;
  lengths_ = v.lengths;
  rope_cos_ = v.cos;
  rope_sin_ = v.sin;
  // The static page table: slot s owns pages [s·P, (s+1)·P).
  std::vector<int32_t> table(size_t(S * P));
  for (int64_t i = 0; i < S * P; ++i) table[size_t(i)] = int32_t(i);
  copy_to_device(page_table_, table.data(), table.size() * sizeof(int32_t));
  if (rope_cos_) {
    // The CPU decode's own tables (fp32, YaRN amplitude folded in), uploaded once.
    const size_t count = size_t(max_length_ * (c.mla.qk_rope_dim / 2));
    std::vector<float> cos(count), sin(count);
    mla_rope_tables(c.mla, max_length_, cos.data(), sin.data());
    copy_to_device(rope_cos_, cos.data(), count * sizeof(float));
    copy_to_device(rope_sin_, sin.data(), count * sizeof(float));
  }

  // Scratch: the step's own buffers for S rows plus the largest sub-layer's.
  Carver step;
  carve_step(step, c, S, P);
  size_t layer = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    Carver mixer;
    if (c.mixers[i] == MixerKind::KDA) {
      carve_kda(mixer, c, S);
    } else {
      size_t ws = 0;
      for (int64_t n = 1; n <= S; ++n) ws = std::max(ws, attention_ws_bytes(c, n, P, num_sms_));
      carve_mla(mixer, c, S, ws);
    }
    layer = std::max({layer, mixer.bytes,
                      c.ffns[i] == FfnKind::MoE ? moe_layer_forward_gpu_bytes(c, S)
                                                : dense_ffn_forward_gpu_bytes(c, S)});
  }
  run_ = std::make_unique<GpuRun>(step.bytes + layer + (size_t(1) << 20), stream_->get());
  host_lengths_.assign(size_t(S), 0);
  active_slots_.resize(size_t(S));
  pinned_meta_ = std::make_unique<PinnedBuffer>(size_t(2 * S) * sizeof(int32_t));
  pinned_logits_ = std::make_unique<PinnedBuffer>(size_t(S) * size_t(c.vocab_size) * sizeof(float));
  graphs_.resize(size_t(2 * (S + 1)));
  // The zeroing and uploads above ran on the legacy default stream, which the decoder's
  // non-blocking stream does not wait for.
  synchronize();
}

MoeExpertsPath decode_moe_path(GpuDecodeOptions::Moe mode, int64_t n, int k,
                               const ExpertWeightsBf16& ew) {
  switch (mode) {
    case GpuDecodeOptions::Moe::Grouped:
      return MoeExpertsPath::Grouped;
    case GpuDecodeOptions::Moe::Gathered:
      return MoeExpertsPath::Gathered;
    case GpuDecodeOptions::Moe::Auto:
      break;
  }
  if (moe_decode_supported(n, k, ew) && moe_decode_preferred(n, k, ew.E))
    return MoeExpertsPath::Gathered;
  // Measured on the Kimi-Linear-48B shape (H200, ms per step): up to 2 rows per expert our
  // few-rows kernel (moe_grouped_few_rows.cu) is level with cuBLAS' grouped GEMM (batch 64:
  // 42.5–42.9 graphed against 40.7–43.6) and needs no host sync; at 8 rows per expert cuBLAS is
  // ahead (batch 256: 84.0 against 90.2), and below 64 rows our 128-row tiles lose to it.
  if (n * k <= 2 * ew.E) return MoeExpertsPath::Grouped;
  constexpr int64_t kOwnGroupedMinRows = 64;
  return n * k < kOwnGroupedMinRows * ew.E ? MoeExpertsPath::GroupedCublas
                                           : MoeExpertsPath::Grouped;
}

MoeExpertsPath GpuDecoder::moe_path(int64_t n) const {
  if (!has_moe_) return MoeExpertsPath::Gathered;  // no MoE layer: nothing synchronises
  const ModelConfig& c = config();
  return decode_moe_path(options_.moe, n, int(c.moe.top_k),
                         moe_gpu::expert_weights(nullptr, nullptr, moe_shape(c)));
}

// The grouped expert path synchronises (host offsets) unless it runs on our grouped kernels.
bool GpuDecoder::graphs_usable(MoeExpertsPath moe) const {
  if (!options_.graphs || graph_capture_failed_) return false;
  return moe == MoeExpertsPath::Gathered ||
         (moe == MoeExpertsPath::Grouped && moe_gemm_default_path() == MoeGemmPath::GroupedOwn);
}

std::string GpuDecoder::mode() const {
  const bool grouped_own = moe_gemm_default_path() == MoeGemmPath::GroupedOwn;
  std::string graphs;
  if (!options_.graphs) graphs = "CUDA graphs off";
  else if (graph_capture_failed_) graphs = "CUDA graphs off (a capture failed)";
  else if (has_moe_ && options_.moe == GpuDecodeOptions::Moe::Grouped && !grouped_own)
    graphs = "CUDA graphs off (the grouped MoE path synchronises)";
  else graphs = str_cat("CUDA graphs on (", graphs_captured_, " captured, ", graph_replays_,
                        " replays)");
  std::string moe = "no MoE layer";
  if (has_moe_) {
    const MoeConfig& m = config().moe;
    switch (options_.moe) {
      case GpuDecodeOptions::Moe::Grouped:
        moe = grouped_own ? "routed experts: our grouped GEMMs (no host sync)"
                          : "routed experts: grouped cuBLAS GEMMs (host sync per MoE layer)";
        break;
      case GpuDecodeOptions::Moe::Gathered:
        moe = "routed experts: gathered decode kernels (moe_decode.h) for every n";
        break;
      case GpuDecodeOptions::Moe::Auto:
        moe = str_cat("routed experts: gathered decode kernels while n·", m.top_k, " ≤ ",
                      m.num_experts, ", default grouped GEMMs while n·", m.top_k, " ≤ 2·",
                      m.num_experts, ", grouped cuBLAS GEMMs (no graphs) while n·", m.top_k,
                      " < 64·", m.num_experts, ", default grouped GEMMs above",
                      grouped_own ? " (ours: graphs)" : " (cuBLAS: no graphs)");
        break;
    }
  }
  std::string mla;
  const std::vector<MixerKind>& mixers = config().mixers;
  if (std::find(mixers.begin(), mixers.end(), MixerKind::MLA) != mixers.end()) {
    const MlaConfig& m = config().mla;
    const int Dk = int(m.kv_lora_rank + m.qk_rope_dim), Dv = int(m.kv_lora_rank);
    mla = mla_decode_uses_wgmma(Dk, Dv) ? "; MLA attention: warpgroup MMA"
                                        : "; MLA attention: mma.sync";
    mla += options_.mla_own_products
               ? str_cat(", per-head products: ours while n ≤ ", kMlaDecodeProjectionMaxRows)
               : ", per-head products: cuBLAS";
  }
  std::string kda;
  if (std::find(mixers.begin(), mixers.end(), MixerKind::KDA) != mixers.end())
    kda = options_.fused_kda &&
                  kda_decode_fused_applies(1, config().kda.head_dim, config().kda.head_dim,
                                           int(config().kda.conv_kernel))
              ? str_cat("; KDA: one fused kernel while n ≤ ", kKdaFusedMaxRows, ", five above")
              : "; KDA: five kernels";
  return graphs + "; " + moe + mla + kda;
}

int64_t GpuDecoder::length(int64_t slot) const {
  DM_CHECK(slot >= 0 && slot < S_, "GpuDecoder: slot ", slot, " outside [0, ", S_, ")");
  return host_lengths_[size_t(slot)];
}

size_t GpuDecoder::cache_bytes() const { return cache_->capacity(); }
size_t GpuDecoder::scratch_bytes() const { return run_->scratch.capacity(); }

void GpuDecoder::release(int64_t slot) {
  DM_CHECK(slot >= 0 && slot < S_, "GpuDecoder::release: slot ", slot, " outside [0, ", S_, ")");
  const ModelConfig& c = config();
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
  const int64_t tail = std::max(c.kda.conv_kernel - 1, 0) * HK;
  CUstream_st* stream = run_->stream;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] != MixerKind::KDA) continue;
    const size_t l = size_t(i);
    fill_zero_async(kda_state_[l] + slot * HK * c.kda.head_dim,
                    size_t(HK * c.kda.head_dim) * sizeof(float), stream);
    if (tail > 0)
      for (uint16_t* t : {kda_tail_q_[l], kda_tail_k_[l], kda_tail_v_[l]})
        fill_zero_async(t + slot * tail, size_t(tail) * sizeof(uint16_t), stream);
  }
  fill_zero_async(lengths_ + slot, sizeof(int32_t), stream);
  stream_synchronize(stream);  // a chunked prefill on the legacy stream may follow
  host_lengths_[size_t(slot)] = 0;
}

void GpuDecoder::fill_for_benchmark(int64_t slot, int64_t length, uint64_t seed) {
  DM_CHECK(slot >= 0 && slot < S_, "GpuDecoder::fill_for_benchmark: slot ", slot, " outside [0, ",
           S_, ")");
  DM_CHECK(length >= 0 && length <= max_length_, "GpuDecoder::fill_for_benchmark: length ", length,
           " outside [0, ", max_length_, "]");
  const ModelConfig& c = config();
  CUstream_st* stream = run_->stream;
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim, K = c.kda.head_dim;
  const int64_t tail = std::max(c.kda.conv_kernel - 1, 0) * HK;
  const int64_t Wd = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  // One stream per (layer, buffer); the counter is the element's index in the whole buffer.
  auto key = [&](int layer, int buffer) {
    return seed + 0x9E3779B97F4A7C15ull * uint64_t(4 * layer + buffer + 1);
  };
  for (int i = 0; i < c.num_layers; ++i) {
    const size_t l = size_t(i);
    if (c.mixers[i] == MixerKind::KDA) {
      const int64_t state = HK * K;  // [H, K, V] per slot
      random_uniform_f32(kda_state_[l] + slot * state, state, 0.01f, key(i, 0),
                         uint64_t(slot * state), stream);
      uint16_t* tails[3] = {kda_tail_q_[l], kda_tail_k_[l], kda_tail_v_[l]};
      for (int br = 0; br < 3; ++br)
        random_uniform_bf16(tails[br] + slot * tail, tail, 0.1f, key(i, 1 + br),
                            uint64_t(slot * tail), stream);
    } else {
      // The static page table gives slot s the pages [s·P, (s+1)·P), so its rows 0..length−1
      // are contiguous: [length, Wd] from the slot's first page.
      const int64_t first = slot * pages_per_slot_ * kPageTokens * Wd;
      random_uniform_bf16(mla_pages_[l] + first, length * Wd, 1.0f, key(i, 0), uint64_t(first),
                          stream);
    }
  }
  const int32_t len = int32_t(length);
  copy_to_device_async(lengths_ + slot, &len, sizeof(int32_t), stream);
  stream_synchronize(stream);  // `len` is a stack variable
  check_last_error("GpuDecoder::fill_for_benchmark");
  host_lengths_[size_t(slot)] = length;
}

int64_t GpuDecoder::stage_active(const int32_t* tokens, const int* active) {
  const int64_t V = config().vocab_size;
  int64_t n = 0;
  for (int64_t s = 0; s < S_; ++s) {
    if (active && !active[s]) continue;
    DM_CHECK(host_lengths_[size_t(s)] < max_length_, "GpuDecoder::step: slot ", s, " is full (",
             max_length_, " tokens)");
    DM_CHECK(tokens[s] >= 0 && tokens[s] < V, "GpuDecoder::step: token id ", tokens[s],
             " of slot ", s, " outside the vocabulary [0, ", V, ")");
    active_slots_[size_t(n++)] = int32_t(s);
  }
  int32_t* staged = pinned_meta_->as<int32_t>();  // ids [n] | slots [n]
  for (int64_t r = 0; r < n; ++r) {
    staged[r] = tokens[active_slots_[size_t(r)]];
    staged[n + r] = active_slots_[size_t(r)];
  }
  return n;
}

void GpuDecoder::step(const int32_t* tokens, float* logits, const int* active) {
  const int64_t V = config().vocab_size;
  const int64_t n = stage_active(tokens, active);
  if (n == 0) return;
  const float* rows = run_rows(n, logits != nullptr);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t s = active_slots_[size_t(r)];
    ++host_lengths_[size_t(s)];
    if (logits) std::memcpy(logits + s * V, rows + r * V, size_t(V) * sizeof(float));
  }
}

float* GpuDecoder::step_rows(const int32_t* tokens, const int* active) {
  const int64_t n = stage_active(tokens, active);
  if (n == 0) return nullptr;
  float* rows = run_rows(n, true);
  for (int64_t r = 0; r < n; ++r) ++host_lengths_[size_t(active_slots_[size_t(r)])];
  return rows;
}

void GpuDecoder::prefill(int64_t slot, const int32_t* ids, int64_t n, float* last_logits,
                         bool token_by_token, const KdaCheckpointTargets* checkpoints) {
  DM_CHECK(n > 0 && n <= max_length_, "GpuDecoder::prefill: prompt of ", n,
           " tokens does not fit the decoder (max length ", max_length_, ")");
  release(slot);
  const int64_t V = config().vocab_size;
  for (int64_t t = 0; t < n; ++t)
    DM_CHECK(ids[t] >= 0 && ids[t] < V, "GpuDecoder::prefill: token id ", ids[t],
             " at position ", t, " outside the vocabulary [0, ", V, ")");
  DM_CHECK(!(token_by_token && checkpoints && checkpoints->count > 0),
           "GpuDecoder::prefill: checkpoints need the chunked pass");
  if (!token_by_token && (n > 1 || (checkpoints && checkpoints->count > 0))) {
    forward_rows(slot, ids, n, 0, last_logits, checkpoints);
    return;
  }
  for (int64_t t = 0; t < n; ++t) {
    int32_t* staged = pinned_meta_->as<int32_t>();
    staged[0] = ids[t];
    staged[1] = int32_t(slot);
    const bool last = t + 1 == n && last_logits;
    const float* row = run_rows(1, last);
    if (last) std::memcpy(last_logits, row, size_t(V) * sizeof(float));
    ++host_lengths_[size_t(slot)];
  }
}

size_t GpuDecoder::mla_step_bytes(int64_t n) const {
  Carver cv;
  carve_mla(cv, config(), n, attention_ws_bytes(config(), n, pages_per_slot_, num_sms_));
  return cv.bytes;
}

void GpuDecoder::reserve_prefill(int64_t n) {
  if (n <= prefill_capacity_) return;
  const ModelConfig& c = config();
  const int64_t d = c.hidden, V = c.vocab_size, P = pages_per_slot_;
  const int64_t Wd = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  const int nb = std::max(1, residual_num_blocks(c));
  // Stream buffers p, x, out [n, d] fp32, xn [n, d] bf16, AttnRes blocks, ids, positions, slots,
  // sequence lengths, the per-row page tables [n, P], one kv_a row block [n, Wd] fp32, the last
  // row's logits [V].
  const size_t a = 256;
  auto r = [&](size_t b) { return (b + a - 1) / a * a; };
  const size_t act = 3 * r(size_t(n * d) * 4) + r(size_t(n * d) * 2) + r(size_t(n * d * nb) * 4) +
                     r(size_t(n) * 8) + 3 * r(size_t(n) * 4) + r(size_t(n * P) * 4) +
                     r(size_t(n * Wd) * 4) + r(size_t(V) * 4) + 4096;
  size_t layer = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    layer =
        std::max(layer, c.mixers[i] == MixerKind::KDA
                            ? kda_layer_forward_gpu_bytes(c, 1, n)
                            : std::max(mla_layer_forward_gpu_bytes(c, 1, n), mla_step_bytes(n)));
    layer = std::max(layer, c.ffns[i] == FfnKind::MoE ? moe_layer_forward_gpu_bytes(c, n)
                                                      : dense_ffn_forward_gpu_bytes(c, n));
  }
  prefill_run_.reset();
  prefill_act_.reset();
  // The legacy default stream: the layer forwards mix in synchronous copies (decode_gpu.h).
  prefill_run_ = std::make_unique<GpuRun>(layer + (size_t(1) << 20), nullptr);
  prefill_act_ = std::make_unique<DeviceArena>(act);
  prefill_capacity_ = n;
}

void GpuDecoder::extend(int64_t slot, const int32_t* ids, int64_t n, float* last_logits,
                        const KdaCheckpointTargets* checkpoints) {
  DM_CHECK(slot >= 0 && slot < S_, "GpuDecoder::extend: slot ", slot, " outside [0, ", S_, ")");
  const int64_t L = host_lengths_[size_t(slot)];
  if (L == 0) {
    prefill(slot, ids, n, last_logits, false, checkpoints);
    return;
  }
  DM_CHECK(n > 0 && L + n <= max_length_, "GpuDecoder::extend: ", n, " more tokens after ", L,
           " do not fit the decoder (max length ", max_length_, ")");
  const int64_t V = config().vocab_size;
  for (int64_t t = 0; t < n; ++t)
    DM_CHECK(ids[t] >= 0 && ids[t] < V, "GpuDecoder::extend: token id ", ids[t], " at position ",
             L + t, " outside the vocabulary [0, ", V, ")");
  forward_rows(slot, ids, n, L, last_logits, checkpoints);
}

void GpuDecoder::forward_rows(int64_t slot, const int32_t* ids, int64_t n, int64_t start,
                              float* last_logits, const KdaCheckpointTargets* checkpoints) {
  const ModelConfig& c = config();
  const ModelWeights& W = dw_->host();
  const int64_t d = c.hidden, V = c.vocab_size, P = pages_per_slot_;
  const MlaConfig& m = c.mla;
  const int64_t Wd = m.kv_lora_rank + m.qk_rope_dim;
  const int nb = std::max(1, residual_num_blocks(c));
  reserve_prefill(n);
  GpuRun& run = *prefill_run_;
  DeviceArena& act = *prefill_act_;
  act.reset();
  run.scratch.reset();
  CUstream_st* stream = run.stream;
  float* p = act.alloc<float>(size_t(n * d));
  float* x = act.alloc<float>(size_t(n * d));
  float* out = act.alloc<float>(size_t(n * d));
  uint16_t* xn = act.alloc<uint16_t>(size_t(n * d));
  float* blocks = act.alloc<float>(size_t(n * d * nb));
  int64_t* ids_dev = act.alloc<int64_t>(size_t(n));
  int32_t* positions = act.alloc<int32_t>(size_t(n));
  int32_t* slots = act.alloc<int32_t>(size_t(n));
  int32_t* seq_len = act.alloc<int32_t>(size_t(n));
  int32_t* row_table = act.alloc<int32_t>(size_t(n * P));
  float* kv_a = act.alloc<float>(size_t(n * Wd));
  float* logits = act.alloc<float>(size_t(V));
  {
    // Row t: position start + t of the slot, seeing start + t + 1 tokens through the slot's
    // static page table row.
    const size_t rows_n = static_cast<size_t>(n);
    std::vector<int64_t> ids64(ids, ids + n);
    std::vector<int32_t> pos(rows_n), slot_of(rows_n, int32_t(slot)), len(rows_n),
        table(rows_n * size_t(P));
    for (int64_t t = 0; t < n; ++t) {
      pos[size_t(t)] = int32_t(start + t);
      len[size_t(t)] = int32_t(start + t + 1);
      for (int64_t j = 0; j < P; ++j) table[size_t(t * P + j)] = int32_t(slot * P + j);
    }
    copy_to_device(ids_dev, ids64.data(), size_t(n) * sizeof(int64_t));
    copy_to_device(positions, pos.data(), pos.size() * sizeof(int32_t));
    copy_to_device(slots, slot_of.data(), slot_of.size() * sizeof(int32_t));
    copy_to_device(seq_len, len.data(), len.size() * sizeof(int32_t));
    copy_to_device(row_table, table.data(), table.size() * sizeof(int32_t));
  }
  Rows rows;
  rows.n = n;
  rows.slots = slots;
  rows.positions = positions;
  rows.seq_len = seq_len;
  rows.row_table = row_table;
  embedding_gather(dw_->bf16(W.embed), ids_dev, n, d, p, stream);
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
  const int64_t tail = std::max(c.kda.conv_kernel - 1, 0) * HK;
  // Checkpoints relative to this pass; the per-layer destination lists are filled per layer.
  const int cp_count = checkpoints ? checkpoints->count : 0;
  std::vector<int64_t> cp_tokens(static_cast<size_t>(cp_count));
  std::vector<float*> cp_state(static_cast<size_t>(cp_count));
  std::vector<uint16_t*> cp_tails(static_cast<size_t>(3 * cp_count));
  for (int j = 0; j < cp_count; ++j) cp_tokens[size_t(j)] = checkpoints->tokens[j] - start;
  auto mixer = [&](int i, const uint16_t* in, float* o) {
    const size_t l = size_t(i);
    if (c.mixers[i] == MixerKind::KDA) {
      KdaCarry carry;
      carry.state = kda_state_[l] + slot * HK * c.kda.head_dim;
      carry.tail[0] = kda_tail_q_[l] + slot * tail;
      carry.tail[1] = kda_tail_k_[l] + slot * tail;
      carry.tail[2] = kda_tail_v_[l] + slot * tail;
      carry.continues = start > 0;
      for (int j = 0; j < cp_count; ++j) {
        cp_state[size_t(j)] = checkpoints->state(j, i);
        for (int b = 0; b < 3; ++b) cp_tails[size_t(3 * j + b)] = checkpoints->tail(j, i, b);
      }
      carry.checkpoint_count = cp_count;
      carry.checkpoint_tokens = cp_tokens.data();
      carry.checkpoint_state = cp_state.data();
      carry.checkpoint_tails = cp_tails.data();
      kda_layer_forward_gpu(run, *dw_, W.layers[l].kda, in, o, 1, n, nullptr, &carry);
      return;
    }
    if (start > 0) {  // the new rows write their latents, then attend through the pages
      mla_step(run, i, in, o, rows);
      return;
    }
    const MlaWeights& w = W.layers[l].mla;
    mla_layer_forward_gpu(run, *dw_, w, in, o, 1, n);
    // The cache rows [RMSNorm(c) ; RoPE(kr)] of every prompt position, as decode writes them.
    linear(run, in, dw_->bf16(w.kv_a), n, d, Wd, kv_a, GemmOutType::F32);
    const bool rope = m.use_rope && m.qk_rope_dim > 0;
    decode_mla_write_latent(kv_a, dw_->f32(w.kv_a_norm), n, m.kv_lora_rank, m.qk_rope_dim,
                            m.latent_norm_eps, rope ? rope_cos_ : nullptr,
                            rope ? rope_sin_ : nullptr, positions, row_table, P, kPageTokens,
                            mla_pages_[l], stream);
  };
  auto ffn = [&](int i, const uint16_t* in, float* o) {
    if (c.ffns[i] == FfnKind::MoE)
      moe_layer_forward_gpu(run, *dw_, W.layers[i].moe, in, o, n);
    else
      dense_ffn_forward_gpu(run, *dw_, W.layers[i].dense, in, o, n);
  };
  const GpuResidualOps ops{dw_, stream};
  const uint16_t* final_hidden = residual_stack_forward<float>(
      c, W, n, p, x, xn, out, blocks, mixer, ffn, [](const char*, int, const float*) {}, ops);
  if (last_logits)
    linear(run, final_hidden + (n - 1) * d, dw_->bf16(W.lm_head), 1, d, V, logits,
           GemmOutType::F32);
  const int32_t length = int32_t(start + n);
  copy_to_device(lengths_ + slot, &length, sizeof(int32_t));
  synchronize();
  check_last_error("GpuDecoder chunked forward");
  if (last_logits) copy_to_host(last_logits, logits, size_t(V) * sizeof(float));
  host_lengths_[size_t(slot)] = start + n;
}

float* GpuDecoder::run_rows(int64_t n, bool want_logits) {
  const ModelConfig& c = config();
  GpuRun& run = *run_;
  CUstream_st* stream = run.stream;
  const int64_t V = c.vocab_size;
  run.scratch.reset();
  Carver cv{&run.scratch};
  const DecodeStepBuffers b = carve_step(cv, c, n, pages_per_slot_);
  // The step's only upload, ahead of the graph launch on the same stream.
  copy_to_device_async(b.meta, pinned_meta_->as<int32_t>(), size_t(2 * n) * sizeof(int32_t),
                       stream);
  const MoeExpertsPath moe = moe_path(n);
  if (graphs_usable(moe)) {
    std::unique_ptr<StepGraph>& slot = graphs_[size_t(2 * n + (want_logits ? 1 : 0))];
    if (!slot) slot = std::make_unique<StepGraph>();
    StepGraph& g = *slot;
    if (g.graph.ready()) {
      DM_CHECK(g.meta == b.meta && g.logits == b.logits,
               "GpuDecoder: step buffers moved since the graph was captured");
      g.graph.launch(stream);
      ++graph_replays_;
    } else if (!g.warmed) {
      record_step(b, n, want_logits, moe);
      g.warmed = true;
    } else {
      capture_step(g, b, n, want_logits, moe);
    }
  } else {
    record_step(b, n, want_logits, moe);
  }
  if (want_logits)
    copy_to_host_async(pinned_logits_->as<float>(), b.logits, size_t(n * V) * sizeof(float),
                       stream);
  stream_synchronize(stream);  // the step's one host synchronisation
  check_last_error("GpuDecoder step");
  if (marks_) add_step_phases();
  return want_logits ? pinned_logits_->as<float>() : nullptr;
}

void GpuDecoder::capture_step(StepGraph& g, const DecodeStepBuffers& b, int64_t n,
                              bool want_logits, MoeExpertsPath moe) {
  CUstream_st* stream = run_->stream;
  std::string why;
  bool captured = false;
  CapturedGraph::capture_begin(stream);
  try {
    record_step(b, n, want_logits, moe);
    captured = g.graph.capture_end(stream, &why);
  } catch (const std::exception& e) {
    CapturedGraph::capture_abort(stream);
    why = e.what();
  }
  if (captured) {
    g.meta = b.meta;
    g.logits = b.logits;
    ++graphs_captured_;
    g.graph.launch(stream);
    ++graph_replays_;
    return;
  }
  // Nothing of the captured work ran: run the step directly, and every later one too.
  graph_capture_failed_ = true;
  std::fprintf(stderr, "GpuDecoder: capturing the %lld-row decode step as a CUDA graph failed "
               "(%s); decoding without graphs\n", (long long)n, why.c_str());
  record_step(b, n, want_logits, moe);
}

void GpuDecoder::record_step(const DecodeStepBuffers& b, int64_t n, bool want_logits,
                             MoeExpertsPath moe) {
  const ModelConfig& c = config();
  const ModelWeights& W = dw_->host();
  GpuRun& run = *run_;
  CUstream_st* stream = run.stream;
  const int64_t d = c.hidden, V = c.vocab_size, P = pages_per_slot_;
  decode_prepare_rows(b.meta + n, n, lengths_, page_table_, P, b.positions, b.seq_len,
                      b.row_table, stream);
  embedding_gather(dw_->bf16(W.embed), b.meta, n, d, b.p, stream);

  Rows rows;
  rows.n = n;
  rows.slots = b.meta + n;
  rows.positions = b.positions;
  rows.seq_len = b.seq_len;
  rows.row_table = b.row_table;
  auto mark = [&](int m) {
    if (marks_) marks_->record(m, stream);
  };
  mark(0);
  const uint8_t skip = options_.skip;
  auto zero = [&](float* o) { fill_zero_async(o, size_t(n * d) * sizeof(float), stream); };
  auto mixer = [&](int i, const uint16_t* in, float* o) {
    mark(1 + 4 * i);
    if (c.mixers[i] == MixerKind::KDA)
      (skip & GpuDecodeOptions::kSkipKda) ? zero(o) : kda_step(i, in, o, rows);
    else
      (skip & GpuDecodeOptions::kSkipMla) ? zero(o) : mla_step(run, i, in, o, rows);
    mark(2 + 4 * i);
  };
  auto ffn = [&](int i, const uint16_t* in, float* o) {
    mark(3 + 4 * i);
    if (c.ffns[i] == FfnKind::MoE && (skip & GpuDecodeOptions::kSkipMoe))
      zero(o);
    else if (c.ffns[i] == FfnKind::MoE)
      moe_layer_forward_gpu(run, *dw_, W.layers[i].moe, in, o, n, nullptr, moe);
    else
      dense_ffn_forward_gpu(run, *dw_, W.layers[i].dense, in, o, n);
    mark(4 + 4 * i);
  };
  DecodeResidualOps ops;
  ops.dw = dw_;
  ops.stream = stream;
  const uint16_t* final_hidden = residual_stack_forward<float>(
      c, W, n, b.p, b.x, b.xn, b.out, b.blocks, mixer, ffn, [](const char*, int, const float*) {},
      ops);
  if (want_logits && !(skip & GpuDecodeOptions::kSkipLmHead))
    linear(run, final_hidden, dw_->bf16(W.lm_head), n, d, V, b.logits, GemmOutType::F32);
  mark(1 + 4 * c.num_layers);
}

void GpuDecoder::add_step_phases() {
  const ModelConfig& c = config();
  for (int i = 0; i < c.num_layers; ++i) {
    const double mixer = marks_->elapsed_ms(1 + 4 * i, 2 + 4 * i);
    const double ffn = marks_->elapsed_ms(3 + 4 * i, 4 + 4 * i);
    (c.mixers[size_t(i)] == MixerKind::KDA ? phase_sums_.kda : phase_sums_.mla) += mixer;
    (c.ffns[size_t(i)] == FfnKind::MoE ? phase_sums_.moe : phase_sums_.dense) += ffn;
  }
  phase_sums_.step += marks_->elapsed_ms(0, 1 + 4 * c.num_layers);
  ++phase_sums_.steps;
}

std::string GpuDecoder::profile_report() {
  if (!marks_ || phase_sums_.steps == 0) return {};
  const PhaseSums p = phase_sums_;
  phase_sums_ = PhaseSums{};
  const double us = 1e3 / double(p.steps);
  const double rest = p.step - p.kda - p.mla - p.moe - p.dense;
  char line[320];
  std::snprintf(line, sizeof(line),
                "decode profile (µs per step, %lld steps): KDA mixers %.1f, MLA mixers %.1f, "
                "MoE FFNs %.1f, dense FFNs %.1f, the rest %.1f, step %.1f",
                (long long)p.steps, p.kda * us, p.mla * us, p.moe * us, p.dense * us, rest * us,
                p.step * us);
  return line;
}

}  // namespace dm::cuda
