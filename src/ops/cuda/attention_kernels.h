// Internal interface between the checked entry points of attention.cpp (C++20, sees the CPU
// AttnShape) and the kernel launchers in attention*.cu (nvcc, C++17). Plain C++17; not for use
// outside src/ops/cuda/attention*. All pointers are device pointers; bf16 is passed as its
// uint16_t bit pattern.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm::cuda::attention_detail {

// Causal attention over [B, T, H, D] tensors (ops/cpu/attention.h layout).
struct AttentionProblem {
  int B = 0, T = 0, H = 0, Dqk = 0, Dv = 0;
  float scale = 1.0f;
  const int32_t* doc_start = nullptr;  // [B, T] or nullptr
};

// o [B,T,H,Dv] (written), lse [B,H,T] natural-log (written when non-null).
void launch_attention_forward_tiled(const AttentionProblem& p, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, uint16_t* o, float* lse,
                                    CUstream_st* stream);
void launch_attention_forward_simple(const AttentionProblem& p, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, uint16_t* o,
                                     float* lse, CUstream_st* stream);
// The same kernel on fp32 q, k, v, o (the fp32 GPU mode): one body, templated on the storage.
void launch_attention_forward_simple(const AttentionProblem& p, const float* q, const float* k,
                                     const float* v, float* o, float* lse, CUstream_st* stream);

// Backward scratch: Δ [B,H,T] fp32 and the per-32-row-block minimum document start
// [B, ceil(T/32)] int32.
constexpr int kMinDocRows = 32;
size_t attention_backward_scratch_bytes(int B, int T, int H);
// dq, dk, dv accumulate (+=) in bf16.
void launch_attention_backward_tiled(const AttentionProblem& p, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                     const float* lse, const uint16_t* dout, uint16_t* dq,
                                     uint16_t* dk, uint16_t* dv, void* scratch,
                                     CUstream_st* stream);
void launch_attention_backward_simple(const AttentionProblem& p, const uint16_t* q,
                                      const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                      const float* lse, const uint16_t* dout, uint16_t* dq,
                                      uint16_t* dk, uint16_t* dv, void* scratch,
                                      CUstream_st* stream);

// Largest head dims the tiled kernels are instantiated for.
constexpr int kTiledMaxDqk = 192, kTiledMaxDv = 128;

// Absorbed MLA decode (attention_decode.cu); see attention.h for the meaning of each field.
struct DecodeProblem {
  int S = 0, H = 0, Dk = 0, Dv = 0;
  int max_pages = 0;  // page_table row length
  int num_splits = 1, pages_per_split = 0;
  float scale = 1.0f;
};
constexpr int kDecodePageTokens = 64;
constexpr int kDecodeMaxDk = 576, kDecodeMaxDv = 512;
// Heads one decode CTA takes: two groups of 16 (one page tile in shared memory serving both)
// when there are more than 16 heads, else one. The plan and the launch both use it.
inline int decode_heads_per_cta(int64_t H) { return H > 16 ? 32 : 16; }

// Packed documents as a ragged batch (attention_cudnn.cpp): entry i is the doc_len[i] tokens of
// row doc_row[i] from token doc_begin[i] (length 0 for padding entries). Moves the softmax
// statistics between a dense [entries, H, S] buffer and our lse [B, H, T]:
//   to_lse:   lse[row, h, begin + t] = dense[i, h, t]   (t < len)
//   from_lse: dense[i, h, t] = lse[row, h, begin + t]   (t < len; the rest untouched)
void launch_ragged_stats(const int32_t* doc_row, const int32_t* doc_begin,
                         const int32_t* doc_len, int entries, int H, int S, int T, float* dense,
                         float* lse, bool to_lse, CUstream_st* stream);
void launch_attention_decode(const DecodeProblem& p, const uint16_t* q, const uint16_t* cache,
                             const int32_t* page_table, const int32_t* seq_len, uint16_t* out,
                             float* lse, float* partial_o, float* partial_lse,
                             CUstream_st* stream);

}  // namespace dm::cuda::attention_detail
