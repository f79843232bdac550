// Kimi Delta Attention on CUDA (SPEC §1.1): the GPU twins of ops/cpu/kda.h. Plain C++ header
// (C++17, no CUDA includes); kernels in kda_recurrent.cu, kda_chunk.cu, kda_chunk_backward.cu.
//
// Same layout and semantics as the CPU operator (ops/cpu/kda.h), all pointers DEVICE pointers:
//   q, k, g : [B, T, H, K]   v, o : [B, T, H, V]   beta : [B, T, H]   s0, sT : [B, H, K, V] fp32
// q, k are L2-normalised inside (z / sqrt(Σz² + 1e-6)), q is scaled by `scale`; per token
//   S ← Diag(e^{g_t})·S;  S ← S + β_t k̂_t (v_t − Sᵀk̂_t)ᵀ;  o_t = Sᵀ q̂_t.
// g ≤ 0 is the log-decay, used down to −27 per step (every exponent formed is ≤ 0).
// s0 == nullptr: zero initial state; sT == nullptr: final state not wanted; s0 may equal sT
// (state carried in place between decode calls).
// Inputs q, k, v, g, beta and the output o are float or bf16 bit patterns (uint16_t; all five
// inputs and o share one type); the state is always fp32 and all arithmetic accumulates in fp32.
// doc_start (optional, device [B·T] int32, docs/backward.md): token t > 0 with
// doc_start[b·T + t] == t starts a document and sees a zero state. It must be valid (as the
// CPU op checks on host); the GPU does not re-check it.
// stream: a cudaStream_t (nullptr = default stream). Nothing here synchronises.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cpu/kda.h"  // KdaShape

struct CUstream_st;

namespace dm::cuda {

using KdaStream = CUstream_st*;

// Chunk length of the chunked kernels (SPEC: C = 64), and the largest head dims they take.
constexpr int kKdaCudaChunk = 64;
constexpr int kKdaCudaMaxHeadDim = 128;
// Largest K of the recurrent kernel (its state tile [K, 32] lives in shared memory).
constexpr int kKdaCudaRecurrentMaxK = 256;

// ---- Recurrent form: one token at a time (the definition). With T = 1 this is the decode step
// for B sequences at once (state [B, H, K, V] in place: s0 == sT). Any V; K ≤ 256.
void kda_recurrent_forward(const float* q, const float* k, const float* v, const float* g,
                           const float* beta, const float* s0, float* o, float* sT,
                           const KdaShape& s, float scale, const int32_t* doc_start = nullptr,
                           KdaStream stream = nullptr);
void kda_recurrent_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                           const uint16_t* g, const uint16_t* beta, const float* s0, uint16_t* o,
                           float* sT, const KdaShape& s, float scale,
                           const int32_t* doc_start = nullptr, KdaStream stream = nullptr);

// ---- Chunked form (C = 64; K, V ≤ 128, any T ≥ 0). Three stages, each a kernel:
//   prepare (parallel over chunks): Γ = in-chunk cumsum of g, the masked intra-chunk products L,
//     P with every exponent ≤ 0 (factored through a reference token: the row block's first
//     token across 16-token sub-blocks, the middle token inside one while its decays stay in
//     range, else pair by pair), W = A·Diag(β)·(K⊙e^Γ), U = A·Diag(β)·V with
//     A = (I + Diag(β)L)⁻¹ (by sub-blocks: the diagonal blocks' inverses, then tf32 products),
//     Q⊙e^Γ, K⊙e^{γ−Γ}, e^γ;
//   state (sequential over chunks, parallel over B·H and 16- or 32-column tiles of V):
//     V' = U − W·S, S ← Diag(e^γ)·S + (K⊙e^{γ−Γ})ᵀ·V', storing S at every chunk start;
//   output (parallel over chunks): O = (Q⊙e^Γ)·S + P·V'.
// fp32 inputs run every product on CUDA cores in fp32; bf16 inputs run the state products on
// tensor cores in tf32 (kda_chunk_state_tf32.cu; the state itself stays fp32) and the output
// products in bf16 (fp32 accumulation).
// `workspace`: kda_chunk_forward_workspace_bytes(s) bytes of device memory; after the call it
// holds the chunk-start states and the intra-chunk quantities (kda_chunk_backward reads none of
// them: it recomputes what it needs).
size_t kda_chunk_forward_workspace_bytes(const KdaShape& s);
// The state at the start of chunk `chunk` (after chunk·kKdaCudaChunk tokens; chunk <
// ceil(T / 64)) of batch row b, as the last kda_chunk_forward on `workspace` for shape s left
// it: dst [H, K, V] fp32, host or device memory (the prefix cache checkpoints a prefill inside
// its one chunked pass with this). Stream-ordered after that forward.
void kda_chunk_forward_state_at(const void* workspace, const KdaShape& s, int64_t b, int64_t chunk,
                                float* dst, KdaStream stream = nullptr);
void kda_chunk_forward(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, const float* s0, float* o, float* sT,
                       const KdaShape& s, float scale, void* workspace,
                       const int32_t* doc_start = nullptr, KdaStream stream = nullptr);
void kda_chunk_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                       const uint16_t* g, const uint16_t* beta, const float* s0, uint16_t* o,
                       float* sT, const KdaShape& s, float scale, void* workspace,
                       const int32_t* doc_start = nullptr, KdaStream stream = nullptr);

