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
// A step has no host synchronisation until its logits are copied back: the token ids and slots
// of the n active rows go up from a pinned buffer with one cudaMemcpyAsync; every kernel reads
// slots, positions and lengths from device memory (the per-row KDA state index included); the
// MoE layers route on the device and run their experts through the gathered kernels of
// ops/cuda/moe_decode.h (no per-layer dispatch plan on the host). So the whole step —
// embedding → layers → final norm → LM head — is captured once per distinct n (and per "logits
// wanted") as a CUDA graph on the decoder's own stream, the second time that n is seen (the first
// runs directly and warms the GEMM algorithm cache and kernel loading), and replayed after that;
// the row → slot mapping is uploaded data, not part of the graph. Buffers carved for n rows sit
// at the same scratch addresses every step, which the replay relies on.
// Switches (GpuDecodeOptions, defaults from the environment): DM_DECODE_GRAPHS=0 runs every
// step directly; DM_DECODE_MOE=grouped uses the grouped-GEMM experts (a host synchronisation
// per MoE layer, so no graphs either), =gathered forces the gathered kernels for every n.
//
// Prefill (prefill()) runs the chunked layer forwards of layers.h on the legacy default stream
// (they use synchronous copies) and synchronises the device at its end; every public call
// returns with the decoder's work finished, so the two streams never overlap.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/cuda/gpu_run.h"
#include "model/cuda/layers.h"
#include "ops/cuda/graph.h"
#include "ops/cuda/stream_marks.h"

namespace dm::cuda {

struct DecodeStepBuffers;  // decode_gpu.cpp

struct GpuDecodeOptions {
  // Replay the step as a CUDA graph per number of active rows. Env DM_DECODE_GRAPHS=0 (or off,
  // false, no) turns it off.
  bool graphs = true;
  // Routed experts of the MoE layers. Auto: the gathered kernels (ops/cuda/moe_decode.h) while
  // moe_decode_preferred(n, k, E) holds (mean rows per expert ≤ 1), the default grouped GEMMs
  // (moe_gemm_default_path: ours, graphed) up to 2, cuBLAS' grouped GEMMs below 64 rows per
  // expert (host sync, no graph), the default grouped GEMMs above; Grouped / Gathered force the
  // default grouped GEMMs or the gathered kernels for every n. Env
  // DM_DECODE_MOE=auto|grouped|gathered.
  enum class Moe : uint8_t { Auto, Grouped, Gathered };
  Moe moe = Moe::Auto;
  // A KDA layer's conv, gates, recurrent step and gated norm in one launch (decode_ops.h
  // decode_kda_fused_step) where it applies (head dim 128, n ≤ 4 rows); off, five kernels. Env
  // DM_KDA_DECODE_FUSED=0|1.
  bool fused_kda = true;
  // The absorbed MLA step's per-head products (query absorption + RoPE, value projection) by our
  // kernels up to kMlaDecodeProjectionMaxRows rows (decode_ops.h), else strided-batched cuBLAS
  // GEMMs. Env DM_MLA_DECODE_PRODUCTS=ours|cublas.
  bool mla_own_products = true;
  // Timing attribution only (bench_cuda_decode --skip): leave a part out of every step, its
  // output zeroed (a memset) so the rest still sees finite values; the tokens are wrong. The
  // time a part costs in a real step is the full step's time minus the step's without it.
  enum Skip : uint8_t { kSkipKda = 1, kSkipMla = 2, kSkipMoe = 4, kSkipLmHead = 8 };
  uint8_t skip = 0;
  // The defaults above, overridden by the environment (a bad value is an error).
  static GpuDecodeOptions from_env();
};

// The routed-expert path of a decode step of n rows (GpuDecoder::moe_path for an MoE model):
// pure host arithmetic over the options, k and the expert shapes.
MoeExpertsPath decode_moe_path(GpuDecodeOptions::Moe mode, int64_t n, int k,
                               const ExpertWeightsBf16& ew);

// Where a prefill or extend leaves KDA checkpoints (the prefix cache, infer/cuda/
// decode_backend_gpu.cpp): after tokens[i] tokens of the slot's sequence (absolute positions,
// strictly increasing, each a multiple of 64 after the pass's start and at most its end), model
// layer `layer`'s state goes to state(i, layer) [H, K, K] fp32 and its conv tail of branch b
// (q, k, v) to tail(i, layer, b) [Kc−1, H·K] bf16, host or device memory.
struct KdaCheckpointTargets {
  int count = 0;
  const int64_t* tokens = nullptr;  // [count]
  std::function<float*(int, int)> state;
  std::function<uint16_t*(int, int, int)> tail;
};

class GpuDecoder {
 public:
  // Uploads its own bf16 + fp32 weight mirrors; `host` must outlive the decoder.
  GpuDecoder(const ModelWeights& host, int64_t num_slots, int64_t max_length,
             const GpuDecodeOptions& options = GpuDecodeOptions::from_env());
  // Shares an existing upload; `dw` must outlive the decoder.
  GpuDecoder(const DeviceWeights& dw, int64_t num_slots, int64_t max_length,
             const GpuDecodeOptions& options = GpuDecodeOptions::from_env());
  ~GpuDecoder();
  GpuDecoder(const GpuDecoder&) = delete;
  GpuDecoder& operator=(const GpuDecoder&) = delete;

