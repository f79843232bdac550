// Cached autoregressive decoding on one GPU (SPEC §5): the twin of infer/decode.h's decode_step
// with model/kda.cpp kda_layer_decode and model/mla_decode.cpp mla_layer_decode. One token per
// active slot per step, every op on the device: embedding → the residual walk of model/residual.h
// (GpuResidualOps) whose mixers are the recurrent KDA step on a carried fp32 state and absorbed
// MLA over a paged bf16 latent cache, FFNs from layers.h (token-wise, N = active rows) → final
// norm → LM head (fp32 logits, copied to the host).
//
// Cache (one DeviceArena, sized once for S slots of up to max_length tokens):
//   KDA layer i:  state [S, H, K, V] fp32; conv tails q, k, v [S, Kc−1, H·K] bf16 — the raw
//                 (pre-conv) projections of the slot's last Kc−1 tokens, as the CPU keeps them
//   MLA layer i:  pages [S·P, 64, kvl + rope] bf16, rows [RMSNorm(c) ; RoPE(kr)]
//   page_table [S, P] int32, static: slot s owns pages [s·P, (s+1)·P), P = ceil(max_length/64)
//   lengths [S] int32 (device; a host mirror is kept for the checks)
//   rope cos/sin [max_length, rope/2] fp32 when RoPE is on (the CPU's mla_rope_tables)
// Per-step temporaries (row bookkeeping, residual stream, sub-layer scratch, logits) come from
// the GpuRun's scratch arena, sized once for S rows.
//
// Prefill here is the prompt fed one token per step (correct and simple; a chunked prefill with
// the layers.h forwards writing the state, tails and pages comes later).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/cuda/gpu_run.h"

namespace dm::cuda {

class GpuDecoder {
 public:
  // Uploads its own bf16 + fp32 weight mirrors; `host` must outlive the decoder.
  GpuDecoder(const ModelWeights& host, int64_t num_slots, int64_t max_length);
  // Shares an existing upload; `dw` must outlive the decoder.
  GpuDecoder(const DeviceWeights& dw, int64_t num_slots, int64_t max_length);
  ~GpuDecoder();
  GpuDecoder(const GpuDecoder&) = delete;
  GpuDecoder& operator=(const GpuDecoder&) = delete;

  const ModelConfig& config() const { return dw_->config(); }
  int64_t num_slots() const { return S_; }
  int64_t max_length() const { return max_length_; }
  int64_t length(int64_t slot) const;  // tokens cached in the slot (the next token's position)

  // Empties slot `slot`: length 0, KDA state and conv tails zeroed (its pages are simply
  // overwritten by the next sequence).
  void release(int64_t slot);

  // One token per active slot: tokens [S] (host; read where active[s] != 0), each at its slot's
  // own position length(s) (0 starts a sequence); writes logits [S, V] (host, fp32) rows of the
  // active slots, others untouched, and advances their lengths. active == nullptr: every slot.
  // logits == nullptr: the LM head is skipped (prompt tokens whose logits nobody reads).
  void step(const int32_t* tokens, float* logits, const int* active = nullptr);

  // release(slot), then the prompt ids [n] in one pass of the chunked forward (model/cuda/
  // layers.h: KDA leaves its final state and conv tails in the slot, MLA writes every position's
  // latent row into the slot's pages); writes the last position's logits [V] (host).
  // token_by_token: feed the prompt one decode step at a time instead (the reference the chunked
  // pass is tested against).
  void prefill(int64_t slot, const int32_t* ids, int64_t n, float* last_logits,
               bool token_by_token = false);

  // BENCHMARK ONLY (bench/bench_cuda_decode.cpp): makes slot `slot` look as if `length` tokens
  // had been decoded, without running the model — prefilling 1M tokens would take minutes.
  // Sets the slot's length and fills, with device kernels (no host loop over the cache), every
  // MLA layer's latent rows 0..length−1 with U(−1, 1) bf16, every KDA state with U(−0.01, 0.01)
  // fp32 and the conv tails with U(−0.1, 0.1) bf16 (hash of (seed, layer, element)). The
  // contents are finite but meaningless (no prompt produces them): for timing steps only.
  void fill_for_benchmark(int64_t slot, int64_t length, uint64_t seed);

  size_t cache_bytes() const;    // the cache arena
  size_t scratch_bytes() const;  // the per-step scratch arena

 private:
  struct Rows;
  void init();
  void run_rows(const int32_t* ids, const int32_t* slots, int64_t n, float* row_logits);
  void prefill_chunked(int64_t slot, const int32_t* ids, int64_t n, float* last_logits);
  void kda_step(int layer, const uint16_t* xn, float* y, const Rows& rows);
  void mla_step(int layer, const uint16_t* xn, float* y, const Rows& rows);

  std::unique_ptr<DeviceWeights> owned_;
  const DeviceWeights* dw_ = nullptr;
  int64_t S_ = 0, max_length_ = 0, pages_per_slot_ = 0;
  int num_sms_ = 0;
  std::unique_ptr<DeviceArena> cache_;
  std::unique_ptr<GpuRun> run_;
  // Per layer (nullptr for the other mixer kind).
  std::vector<float*> kda_state_;
  std::vector<uint16_t*> kda_tail_q_, kda_tail_k_, kda_tail_v_;
  std::vector<uint16_t*> mla_pages_;
  int32_t* page_table_ = nullptr;
  int32_t* lengths_ = nullptr;
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr;
  std::vector<int64_t> host_lengths_;
  std::vector<int32_t> staging_;     // [2S] ids | slots uploaded per step
  std::vector<float> row_logits_;    // [S, V] host rows of one step
  // The chunked prefill's own resources, sized for the longest prompt seen (grown on demand).
  std::unique_ptr<GpuRun> prefill_run_;
  std::unique_ptr<DeviceArena> prefill_act_;
  int64_t prefill_capacity_ = 0;
};

}  // namespace dm::cuda
