// Capacity and cost arithmetic of a model config: what training and serving it on one device
// hold in memory, what a training token costs in FLOPs, and what one cached decode step must
// move through HBM (the floor its time is measured against). `deltamoe plan` prints these; the
// GPU benchmarks (bench/bench_cuda_train.cpp, bench_cuda_decode.cpp) take their MFU and HBM
// floor from here, so a claim and its plan use one model.
//
// Layouts come from ReservedWeights (model/weights.h: address space only), so a plan of a model
// larger than host memory costs no memory. Byte counts are doubles (a 2.8T model's optimizer
// state passes 2^53 bytes only in the 10^4-device range, far from here).
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace dm {

// Model FLOPs of one training token at sequence length `seq_len`, without recompute: 6 · active
// parameters for the matrices (forward 2, backward 4), plus per MLA layer the causal attention,
// 3 · 2 · 2 · (T/2) · H · (d_qk + d_v) (scores and values, forward ×3 for the backward, half the
// keys on average). KDA's chunked recurrence is linear in T and counted as its matrices only.
double train_flops_per_token(const ModelConfig& c, int64_t active_params, int64_t seq_len);

// Device memory of one-device training state (model/cuda/model_train_gpu.h,
// train/cuda/optimizer_gpu.h): the bf16 compute copy of every parameter plus fp32 copies of the
// element-wise ones, fp32 master weights, fp32 gradients, AdamW's two fp32 moments. Activations
// depend on the batch and the recompute policy and are not included.
struct TrainStateBytes {
  double weights = 0, master = 0, grads = 0, optimizer = 0;
  double total() const { return weights + master + grads + optimizer; }
};
TrainStateBytes train_state_bytes(const ModelWeights& layout);

// What one cached decode step of `batch` sequences at context `context` moves:
//   weights, bf16 (fp32 for the element-wise parameters, whose fp32 copies the kernels read):
//     `batch` embedding rows + every matrix but the routed experts (attention, dense FFN,
//     routers, shared experts, LM head) + per MoE layer the routed experts the batch hits.
//     ASSUMPTION: that count is E·(1 − (1 − k/E)^B), the expected number of distinct experts
//     when each token's k experts are uniformly random (exactly k at B = 1);
//   per sequence: each KDA layer's state read + written (H·K·V fp32, twice) and conv tails
//     (3·(kernel−1)·H·K bf16, twice); each MLA layer's `context` latent rows read + one written
//     ((kv_lora + rope) × 2 B each).
// Not included: activations (≪ weights), the logits' copy to the host, launch overheads.
struct DecodeStepBytes {
  double weights = 0, experts_per_layer = 0, kda = 0, cache = 0;
  double total() const { return weights + kda + cache; }
};
DecodeStepBytes decode_step_bytes(const ModelWeights& layout, int64_t batch, int64_t context);

// The GPU decoder's cache for `slots` sequences of up to `max_length` tokens
// (model/cuda/decode_gpu.h): KDA states and conv tails per slot, MLA latent rows in 64-token
// pages, page table and lengths, RoPE tables when on.
double kda_state_bytes_per_sequence(const ModelConfig& c);
double latent_bytes_per_token(const ModelConfig& c);  // all MLA layers, one token
double decode_cache_bytes(const ModelConfig& c, int64_t slots, int64_t max_length);

}  // namespace dm