  const ModelConfig& config() const { return dw_->config(); }
  const GpuDecodeOptions& options() const { return options_; }
  // How steps run, in one line (bench output): graphs on/off (and why off), the MoE path.
  std::string mode() const;
  // DM_DECODE_PROFILE=1: the device time of each step's phases, from timing events recorded
  // around every sub-layer (inside the graphs too, so the phases are timed as they run): the
  // KDA and MLA mixers, the MoE and dense FFNs, and the rest (residual stream, norms, embedding,
  // LM head). One line of µs-per-step averages since the last call (then reset); empty when off.
  std::string profile_report();
  // Graphs captured so far and steps replayed from one (tests, bench); 0 and 0 without graphs.
  int64_t graphs_captured() const { return graphs_captured_; }
  int64_t graph_replays() const { return graph_replays_; }
  // The routed-expert path a step of n rows takes.
  MoeExpertsPath moe_path(int64_t n) const;
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
  // The same step with the logits left in the decoder's pinned host buffer: the active slots'
  // rows [n, V] fp32 in ascending slot order, the caller's to read or modify until the next call
  // (nullptr when no slot is active). What a server samples from: step's copy into the caller's
  // array is 42 MB of host memcpy a step at batch 64 on the 48B shape's vocabulary.
  float* step_rows(const int32_t* tokens, const int* active = nullptr);

  // release(slot), then the prompt ids [n] in one pass of the chunked forward (model/cuda/
  // layers.h: KDA leaves its final state and conv tails in the slot, MLA writes every position's
  // latent row into the slot's pages); writes the last position's logits [V] (host).
  // token_by_token: feed the prompt one decode step at a time instead (the reference the chunked
  // pass is tested against).
  // checkpoints (chunked pass only): KdaCheckpointTargets.
  void prefill(int64_t slot, const int32_t* ids, int64_t n, float* last_logits,
               bool token_by_token = false, const KdaCheckpointTargets* checkpoints = nullptr);

  // Appends the ids [n] to slot `slot`'s sequence at positions length(slot) … + n − 1 in one
  // chunked pass (a prompt fed in pieces, or the rest of a prompt after a restored prefix):
  // KDA continues from the slot's state and conv tails (KdaCarry::continues), MLA writes the new
  // latent rows and attends through the slot's pages, row t seeing positions ≤ length + t.
  // Writes the last position's logits [V] (host) when last_logits is given. On an empty slot this
  // is prefill(). Each row's attention reads the whole cached context (the paged decode kernel):
  // meant for pieces of up to a few thousand rows, not for a long prompt in one call.
  void extend(int64_t slot, const int32_t* ids, int64_t n, float* last_logits,
              const KdaCheckpointTargets* checkpoints = nullptr);

