// Causal MLA attention on the GPU (SPEC §1.2, §5): the twins of ops/cpu/attention.h for
// prefill/training (expanded form, flash-style tiles, forward + backward), and the absorbed MLA
// decode over a paged latent cache. Plain C++ (no CUDA headers); kernels in attention*.cu.
//
// Every pointer is a DEVICE pointer unless its comment says host; bf16 tensors are passed as
// their uint16_t bit patterns (device.h float_to_bf16). Layouts as the CPU op:
//   q, k [B, T, H, Dqk]   v, o [B, T, H, Dv]   (bf16)
//   lse  [B, H, T]        fp32 log-sum-exp of the scaled scores per query row (natural log)
//   doc_start [B, T]      int32 packed documents (docs/backward.md); nullptr = one document per
//                         row. Must satisfy 0 ≤ doc_start[t] ≤ t (attention_check_doc_start).
// Softmax statistics are fp32, products bf16 × bf16 → fp32 on tensor cores. Nothing T×T is ever
// stored. Head dims: multiples of 8 (16-byte rows); the tiled kernels take Dqk ≤ 192, Dv ≤ 128
// (instantiated for ≤ 32/32, ≤ 96/64 and ≤ 192/128, zero-padded), the simple ones ≤ 256.
// `stream` is a cudaStream_t (nullptr = default stream); nothing here synchronises.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm {
struct AttnShape;  // ops/cpu/attention.h
}

namespace dm::cuda {

// Tiled: our tensor-core flash kernels. Simple: one warp per row, fp32, no tiles (the GPU
// reference the tiled kernels are checked against; slow). Cudnn: cuDNN's fused attention
// engines (attention_cudnn.h; packed documents through its ragged batch; throws when cuDNN
// cannot take the problem).
// Auto: Cudnn when the shape recurs (its third call: a cuDNN plan build costs ~0.1 s, which a
// one-off prompt length would not earn back) and cuDNN takes it, else Tiled; packed documents
// too, unless DM_CUDNN_PACKED=0. The environment variable DM_ATTENTION=ours pins Auto to Tiled;
// DM_ATTENTION=cudnn makes it eager (plans on a shape's first call).
enum class AttentionKernel : uint8_t { Auto, Tiled, Simple, Cudnn };

// o (written) and lse (written when non-null) for the causal attention of q, k, v.
void attention_causal_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              uint16_t* o, float* lse, const AttnShape& s, double scale,
                              const int32_t* doc_start = nullptr, CUstream_st* stream = nullptr,
                              AttentionKernel kernel = AttentionKernel::Auto);

// fp32 (the fp32 GPU mode): q, k, v, o fp32, every product and the softmax in fp32 (CUDA cores,
// the Simple kernel's scheme on fp32 operands; Dqk, Dv ≤ 256). Same layouts, lse and doc_start
// rules as above. Checked against the CPU float attention at 1e-5.
void attention_causal_forward(const float* q, const float* k, const float* v, float* o, float* lse,
                              const AttnShape& s, double scale, const int32_t* doc_start = nullptr,
                              CUstream_st* stream = nullptr);

// Device scratch attention_causal_backward needs: Δ [B,H,T] fp32 and per-32-row minimum
// document starts.
size_t attention_causal_backward_workspace_bytes(const AttnShape& s);

// Gradients for dout [B,T,H,Dv], WRITTEN (bf16) to dq, dk [B,T,H,Dqk] and dv [B,T,H,Dv],
// given the forward's o and lse for the same inputs and doc_start (lse from any kernel: all
// write the same statistics). Tiled and Simple are deterministic (no atomics: every gradient
// element has one writer); cuDNN's dQ accumulation order is its own.
// `workspace`: attention_causal_backward_workspace_bytes(s) bytes of device memory.
void attention_causal_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const uint16_t* o, const float* lse, const uint16_t* dout,
                               uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                               double scale, void* workspace, const int32_t* doc_start = nullptr,
                               CUstream_st* stream = nullptr,
                               AttentionKernel kernel = AttentionKernel::Auto);

// Copies a device doc_start [B,T] to the host and runs the CPU check (throws dm::Error naming the
// first bad token). Synchronous; for tests and debugging, not the hot path.
void attention_check_doc_start_device(const int32_t* doc_start, int64_t B, int64_t T);

