// Device side and launch helper of programmatic dependent launch (pdl.h says why and the rule).
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/pdl.h"

namespace dm::cuda {

// Waits until the kernel this one depends on has finished and its writes are visible; a no-op
// for a kernel launched without PDL.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next PDL kernel on the stream launch once every block of this grid has called it (or
// exited): its blocks then take the SM slots this grid leaves free and run up to their own wait.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The only order the two are used in: a kernel lets its dependent in after its own wait, so
// the dependent starts only when every kernel before this one has finished. Triggering first
// (tried on the H200, CUDA 13.0) broke chains of PDL kernels: results went wrong wherever a
// kernel's blocks could start while the kernel two back still ran (a wait covers only the
// kernel waited on), while PDL on any one group of kernels alone gave the same bits as without
// it. A block that calls this at its top waits for its inputs and overlaps its launch with the
// previous kernel; a GEMV issues its weight loads first.
__device__ __forceinline__ void pdl_wait_then_launch_dependents() {
  pdl_wait();
  pdl_launch_dependents();
}

// Asks the TMA unit to bring [p, p + bytes) into L2 (cp.async.bulk.prefetch; p and bytes
// multiples of 16): one instruction per contiguous weight row, no registers held. For weights a
// PDL kernel will read after its wait (no kernel writes them), issued before it.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...) with the PDL attribute when
// pdl_enabled(). The kernel must keep pdl.h's rule.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  DM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace dm::cuda