  // ---- The prefix cache's copies (synchronous; decode_gpu_prefix.cpp) ----
  // Latent rows [begin, begin + count) of the slot's sequence, every MLA layer: to or from
  // rows [mla_layers(), count, latent_width()] bf16 of device memory.
  int mla_layers() const;
  int64_t latent_width() const;  // kv_lora + rope
  void read_latents(int64_t slot, int64_t begin, int64_t count, uint16_t* dst);
  void write_latents(int64_t slot, int64_t begin, int64_t count, const uint16_t* src);
  // Makes slot `slot` hold a sequence of `length` tokens whose latent rows write_latents put in
  // place: every KDA layer's state from state(layer) [H, K, K] fp32 and its conv tails from
  // tail(layer, b) [Kc−1, H·K] bf16 (host memory), then the length. extend() continues it.
  void restore(int64_t slot, int64_t length, const std::function<const float*(int)>& state,
               const std::function<const uint16_t*(int, int)>& tail);

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
  struct StepGraph;
  void init();
  // One step of the n rows staged in pinned_meta_ (ids [n] | slots [n]); returns the rows'
  // logits [n, V] in pinned memory (valid until the next step), or nullptr when not wanted.
  float* run_rows(int64_t n, bool want_logits);
  // Checks the active slots' tokens and stages ids | slots for run_rows; the number of rows.
  int64_t stage_active(const int32_t* tokens, const int* active);
  // Queues the step's kernels on the decoder's stream (directly or into a capture).
  void record_step(const DecodeStepBuffers& b, int64_t n, bool want_logits, MoeExpertsPath moe);
  void capture_step(StepGraph& g, const DecodeStepBuffers& b, int64_t n, bool want_logits,
                    MoeExpertsPath moe);
  bool graphs_usable(MoeExpertsPath moe) const;
  // The chunked pass of prefill (start = 0: MLA through the prefill attention, then its latent
  // rows) and extend (start = the slot's length: KDA continues its carry, MLA through mla_step),
  // ids [n] at positions start … start + n − 1.
  void forward_rows(int64_t slot, const int32_t* ids, int64_t n, int64_t start, float* last_logits,
                    const KdaCheckpointTargets* checkpoints);
  void kda_step(int layer, const uint16_t* xn, float* y, const Rows& rows);
  // The MLA sub-layer of n rows at their own positions: writes their latent rows into the pages,
  // then attends through the pages (paged absorbed kernel) — a decode step's rows, or the new
  // tokens of one slot (extend()). Temporaries from run's scratch, kernels on run's stream.
  void mla_step(GpuRun& run, int layer, const uint16_t* xn, float* y, const Rows& rows);
  // Scratch bytes mla_step takes for n rows.
  size_t mla_step_bytes(int64_t n) const;
  // Grows the chunked forward's run and stream buffers to n rows (prefill, extend).
  void reserve_prefill(int64_t n);
  // read_latents (into_slot = false: slot rows → buffer) and write_latents (buffer → slot rows).
  void copy_latents(int64_t slot, int64_t begin, int64_t count, uint16_t* buffer, bool into_slot);

  GpuDecodeOptions options_;
  // Declared before everything that queues work on it, so it is destroyed last.
  std::unique_ptr<OwnedStream> stream_;
  std::unique_ptr<DeviceWeights> owned_;
  const DeviceWeights* dw_ = nullptr;
  int64_t S_ = 0, max_length_ = 0, pages_per_slot_ = 0;
  int num_sms_ = 0;
  bool has_moe_ = false;
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
  std::vector<int32_t> active_slots_;              // [S] host: the step's slots in row order
  std::unique_ptr<PinnedBuffer> pinned_meta_;      // [2S] int32 ids | slots uploaded per step
  std::unique_ptr<PinnedBuffer> pinned_logits_;    // [S, V] fp32 rows of one step
  // Graphs by key 2·n + want_logits (lazily captured); off for good after a failed capture.
  std::vector<std::unique_ptr<StepGraph>> graphs_;
  bool graph_capture_failed_ = false;
  int64_t graphs_captured_ = 0, graph_replays_ = 0;
  // DM_DECODE_PROFILE: marks 0 (step start), 1 + 4i … 4 + 4i (layer i's mixer start / end, FFN
  // start / end), 1 + 4L (step end); per-phase sums in ms since profile_report().
  std::unique_ptr<StreamMarks> marks_;
  struct PhaseSums {
    double kda = 0, mla = 0, moe = 0, dense = 0, step = 0;
    int64_t steps = 0;
  } phase_sums_;
  void add_step_phases();
  // The chunked prefill's own resources, sized for the longest prompt seen (grown on demand).
  std::unique_ptr<GpuRun> prefill_run_;
  std::unique_ptr<DeviceArena> prefill_act_;
  int64_t prefill_capacity_ = 0;
};

}  // namespace dm::cuda