// ---- Absorbed MLA decode over a paged latent cache ------------------------------------------
// Per sequence s (S of them) and head h (H):
//   out[s,h,:] = Σ_{j < seq_len[s]} softmax_j(scale · q[s,h,:]·row_j) · row_j[0:Dv]
// where row_j [Dk] = cache row of token j = [c_j (Dv = kv_lora) | kr_j (qk_rope)], and q[s,h,:] is
// the absorbed query [W_kvb_keys_hᵀ q_nope_h | q_rope_h] (Dk wide). scale stays
// (qk_nope + qk_rope)^{-1/2} (× mscale² under YaRN). The caller applies W_kvb's value rows to out.
// Paged cache: token j of sequence s lives in page page_table[s, j / 64], row j % 64, of the
// pool [num_pages, 64, Dk]. Long contexts are split over CTAs (split-K) and merged with
// log-sum-exp weights. Dk ≤ 576, Dv ≤ 512, both multiples of 8, Dv ≤ Dk.
inline constexpr int kMlaDecodePageTokens = 64;

// Work partition, computed on the host once per batch shape (no device access).
struct MlaDecodePlan {
  int num_splits = 1;       // CTAs per (sequence, head group) along the context
  int pages_per_split = 1;  // pages each split walks
  int max_pages = 0;        // page_table row length
};
// How many splits (≥ 4 pages each):
//   WholeWaves    the fewest waves × (pages per split + a CTA's own traffic), one CTA per
//                 multiprocessor (the kernel's shared memory allows no more at Dk = 576). At
//                 batch 64 × 32K it takes 2 splits (128 CTAs: one wave) where TwoCtasPerSm takes
//                 5 (320 CTAs: three waves, 2.4 waves' work): the step 40.7/41.7 → 39.9/39.1 ms
//                 on an H200 (two rounds, 2026-11-30). The default.
//   TwoCtasPerSm  ≥ 2 CTAs per multiprocessor.
// mla_split_rule_default(): env DM_MLA_DECODE_SPLITS = waves | fixed (TwoCtasPerSm), read once.
enum class MlaSplitRule : uint8_t { TwoCtasPerSm, WholeWaves };
MlaSplitRule mla_split_rule_default();
// max_pages: page_table row length (≥ ceil(longest seq_len / 64)). num_sms ≤ 0: read it off the
// current device. max_splits ≤ 256 (the combine's limit); at batch 1 × 1M the default lets
// whole waves take 132 splits on 132 multiprocessors (128 left four idle).
MlaDecodePlan mla_decode_plan(int S, int H, int max_pages, int num_sms = 0, int max_splits = 256,
                              MlaSplitRule rule = mla_split_rule_default());
// Device scratch for the split partials (0 when num_splits == 1).
size_t mla_decode_workspace_bytes(const MlaDecodePlan& plan, int S, int H, int Dv);

struct MlaDecodeArgs {
  const uint16_t* q = nullptr;         // [S, H, Dk] bf16 absorbed queries
  const uint16_t* cache = nullptr;     // [num_pages, 64, Dk] bf16 page pool
  const int32_t* page_table = nullptr; // [S, max_pages] page ids into the pool
  const int32_t* seq_len = nullptr;    // [S] tokens in the cache per sequence (0 → out = 0)
  uint16_t* out = nullptr;             // [S, H, Dv] bf16 (written)
  float* lse = nullptr;                // [S, H] natural-log lse (written when non-null)
  int S = 0, H = 0, Dk = 0, Dv = 0;
  double scale = 1.0;
};
// `workspace`: mla_decode_workspace_bytes(plan, S, H, Dv) bytes of device memory.
// Kernel: for Dk = 576, Dv = 512 (this family's MLA) the warpgroup-MMA one
// (attention_decode_wgmma.cu), else, or with mla_decode_wgmma() off, the mma.sync one; same
// outputs to rounding (the products' summation orders differ).
void mla_decode_absorbed(const MlaDecodeArgs& args, const MlaDecodePlan& plan, void* workspace,
                         CUstream_st* stream = nullptr);

// Whether mla_decode_absorbed may take the warpgroup-MMA kernel: env DM_MLA_DECODE_WGMMA (0 or 1,
// default 1; read once), changeable at run time (tests run both kernels).
bool mla_decode_wgmma();
void mla_set_decode_wgmma(bool on);
// Whether mla_decode_absorbed takes the warpgroup-MMA kernel for cache rows of Dk and values of
// Dv: mla_decode_wgmma() and Dk = 576, Dv = 512.
bool mla_decode_uses_wgmma(int Dk, int Dv);

}  // namespace dm::cuda
