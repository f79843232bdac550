// The absorbed MLA decode's kernel arguments, shared by its two kernels: the mma.sync one with
// its split combine (attention_decode.cu) and the warpgroup-MMA one (attention_decode_wgmma.cu).
// Included only by nvcc-compiled files.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

struct CUstream_st;

namespace dm::cuda::attention_detail {

struct DecodeArgs {
  const __nv_bfloat16* q;      // [S, H, Dk]
  const __nv_bfloat16* cache;  // [pages, 64, Dk]
  const int32_t* page_table;   // [S, max_pages]
  const int32_t* seq_len;      // [S]
  __nv_bfloat16* out;          // [S, H, Dv]
  float* lse;                  // [S, H] or nullptr
  float* partial_o;            // [S, splits, H, Dv]
  float* partial_lse;          // [S, splits, H]
  int S, H, Dk, Dv, max_pages, num_splits, pages_per_split;
  float scale_log2;
};

// Runs the split kernel on warpgroup MMA when it covers the shape (Dk = 576, Dv = 512) and
// mla_decode_wgmma() is on; returns false, launching nothing, otherwise. Same outputs as the
// mma.sync kernel: out / lse with one split, else the partials the combine merges.
bool launch_attention_decode_wgmma(const DecodeArgs& a, CUstream_st* stream);

}  // namespace dm::cuda::attention_detail
