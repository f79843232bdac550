// The residual stream of SPEC §1.3 on the GPU: token embedding gather, Block AttnRes mixing,
// RMSNorm from the fp32 stream into the bf16 rows the sub-layers take, and the stream add.
// Twins of ops/cpu/attnres.h, ops/cpu/rmsnorm.h and the copies in model/residual.h. Plain C++
// (no CUDA headers); kernels in residual_ops.cu. Every pointer is a DEVICE pointer; the residual
// stream is fp32 [N, D], bf16 tensors are their uint16_t bit patterns.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

// out[n, :] = fp32(table[tokens[n], :]) (bf16 table [V, D], the weights' compute copy; fp32
// stream). Token ids are checked on the host first. int64 ids (prefill) or int32 (decode).
void embedding_gather(const uint16_t* table, const int64_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream = nullptr);
void embedding_gather(const uint16_t* table, const int32_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream = nullptr);

// y[n, :] = bf16(x[n, :] · r_n · w),  r_n = 1/sqrt(mean(x[n,:]²) + eps); x fp32, w fp32 [D].
void rmsnorm_to_bf16(const float* x, const float* w, uint16_t* y, int64_t N, int64_t D, float eps,
                     CUstream_st* stream = nullptr);

// dst[i] += src[i] (fp32).
void add_inplace(float* dst, const float* src, int64_t n, CUstream_st* stream = nullptr);

// Block AttnRes (ops/cpu/attnres.h): for each row n over S sources V_j = src[j][n, :],
//   logit_j = r_j · Σ_d V_jd γ_d w_d,  r_j = rsqrt(mean(V_j²) + eps),
//   out[n] = Σ_j softmax_j(logit) V_j.
// src: S device pointers held in a HOST array (passed to the kernel by value); S ≤ 64.
// out may alias a source (each thread reads all sources of its elements before writing).
inline constexpr int kAttnResCudaMaxSources = 64;
void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, int64_t N, int64_t D, float eps, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
