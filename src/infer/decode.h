// Cached autoregressive decoding (SPEC §5): prefill a sequence with the chunked/expanded layer
// forms, then decode one token per step with the recurrent KDA operator on a carried state and
// absorbed MLA over a latent cache. Per token the cost is O(#cached positions) in the MLA layers
// and constant elsewhere, instead of a full re-forward.
//
// AttnRes (SPEC §1.3) mixes over depth per token, so decode keeps no history for it: each step
// runs the same layer loop as ModelT::forward on the new tokens only.
#pragma once
#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "model/model.h"

namespace dm {

// The cache of S sequence slots of up to max_length tokens each, in one arena sized once:
//   KDA layer i:  kda_state[i] [S, H, K, V]; kda_conv_tail_{q,k,v}[i] [S, Kc−1, H·K]
//   MLA layer i:  mla_latent[i] [S, Lmax, kv_lora] (after its RMSNorm);
//                 mla_rope_key[i] [S, Lmax, qk_rope] (after RoPE when on)
//   lengths [S]: tokens cached per slot (the next token's position).
// Entries of the other mixer kind are nullptr. Scratch for prefill/decode lives in `work`,
// which grows on demand (a longer prompt than seen before reserves it again).
struct DecodeState {
  DecodeState(const ModelConfig& cfg, int64_t num_sequences, int64_t max_length);

  int64_t num_sequences = 0, max_length = 0;
  std::vector<float*> kda_state, kda_conv_tail_q, kda_conv_tail_k, kda_conv_tail_v;
  std::vector<float*> mla_latent, mla_rope_key;
  float *rope_cos = nullptr, *rope_sin = nullptr;  // [Lmax, qk_rope/2] when RoPE is on
  std::vector<int64_t> lengths;

  Arena cache;       // everything above, one allocation
  Arena work;        // prefill / decode scratch
  int64_t work_prefill_tokens = 0;  // prompt length `work` is sized for (decode is included)

  // Bytes of `cache` for this shape (what memory a batch of contexts costs).
  static size_t cache_bytes(const ModelConfig& cfg, int64_t num_sequences, int64_t max_length);
};

// Runs the prompt ids [n] through the model into slot seq_index (whatever the slot held is
// replaced) and writes the last position's logits [V].
void prefill(Model& model, DecodeState& state, int64_t seq_index, const int32_t* ids, int64_t n,
             float* last_logits);

// One token per active slot: next_ids [S] (read where active[s] != 0), each at its slot's own
// position lengths[s]; writes logits [S, V] rows of the active slots (others untouched) and
// advances their lengths. active == nullptr means every slot.
void decode_step(Model& model, DecodeState& state, const int32_t* next_ids, const int* active,
                 float* logits);

}  // namespace dm
