// Softmax statistics of packed documents between cuDNN's ragged batch (a dense [S] row per
// document and head) and our lse [B, H, T] (attention_kernels.h launch_ragged_stats).
// Grid: (entry, head); threads stride over the entry's tokens, coalesced on both sides.
#include <cuda_runtime.h>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/cuda_common.cuh"

namespace dm::cuda::attention_detail {
namespace {

__global__ void ragged_stats_kernel(const int32_t* doc_row, const int32_t* doc_begin,
                                    const int32_t* doc_len, int H, int S, int T, float* dense,
                                    float* lse, bool to_lse) {
  const int i = blockIdx.x, h = blockIdx.y;
  const int len = doc_len[i];
  float* d = dense + (int64_t(i) * H + h) * S;
  float* l = lse + (int64_t(doc_row[i]) * H + h) * T + doc_begin[i];
  for (int t = threadIdx.x; t < len; t += blockDim.x) {
    if (to_lse)
      l[t] = d[t];
    else
      d[t] = l[t];
  }
}

}  // namespace

void launch_ragged_stats(const int32_t* doc_row, const int32_t* doc_begin,
                         const int32_t* doc_len, int entries, int H, int S, int T, float* dense,
                         float* lse, bool to_lse, CUstream_st* stream) {
  if (entries <= 0 || H <= 0) return;
  ragged_stats_kernel<<<dim3(unsigned(entries), unsigned(H)), 256, 0,
                        reinterpret_cast<cudaStream_t>(stream)>>>(doc_row, doc_begin, doc_len, H,
                                                                  S, T, dense, lse, to_lse);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::attention_detail
