// Causal MLA prefill attention through cuDNN's fused flash-attention engines: the same contract
// as attention_causal_forward / attention_causal_backward (attention.h: q, k [B,T,H,Dqk],
// v, o [B,T,H,Dv] bf16 bit patterns, lse [B,H,T] natural-log fp32), built as cuDNN backend
// graphs (matmul → scale → causal mask → softmax → matmul, and the matching backward graph) that
// cuDNN's runtime fusion engines compile into one kernel each. No packed documents (doc_start):
// cuDNN's causal mask has no notion of them, so attention.cpp keeps our kernels there.
//
// Plans are built once per (direction, shape, scale, device) and cached; the scratch (cuDNN's
// workspace, plus the backward's fp32 dQ accumulator and row sums) is one device buffer owned
// here, grown outside graph capture when a bigger shape arrives. Calls are serialised by a
// mutex, but their kernels run later on the caller's stream, so calls on different streams must
// not overlap in time (the engine runs attention on one stream per process). Plain C++ (no cuDNN
// headers).
// Without cuDNN at build time every function reports "unavailable" and returns false.
#pragma once
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dm {
struct AttnShape;  // ops/cpu/attention.h
}

namespace dm::cuda {

// True when the engine was built with cuDNN and a handle can be created on the current device.
bool cudnn_attention_available();
// "cuDNN 9.19.0" or why it is unavailable.
std::string cudnn_attention_status();

// Each returns true after enqueueing the work on `stream`, or false (nothing enqueued, `why`
// says why) when cuDNN cannot take the problem: no cuDNN, no engine for the shape, a plan /
// bigger scratch needed while `stream` is being captured into a CUDA graph, or a shape not yet
// requested `build_after` times. A plan build takes ~0.1 s, so the automatic choice passes
// kAttentionCudnnBuildAfter: shapes that recur (training steps) move to cuDNN on their third
// call, while one-off shapes (a prompt length seen once) keep our kernel and build nothing.
// At most kAttentionCudnnMaxPlans plans are kept; past that, new shapes are refused.
inline constexpr int kAttentionCudnnBuildAfter = 3;
inline constexpr int kAttentionCudnnMaxPlans = 256;
// Forward: writes o, and lse when non-null.
bool cudnn_attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o,
                             float* lse, const AttnShape& s, double scale, CUstream_st* stream,
                             std::string* why = nullptr, int build_after = 1);
// Backward: WRITES dq, dk [B,T,H,Dqk] and dv [B,T,H,Dv] from the forward's o and lse.
bool cudnn_attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const uint16_t* o, const float* lse, const uint16_t* dout,
                              uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                              double scale, CUstream_st* stream, std::string* why = nullptr,
                              int build_after = 1);

// Packed documents (doc_start [B,T], device, as attention.h) as cuDNN's ragged batch: one batch
// entry per document, bounded by its length (GEMM extents and a padding mask), the causal mask
// inside it; the softmax statistics go through a dense scratch to our lse layout. Copies
// doc_start to the host first (one stream synchronisation) to lay the batch out; plans are
// bucketed by document count and longest document (powers of two). Same returns as above.
// The fp32 dQ accumulator is token-major where cuDNN handles that (Dqk, Dv multiples of 16,
// cuDNN ≥ 9.6), else [entries, H, S, Dqk]. Auto takes this path unless DM_CUDNN_PACKED=0.
bool cudnn_attention_forward_packed(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    uint16_t* o, float* lse, const AttnShape& s, double scale,
                                    const int32_t* doc_start, CUstream_st* stream,
                                    std::string* why = nullptr, int build_after = 1);
bool cudnn_attention_backward_packed(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                     const uint16_t* o, const float* lse, const uint16_t* dout,
                                     uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                                     double scale, const int32_t* doc_start, CUstream_st* stream,
                                     std::string* why = nullptr, int build_after = 1);

// The engine cuDNN picked for the cached plan of this problem ("" when none is cached).
std::string cudnn_attention_engine(bool backward, const AttnShape& s, double scale);

}  // namespace dm::cuda
