// The K loop of the wgmma grouped kernels (moe_grouped_gemm_wgmma.cu,
// moe_grouped_gemm_wgmma_backward.cu): a ring of kStages cp.async stages feeding one wgmma batch
// per step, every thread of the CTA both copying and (through its warpgroup) multiplying.
//   load(step, slot):  issues this thread's copies of `step` into stage `slot`;
//   multiply(slot):    issues the warpgroup's wgmma of the step held in stage `slot` (between
//                      wgmma_fence and wgmma_commit, which the loop issues).
// kStages − 1 steps of copies are issued ahead. Per step, kOverlap = false: wait for step t − 1's
// batch, barrier, refill its stage, then issue step t's batch; kOverlap = true (moe.h
// moe_wgmma_overlap): issue step t's batch first, then wait for t − 1's, barrier, refill, so the
// tensor cores have the next batch queued while the refill waits. On return every batch and copy
// of this thread has completed (the ring may be reused).
#pragma once
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::wgmma {

template <int kStages, bool kOverlap, class Load, class Multiply>
__device__ __forceinline__ void ring_pipeline(int steps, Load&& load, Multiply&& multiply) {
  using attention_detail::cp_async_commit;
  using attention_detail::cp_async_wait;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  int slot = 0;  // step t's slot: t mod kStages
  for (int t = 0; t < steps; ++t) {
    const int previous = slot == 0 ? kStages - 1 : slot - 1;  // step t − 1's slot
    cp_async_wait<kStages - 2>();  // this thread's copies of step t have landed
    fence_proxy_async();           // ... and are visible to the async proxy
    if constexpr (!kOverlap) {
      wgmma_wait<0>();  // step t − 1's batch has read its stage
      __syncthreads();  // ... in both warpgroups, and every copy of t is in
      if (t + kStages - 1 < steps) load(t + kStages - 1, previous);
      cp_async_commit();
    } else {
      __syncthreads();  // every copy of t is in
    }
    wgmma_fence();
    multiply(slot);
    wgmma_commit();
    if constexpr (kOverlap) {
      // Step t's batch is queued behind t − 1's: only then wait for t − 1 (both warpgroups) and
      // refill its stage.
      wgmma_wait<1>();
      __syncthreads();
      if (t + kStages - 1 < steps) load(t + kStages - 1, previous);
      cp_async_commit();
    }
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
}

}  // namespace dm::cuda::wgmma
