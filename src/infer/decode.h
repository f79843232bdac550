// Cached autoregressive decoding (SPEC §5): prefill/extend a sequence with the chunked/expanded
// layer forms, then decode one token per step with the recurrent KDA operator on a carried state
// and absorbed MLA over a paged latent cache. Per token the cost is O(#cached positions) in the
// MLA layers and constant elsewhere, instead of a full re-forward.
//
// AttnRes (SPEC §1.3) mixes over depth per token, so decode keeps no history for it: each step
// runs the same layer loop as ModelT::forward on the new tokens only.
//
// Memory (SPEC §5 "paged latent cache"): KDA state is per slot and constant in length; MLA
// latent rows [c ; kr] live in pages of `page_tokens` tokens from one pool sized once by a byte
// budget. A slot holds a page table; pages are reference counted, so a prefix-cache hit shares
// the pages of the cached prefix instead of copying them (infer/prefix_cache.h).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "infer/page_pool.h"
#include "model/model.h"

namespace dm {

class PrefixCache;

struct DecodeStateOptions {
  int64_t page_tokens = 64;  // tokens per latent page
  // Bytes of the latent page pool over all MLA layers; 0 = enough pages for every slot to reach
  // max_length at once (nothing can run out). Smaller budgets admit more slots than fit at full
  // length; reserve() tells a scheduler whether a sequence can grow.
  size_t page_pool_bytes = 0;
};

// The cache of S sequence slots of up to max_length tokens each, in one arena sized once:
//   KDA layer i:  kda_state[i] [S, H, K, V]; kda_conv_tail_{q,k,v}[i] [S, Kc−1, H·K]
//   MLA layer i:  mla_pages[i] [num_pages, page_tokens, kv_lora + qk_rope] rows [c ; kr]
//                 (c after its RMSNorm, kr after RoPE when on); shared by all slots
//   page_table [S, pages_per_slot]: the page of positions [j·P, (j+1)·P) of slot s (−1 = none)
//   lengths [S]: tokens cached per slot (the next token's position).
// Entries of the other mixer kind are nullptr. Scratch for prefill/decode lives in `work`,
// which grows on demand (a longer prompt than seen before reserves it again).
struct DecodeState {
  DecodeState(const ModelConfig& cfg, int64_t num_sequences, int64_t max_length,
              const DecodeStateOptions& options = {});
  ~DecodeState();
  DecodeState(const DecodeState&) = delete;
  DecodeState& operator=(const DecodeState&) = delete;

  ModelConfig config;  // a copy: the layout and the prefix cache depend on it
  int64_t num_sequences = 0, max_length = 0;
  int64_t page_tokens = 0, pages_per_slot = 0;
  int64_t active_params = 0;  // per token (model/params.h): sizes the threads of a step
  std::vector<float*> kda_state, kda_conv_tail_q, kda_conv_tail_k, kda_conv_tail_v;
  std::vector<float*> mla_pages;
  int32_t* page_table = nullptr;
  std::vector<int64_t> slot_pages;     // [S] pages held by each slot (its table's first entries)
  float *rope_cos = nullptr, *rope_sin = nullptr;  // [Lmax, qk_rope/2] when RoPE is on
  std::vector<int64_t> lengths;
  // [S] prompt tokens the slot's last prefill took from the prefix cache (usage reporting:
  // OpenAI's usage.prompt_tokens_details.cached_tokens).
  std::vector<int64_t> cached_tokens;

  LatentPagePool pages;
  Arena cache;       // everything above, one allocation
  Arena work;        // prefill / decode scratch
  int64_t work_prefill_tokens = 0;  // prompt length `work` is sized for (decode is included)
  int work_threads = 0;             // engine threads `work`'s per-thread scratch is sized for
  std::unique_ptr<PrefixCache> prefix_cache;  // null until enable_prefix_cache

  // Attaches a prefix cache (SPEC §5, infer/prefix_cache.h) of `budget_bytes` (KDA checkpoints +
  // the pages they pin + their tokens) on a grid of `grid_tokens` (0 = page_tokens; must be a
  // multiple of page_tokens). From then on prefill() reuses cached prompt prefixes and records
  // the reused count in cached_tokens. Replaces any earlier prefix cache. The pages it pins
  // come from the same pool as the slots' (and are given back when slots need them), so size
  // page_pool_bytes with room for cached prefixes: the default pool fits only the slots.
  void enable_prefix_cache(size_t budget_bytes, int64_t grid_tokens = 0);

  int64_t pages_for_tokens(int64_t tokens) const {
    return (tokens + page_tokens - 1) / page_tokens;
  }
  // Bytes of one page over all MLA layers.
  static size_t page_bytes(const ModelConfig& cfg, int64_t page_tokens);
  // Bytes of `cache` for this shape (what memory a batch of contexts costs).
  static size_t cache_bytes(const ModelConfig& cfg, int64_t num_sequences, int64_t max_length,
                            const DecodeStateOptions& options = {});
};

// Makes slot `seq` hold the pages of positions [0, total_tokens) (total_tokens ≤ max_length).
// Returns false, taking nothing, when the pool cannot supply them even after evicting prefix-
// cache entries (least recently used first) — a scheduler's admission test. prefill, extend and
// decode_step call it themselves and throw dm::Error when it fails.
bool reserve(DecodeState& state, int64_t seq, int64_t total_tokens);

// Empties slot `seq`: its pages go back to the pool (those shared with the prefix cache or other
// slots stay until their last holder drops them) and its length becomes 0.
void release(DecodeState& state, int64_t seq);

// Runs the prompt ids [n] through the model into slot seq_index (whatever the slot held is
// replaced) and writes the last position's logits [V]. With a prefix cache, the longest cached
// grid prefix shorter than n is reused (state copied, pages shared), only the rest is computed,
// and the prompt's own grid prefixes are checkpointed; state.cached_tokens[seq] says how many
// tokens were reused. Equals release + extend.
void prefill(Model& model, DecodeState& state, int64_t seq_index, const int32_t* ids, int64_t n,
             float* last_logits);

// Appends ids [n] to slot seq_index, which holds lengths[seq] tokens (0 = a new sequence):
// chunked KDA from the slot's state and conv tails; the new MLA queries attend causally over
// the cached prefix and themselves. Writes the last new position's logits [V].
void extend(Model& model, DecodeState& state, int64_t seq_index, const int32_t* ids, int64_t n,
            float* last_logits);

// One token per active slot: next_ids [S] (read where active[s] != 0), each at its slot's own
// position lengths[s]; writes logits [S, V] rows of the active slots (others untouched) and
// advances their lengths. active == nullptr means every slot.
void decode_step(Model& model, DecodeState& state, const int32_t* next_ids, const int* active,
                 float* logits);

}  // namespace dm
