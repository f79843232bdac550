// Declarations shared by the two stage-4 implementations of the chunked KDA backward:
// kda_chunk_backward.cu (stages 1–3 and the reference stage 4) and kda_chunk_backward_tc.cu
// (the tensor-core stage 4). Included only by nvcc-compiled files.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/kda.h"
#include "ops/cuda/kda_common.cuh"

namespace dm::cuda::kda_detail {

// Stage 4 on tensor cores, bf16 inputs only. Same inputs and outputs as the reference stage 4
// (kda_chunk_grad_kernel): ws filled by stages 1–2 (chunk-start states, V', K⊙e^{γ−Γ}, P, e^γ),
// d_states [B·H·num_chunks, KP, VP] = dS' from stage 3; gradients accumulated (+=) into
// dq, dk, dg [B,T,H,K], dv [B,T,H,V], dbeta [B,T,H]. Needs no scratch beyond ws and d_states.
void kda_chunk_grad_tensor_cores(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const uint16_t* g, const uint16_t* beta, const uint16_t* d_o,
                                 const int32_t* doc_start, float* dq, float* dk, float* dv,
                                 float* dg, float* dbeta, const KdaDims& d,
                                 const KdaForwardWorkspace& ws, const float* d_states,
                                 cudaStream_t stream);

// The split stage 4 (KdaBackwardPath::TensorCoreSplit): a value kernel over V halves
// (kda_chunk_backward_value.cu) and a key kernel over K halves (kda_chunk_backward_key.cu), each
// small enough for two blocks per SM where the fused kernel fits one. What the first hands to
// the second, per chunk-head ch (views carved after d_states, kda_chunk_backward.cu):
struct KdaSplitWorkspace {
  float* d_query_key;  // [·, 2, C, C]  dP = dO·V'ᵀ, one partial per V half (unmasked)
  float* d_mix;        // [·, 2, C, C]  dM = −dR·V'ᵀ, one partial per V half (unmasked)
  float* d_beta;       // [·, 2, C]     dβ partials: rowdot(dR, X) + Σ_j L_ij·dM_ij per V half
  float* d_x;          // [·, C, VP]    dX = β·dR
  // false: the key and value kernels STORE dq, dk, dv, dg, dβ (each element is written by one
  // block exactly once) instead of adding to them, so the caller need not zero them first.
  bool accumulate = true;
};
__host__ __device__ inline int64_t kda_split_workspace_floats(const KdaDims& d) {
  return d.B * d.H * d.num_chunks * (4 * kChunk * kChunk + 2 * kChunk + kChunk * d.VP);
}
// The split handles KP % 32 == 0 (KP ≤ 128) and VP % 32 == 0; other shapes run the fused kernel.
__host__ __device__ inline bool kda_split_supported(const KdaDims& d) {
  return d.KP % 32 == 0 && d.KP <= kKdaCudaMaxHeadDim && d.VP % 32 == 0;
}
void kda_chunk_grad_split(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const uint16_t* g, const uint16_t* beta, const uint16_t* d_o,
                          const int32_t* doc_start, float* dq, float* dk, float* dv, float* dg,
                          float* dbeta, const KdaDims& d, const KdaForwardWorkspace& ws,
                          const float* d_states, const KdaSplitWorkspace& split,
                          cudaStream_t stream);
// Its two halves, for the launcher above and for the diagnostics.
void kda_chunk_grad_value_launch(const uint16_t* k, const uint16_t* v, const uint16_t* g,
                                 const uint16_t* beta, const uint16_t* d_o,
                                 const int32_t* doc_start, float* dv, const KdaDims& d,
                                 const KdaForwardWorkspace& ws, const float* d_states,
                                 const KdaSplitWorkspace& split, cudaStream_t stream);
void kda_chunk_grad_key_launch(const uint16_t* q, const uint16_t* k, const uint16_t* g,
                               const uint16_t* beta, const uint16_t* d_o, const int32_t* doc_start,
                               float* dq, float* dk, float* dg, float* dbeta, const KdaDims& d,
                               const KdaForwardWorkspace& ws, const float* d_states,
                               const KdaSplitWorkspace& split, cudaStream_t stream);

// Warps per 16-row sub-block of the split kernels for a block width of `half_width` channels
// (KP/2 for the key kernel, VP/2 for the value kernel): 4 (512 threads) when it is a multiple of
// 32, else 2 (256 threads). DM_KDA_STAGE4_GROUPS=2 (read once) keeps 2 everywhere, to compare.
int kda_stage4_column_groups(int half_width);
// The most column groups a split kernel runs with: each warp holds 16 rows × (half width /
// groups) columns of its products, and each block's shared memory keeps [groups, C] partial row
// sums per group (sized for this many).
constexpr int kKdaStage4MaxColGroups = 4;
// Their dynamic shared memory (bytes) for these dims.
size_t kda_chunk_grad_value_shared_bytes(const KdaDims& d);
size_t kda_chunk_grad_key_shared_bytes(const KdaDims& d);
// Their phase clocks (kda_stage4_split_phase_clock in kda.h).
void kda_value_phase_clock(bool enable);
int kda_value_phase_cycles(long long* cycles, const char** names, int max_phases);
void kda_key_phase_clock(bool enable);
int kda_key_phase_cycles(long long* cycles, const char** names, int max_phases);

// Stage 3 on tensor cores (tf32 operands, fp32 dS; kda_chunk_state_tf32.cu), bf16 dO: same
// outputs as the fp32 stage 3 (d_states = dS' per chunk, ds0 +=). Needs V % 8 == 0 and a 16-byte
// aligned dO (its rows are copied in 16-byte pieces): check with _supported first.
bool kda_chunk_state_backward_tf32_supported(const KdaDims& d, const uint16_t* d_o);
void kda_chunk_state_backward_tf32(const uint16_t* d_o, const float* dsT, float* ds0,
                                   const KdaDims& d, const KdaForwardWorkspace& ws,
                                   float* d_states, cudaStream_t stream);

// Dynamic shared memory of the tensor-core stage 4 (bytes) for these dims.
size_t kda_chunk_grad_tensor_cores_shared_bytes(const KdaDims& d);

}  // namespace dm::cuda::kda_detail
