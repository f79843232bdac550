// Hopper's tensor memory accelerator (TMA) and shared-memory transaction barriers (mbarrier), the
// device side: what a warp-specialized kernel needs to have one thread stream tiles into a ring of
// shared-memory stages while warpgroups multiply out of it (moe_grouped_gemm_tma.cu).
//
// A stage has two barriers. full[s]: one arrival (the producer's, announcing the bytes it expects
// through arrive_expect_tx) plus the TMA's byte count; its phase completes when the tile has
// landed. empty[s]: one arrival per consumer warp once its MMAs have read the stage; its phase
// completes when the stage may be refilled. A waiter names the parity of the phase it waits for:
// consumers wait full[s] with parity (round & 1), the producer waits empty[s] with parity
// (round & 1) ^ 1, which a fresh barrier (in phase 0) passes at once, so the first round of the
// ring fills without waiting.
//
// Tiles are described by a CUtensorMap (tma_map.h) passed as a __grid_constant__ kernel
// parameter; elements past the tensor's extent arrive as zeros and still count in the bytes.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace dm::cuda::tma {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
}
// Makes initialised barriers visible to the async proxy (the TMA unit); a CTA barrier follows.
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
// The producer's arrival, raising the phase's expected transaction bytes by `bytes`.
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
      "r"(bytes)
      : "memory");
}
// Spins until the phase of parity `parity` has completed (try_wait suspends the thread for a
// hardware-chosen time between polls, so the loop does not hammer shared memory).
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t address = shared_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
}

// Brings the tensor map's descriptor into the TMA unit's cache ahead of the first load.
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box (x = inner coordinate, y = row) of a 2-D tensor map into shared memory at `dst` (aligned
// as the map's swizzle asks: 1024 bytes for 128-byte swizzle); completes bytes on `bar`.
__device__ __forceinline__ void load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t x,
                                        int32_t y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(x), "r"(y)
      : "memory");
}

// Box (x, y, z) of a 3-D tensor map (tma_map_bf16_batched: z the matrix) into shared memory.
__device__ __forceinline__ void load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t x,
                                        int32_t y, int32_t z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// Box (x, y, z, w) of a 4-D tensor map (tma_map_bf16_head_rows: x column, y head, z token,
// w batch) into shared memory.
__device__ __forceinline__ void load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t x,
                                        int32_t y, int32_t z, int32_t w) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(x), "r"(y), "r"(z), "r"(w)
      : "memory");
}

// A named barrier over the first `threads` threads of the CTA (a multiple of 32): the consumer
// warpgroups synchronise among themselves while the producer warp has left.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace dm::cuda::tma
