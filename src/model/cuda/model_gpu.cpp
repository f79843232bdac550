// GpuModel: the residual walk of model/residual.h with device ops, sub-layers from layers.h.
#include "model/cuda/model_gpu.h"

#include <algorithm>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/residual_gpu.h"
#include "model/residual.h"

namespace dm::cuda {
namespace {

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Activation arena: tokens, doc_start, p, x, out [N,d] fp32, xn [N,d] bf16, blocks [nb,N,d] fp32,
// logits [N,V] fp32.
// xn: [N,d] bf16, or fp32 in the fp32 mode.
size_t activation_arena_bytes(const ModelConfig& c, int64_t N, WeightPrecision precision) {
  const int64_t d = c.hidden;
  const int nb = std::max(1, residual_num_blocks(c));
  const size_t xn_elem = precision == WeightPrecision::F32 ? 4 : 2;
  return round_up(size_t(N) * 8) + round_up(size_t(N) * 4) + 3 * round_up(size_t(N * d) * 4) +
         round_up(size_t(N * d) * xn_elem) + round_up(size_t(N * d * nb) * 4) +
         round_up(size_t(N) * size_t(c.vocab_size) * 4) + 4096;
}

size_t scratch_arena_bytes(const ModelConfig& c, int64_t B, int64_t T, WeightPrecision p) {
  const int64_t N = B * T;
  size_t bytes = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    bytes =
        std::max(bytes, c.mixers[i] == MixerKind::KDA ? kda_layer_forward_gpu_bytes(c, B, T, p)
                                                      : mla_layer_forward_gpu_bytes(c, B, T, p));
    bytes = std::max(bytes, c.ffns[i] == FfnKind::MoE ? moe_layer_forward_gpu_bytes(c, N, p)
                                                      : dense_ffn_forward_gpu_bytes(c, N, p));
  }
  return bytes + (size_t(1) << 20);
}

}  // namespace

GpuModel::GpuModel(const ModelWeights& host, WeightPrecision precision) : dw_(host, precision) {}
GpuModel::~GpuModel() = default;

size_t GpuModel::activation_bytes() const {
  return (act_ ? act_->capacity() : 0) + (run_ ? run_->scratch.capacity() : 0);
}

void GpuModel::ensure_capacity(int64_t B, int64_t T) {
  if (run_ && B * T <= capacity_B_ * capacity_T_ && T <= capacity_T_ && B <= capacity_B_) return;
  B = std::max(B, capacity_B_);
  T = std::max(T, capacity_T_);
  const ModelConfig& c = config();
  run_.reset();
  act_.reset();
  act_ = std::make_unique<DeviceArena>(activation_arena_bytes(c, B * T, dw_.precision()));
  run_ = std::make_unique<GpuRun>(scratch_arena_bytes(c, B, T, dw_.precision()));
  capacity_B_ = B;
  capacity_T_ = T;
}

void GpuModel::forward(const int64_t* tokens, int64_t B, int64_t T, float* logits,
                       const int32_t* doc_start, std::vector<GpuForwardRouting>* routing) {
  if (dw_.precision() == WeightPrecision::F32)
    forward_impl<float>(tokens, B, T, logits, doc_start, routing, false);
  else
    forward_impl<uint16_t>(tokens, B, T, logits, doc_start, routing, false);
}

void GpuModel::forward_last(const int64_t* tokens, int64_t T, float* logits) {
  if (dw_.precision() == WeightPrecision::F32)
    forward_impl<float>(tokens, 1, T, logits, nullptr, nullptr, true);
  else
    forward_impl<uint16_t>(tokens, 1, T, logits, nullptr, nullptr, true);
}

template <typename A>
void GpuModel::forward_impl(const int64_t* tokens, int64_t B, int64_t T, float* logits,
                            const int32_t* doc_start, std::vector<GpuForwardRouting>* routing,
                            bool last_only) {
  const ModelConfig& c = config();
  const ModelWeights& W = dw_.host();
  DM_CHECK(B > 0 && T > 0, "forward (cuda): empty batch");
  DM_CHECK(T <= c.max_context, "forward (cuda): sequence length ", T,
           " exceeds the context limit ", c.max_context);
  for (int64_t n = 0; n < B * T; ++n)
    DM_CHECK(tokens[n] >= 0 && tokens[n] < c.vocab_size, "input_ids: token id ", tokens[n],
             " at position ", n, " outside the vocabulary [0, ", c.vocab_size, ")");
  ensure_capacity(B, T);
  GpuRun& run = *run_;
  DeviceArena& act = *act_;
  act.reset();
  run.scratch.reset();
  const int64_t N = B * T, d = c.hidden, V = c.vocab_size;
  int64_t* tokens_dev = act.alloc<int64_t>(size_t(N));
  copy_to_device(tokens_dev, tokens, size_t(N) * sizeof(int64_t));
  int32_t* doc_dev = nullptr;
  if (doc_start) {
    doc_dev = act.alloc<int32_t>(size_t(N));
    copy_to_device(doc_dev, doc_start, size_t(N) * sizeof(int32_t));
  }
  float* p = act.alloc<float>(size_t(N * d));
  float* x = act.alloc<float>(size_t(N * d));
  float* out = act.alloc<float>(size_t(N * d));
  A* xn = act.alloc<A>(size_t(N * d));
  float* blocks = act.alloc<float>(size_t(N * d * std::max(1, residual_num_blocks(c))));
  float* logits_dev = act.alloc<float>(size_t(N * V));

  embedding_gather(dw_.operand<A>(W.embed), tokens_dev, N, d, p, run.stream);
  if (routing) routing->clear();
  auto mixer = [&](int i, const A* in, float* o) {
    if (c.mixers[i] == MixerKind::KDA)
      kda_layer_forward_gpu(run, dw_, W.layers[i].kda, in, o, B, T, doc_dev);
    else
      mla_layer_forward_gpu(run, dw_, W.layers[i].mla, in, o, B, T, doc_dev);
  };
  auto ffn = [&](int i, const A* in, float* o) {
    if (c.ffns[i] != FfnKind::MoE) {
      dense_ffn_forward_gpu(run, dw_, W.layers[i].dense, in, o, N);
      return;
    }
    DeviceArenaScope scope(run.scratch);
    MoeRoutingDevice r;
    if (routing) r.idx = run.scratch.alloc<int32_t>(size_t(N) * size_t(c.moe.top_k));
    moe_layer_forward_gpu(run, dw_, W.layers[i].moe, in, o, N, routing ? &r : nullptr);
    if (routing) {
      GpuForwardRouting g;
      g.layer = i;
      g.idx.resize(size_t(N) * size_t(c.moe.top_k));
      synchronize();
      copy_to_host(g.idx.data(), r.idx, g.idx.size() * sizeof(int32_t));
      routing->push_back(std::move(g));
    }
  };
  const GpuResidualOpsT<A> ops{&dw_, run.stream};
  const A* final_hidden = residual_stack_forward<float>(
      c, W, N, p, x, xn, out, blocks, mixer, ffn, [](const char*, int, const float*) {}, ops);
  const int64_t rows = last_only ? 1 : N;
  linear(run, final_hidden + (N - rows) * d, dw_.operand<A>(W.lm_head), rows, d, V, logits_dev,
         GemmOutType::F32);
  synchronize();
  copy_to_host(logits, logits_dev, size_t(rows * V) * sizeof(float));
}

}  // namespace dm::cuda
