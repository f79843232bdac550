// The two sides of a warp-specialized K loop over a ring of kStages shared-memory stages fed by
// the TMA (tma.cuh says how the barriers pair up): one producer thread issues each step's tile
// loads, the consumer warps (warpgroups issuing wgmma) wait for a stage, multiply out of it and
// hand it back. Used by the TMA-fed grouped expert products (moe_grouped_gemm_tma.cu,
// moe_grouped_gemm_wgmma_backward.cu).
#pragma once
#include <cstdint>

#include "ops/cuda/tma.cuh"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::tma {

// Shared state of the ring: the barriers live in static shared memory, the stages elsewhere.
template <int kStages>
struct RingBarriers {
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread, before the CTA barrier that precedes any use.
  __device__ __forceinline__ void init(uint32_t consumer_warps) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], consumer_warps);
    }
    barrier_init_fence();
  }
};

// The producer thread: for each step, waits until its stage is free, announces stage_bytes and
// calls issue(step, slot, &full[slot]), which issues the step's TMA loads (summing to stage_bytes)
// into stage `slot` with that barrier.
template <int kStages, class Issue>
__device__ __forceinline__ void produce_ring(RingBarriers<kStages>& ring, int steps,
                                             uint32_t stage_bytes, Issue&& issue) {
  for (int t = 0, slot = 0, round = 0; t < steps; ++t) {
    barrier_wait(&ring.empty[slot], (round & 1) ^ 1);
    barrier_arrive_expect_bytes(&ring.full[slot], stage_bytes);
    issue(t, slot, &ring.full[slot]);
    if (++slot == kStages) slot = 0, ++round;
  }
}

// Every consumer thread: for each step, waits for its stage, calls landed(step, slot) (a hook for
// work on the landed tile before the MMAs; it must be uniform across the consumers), then
// multiply(slot) between wgmma_fence and wgmma_commit, keeps that batch in flight while the
// previous one completes and returns the previous step's stage (lane 0 of each warp arrives).
// On return every batch has completed.
template <int kStages, class Landed, class Multiply>
__device__ __forceinline__ void consume_ring(RingBarriers<kStages>& ring, int steps,
                                             Landed&& landed, Multiply&& multiply) {
  const bool lane0 = threadIdx.x % 32 == 0;
  for (int t = 0, slot = 0, round = 0, previous = kStages - 1; t < steps; ++t) {
    barrier_wait(&ring.full[slot], round & 1);
    landed(t, slot);
    wgmma::wgmma_fence();
    multiply(slot);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<1>();  // step t − 1's batch has read its stage
    if (t > 0 && lane0) barrier_arrive(&ring.empty[previous]);
    previous = slot;
    if (++slot == kStages) slot = 0, ++round;
  }
  wgmma::wgmma_wait<0>();
}

}  // namespace dm::cuda::tma