// ---- Backward of the chunked form (gradients of Σ o·d_o + Σ sT·dsT), matching
// kda_chunk_backward on CPU: dq, dk with respect to the raw (pre-L2-norm) q, k. Every gradient
// is fp32 and ACCUMULATED (+=). dsT == nullptr means dsT = 0; ds0 == nullptr: not wanted.
//   d_o [B,T,H,V] (input type), dsT/ds0 [B,H,K,V], dq/dk/dg [B,T,H,K], dv [B,T,H,V], dbeta [B,T,H].
// It runs the forward's prepare and state stages again (chunk-start states; skipped with
// workspace_holds_forward, below), then a sequential stage over chunks for the state gradient at
// every chunk end, then one parallel stage per chunk. On the TensorCore path the two sequential
// stages are tf32 tensor-core kernels (the state gradient needs V % 8 == 0 and falls back to the
// fp32 kernel otherwise); the Reference path keeps all of stages 1–4 in fp32 on CUDA cores.
// Stage 4 of the bf16 backward has three implementations: Reference (the fp32 CUDA-core kernel,
// one block per chunk-head with a global scratch), TensorCore (kda_chunk_backward_tc.cu: one
// fused kernel, mma.sync with operands in shared memory, pairwise decays factored through
// 16-token sub-blocks; one block per SM) and TensorCoreSplit, the default: the same products in
// two kernels that fit two blocks per SM each (kda_chunk_backward_value.cu over halves of V,
// kda_chunk_backward_key.cu over halves of K as a cluster of two), which hand dP, dM, dβ
// partials and dX over through the workspace. H200, (1,8192,16,128) fwd+bwd reusing the forward:
// 5.58 ms fused, 3.03 ms split (2026-11-30, eighteenth session). Shapes the split does not take
// (kda_backward_split_supported: KP % 32 or VP % 32 ≠ 0) run the fused kernel. Env
// DM_KDA_BACKWARD=ref|tc|tc-split (read once) overrides the default. fp32 inputs always take the
// reference path. The workspace size depends on the path (the split adds (4C + VP)·C floats per
// chunk-head): size it with the path the call will use.
// accumulate = false (bf16 overload): dq, dk, dv, dg and dβ are STORED, not added to (the split
// kernels write each element once; the other paths zero them first), so callers that want the
// gradients alone skip a zeroing pass; ds0 accumulates either way.
// workspace_holds_forward (bf16, TensorCore paths only; ignored otherwise): `workspace` (sized by
// kda_chunk_backward_workspace_bytes) was just filled by kda_chunk_forward on exactly these
// inputs (q, k, v, g, beta, s0, doc_start, scale): the prepare and state stages are not run
// again (the forward's bf16 path computes them with the same kernels, so nothing changes but
// the time: 1.9 of 11.9 ms at (1,8192,16,128) on an H200).
enum class KdaBackwardPath : uint8_t { Reference, TensorCore, TensorCoreSplit };
KdaBackwardPath kda_backward_default_path();
bool kda_backward_split_supported(const KdaShape& s);

size_t kda_chunk_backward_workspace_bytes(const KdaShape& s,
                                          KdaBackwardPath path = kda_backward_default_path());
// backward_own (bf16 overload): when not null, the backward's own region (dS' per chunk and the
// stage-4 scratch, kda_chunk_backward_own_bytes) comes from it, and `workspace` needs only the
// forward's kda_chunk_forward_workspace_bytes: a training step that keeps each layer's forward
// workspace until its backward then keeps only that, and lends the rest from its scratch.
size_t kda_chunk_backward_own_bytes(const KdaShape& s,
                                    KdaBackwardPath path = kda_backward_default_path());
void kda_chunk_backward(const float* q, const float* k, const float* v, const float* g,
                        const float* beta, const float* s0, const float* d_o, const float* dsT,
                        float* dq, float* dk, float* dv, float* dg, float* dbeta, float* ds0,
                        const KdaShape& s, float scale, void* workspace,
                        const int32_t* doc_start = nullptr, KdaStream stream = nullptr);
void kda_chunk_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* g,
                        const uint16_t* beta, const float* s0, const uint16_t* d_o,
                        const float* dsT, float* dq, float* dk, float* dv, float* dg, float* dbeta,
                        float* ds0, const KdaShape& s, float scale, void* workspace,
                        const int32_t* doc_start = nullptr, KdaStream stream = nullptr,
                        KdaBackwardPath path = kda_backward_default_path(),
                        bool workspace_holds_forward = false, void* backward_own = nullptr,
                        bool accumulate = true);

// ---- Diagnostics (bench_cuda_kda --phases). While enabled, thread 0 of one block of the
// tensor-core stage 4 (the middle chunk of the first batch-head) stamps the SM clock at each of
// the kernel's phase boundaries. _cycles copies up to max_phases of the last backward's stamps,
// as cycles since the block's start, with the phase names (static strings); returns the count.
// Synchronous (a symbol copy).
void kda_stage4_phase_clock(bool enable);
int kda_stage4_phase_cycles(long long* cycles, const char** names, int max_phases);
// Dynamic shared memory per block of stage 4's tensor-core kernels at shape s (host arithmetic,
// no GPU needed): an H200 SM holds two blocks of up to 113 KB (228 KB less 1 KB per block).
struct KdaStage4SharedBytes {
  size_t fused, value, key;
};
KdaStage4SharedBytes kda_stage4_shared_bytes(const KdaShape& s);
// The same for one block (half 0) of each kernel of the split stage 4: kernel 0 = value, 1 = key.
void kda_stage4_split_phase_clock(bool enable);
int kda_stage4_split_phase_cycles(int kernel, long long* cycles, const char** names,
                                  int max_phases);
// The same for one block of the forward's tensor-core prepare stage.
void kda_prepare_phase_clock(bool enable);
int kda_prepare_phase_cycles(long long* cycles, const char** names, int max_phases);

}  // namespace dm::cuda
