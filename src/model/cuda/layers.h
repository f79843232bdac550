// The sub-layers of SPEC §1 on the GPU, forward (inference / prefill): the twins of
// model/kda.h kda_layer_forward, model/mla.h mla_layer_forward, model/moe.h moe_layer_forward and
// dense_ffn_forward. Implemented in kda_gpu.cpp, mla_gpu.cpp, moe_gpu.cpp, ffn_gpu.cpp.
//
// Contract shared by all of them:
//   xn  [N = B·T, d] bf16 (device): the RMS-normed rows the CPU layer takes as x.
//   y   [N, d] fp32 (device): WRITTEN with the sub-layer output (what the residual stream adds).
//   residual [N, d] fp32 (device, nullable, the trailing argument): then y = residual + output,
//       the residual stream's add done by the output GEMM's epilogue (the trainer's layers).
//   w   the HOST weight views of model/weights.h; their device twins are dw.bf16(p) / dw.f32(p).
//   doc_start [B·T] int32 (device, nullable): packed documents as on the CPU (docs/backward.md).
// Temporaries come from run.scratch inside a DeviceArenaScope (released on return); the
// *_bytes functions say how much scratch one call needs, so the model sizes run.scratch once.
// Precision: bf16 GEMM operands and activations between ops, fp32 accumulation, fp32 KDA state,
// softmax statistics and router scores; fp32 element-wise math.
// The fp32 GPU mode (DeviceWeights with WeightPrecision::F32; inference only): the forwards
// taking `const float* xn` run the same op sequence with every activation and GEMM operand in
// fp32 (fp32 twins of the same kernels, cuBLAS fp32 GEMMs without TF32), so they match the CPU
// float engine to ~1e-6. Their *_bytes take the precision. No decode carry, nothing kept.
// Nothing here synchronises the stream unless its comment says so.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/cuda/gpu_run.h"
#include "ops/cuda/moe.h"

namespace dm::cuda {

// What a prompt's forward leaves for cached decoding (B = 1, decode_gpu.h): the final KDA state
// and each branch's last Kc−1 raw (pre-conv) projections, oldest first, zero rows standing in for
// positions before 0 — exactly what the decode step's conv tail holds.
// continues = true: the call continues a sequence whose carry these buffers already hold (a
// prompt prefilled in pieces, or after a cached prefix): the state is the operator's initial
// state and the tails the short convs' left context; both are then overwritten with the carry
// after this call's tokens. false: the tokens start at position 0 (the buffers are only written).
// Checkpoints (the prefix cache, B = 1 only): after checkpoint_tokens[i] tokens of THIS call
// (strictly increasing multiples of kKdaCudaChunk = 64 in [64, T]), the state goes to
// checkpoint_state[i] [H, K, K] fp32 and the conv tails (as `tail` would hold them there) to
// checkpoint_tails[3·i + {0,1,2}] [Kc−1, H·K] bf16 — host or device memory (copies with
// cudaMemcpyDefault on the run's stream; pageable host memory makes them synchronous).
struct KdaCarry {
  float* state = nullptr;  // [H, K, K] fp32
  uint16_t* tail[3] = {};  // q, k, v: [Kc−1, H·K] bf16
  bool continues = false;
  int checkpoint_count = 0;
  const int64_t* checkpoint_tokens = nullptr;   // [count]
  float* const* checkpoint_state = nullptr;     // [count]
  uint16_t* const* checkpoint_tails = nullptr;  // [3·count]
};
// kept (training without the mixer recompute; nullable): kda_layer_kept_gpu_bytes of device
// memory, 256-byte aligned, where the forward leaves every intermediate for
// kda_layer_backward_gpu with the same `kept`, which then skips its recompute.
// A (xn's type): uint16_t (bf16) or float (the fp32 mode).
size_t kda_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T,
                                   WeightPrecision precision = WeightPrecision::Bf16);
size_t kda_layer_kept_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T);
template <typename A>
void kda_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const KdaWeights& w, const A* xn,
                           float* y, int64_t B, int64_t T, const int32_t* doc_start = nullptr,
                           const KdaCarry* carry = nullptr, void* kept = nullptr,
                           const float* residual = nullptr);

// kept (training without the mixer recompute; nullable, bf16 only): mla_layer_kept_gpu_bytes
// of device memory, 256-byte aligned, where the forward leaves its activations (q, the latent
// path, k, v, the ungated attention output, the gate pre-activation) and the attention's lse
// for mla_layer_backward_gpu with the same `kept`, which then skips its recompute.
size_t mla_layer_forward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T,
                                   WeightPrecision precision = WeightPrecision::Bf16);
size_t mla_layer_kept_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T);
template <typename A>
void mla_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MlaWeights& w, const A* xn,
                           float* y, int64_t B, int64_t T, const int32_t* doc_start = nullptr,
                           void* kept = nullptr, const float* residual = nullptr);

size_t dense_ffn_forward_gpu_bytes(const ModelConfig& c, int64_t N,
                                   WeightPrecision precision = WeightPrecision::Bf16);
// kept_gate_up (training without recompute; nullable, bf16 only): dense_ffn_kept_gpu_bytes of
// device memory where the forward leaves g | u ([N, 2F] bf16 rows, from its one gate/up GEMM) for
// dense_ffn_backward_gpu, which then skips their recompute.
size_t dense_ffn_kept_gpu_bytes(const ModelConfig& c, int64_t N);
template <typename A>
void dense_ffn_forward_gpu(GpuRun& run, const DeviceWeights& dw, const FfnWeights& w, const A* xn,
                           float* y, int64_t N, const float* residual = nullptr,
                           uint16_t* kept_gate_up = nullptr);

// Routing of one MoE forward, for QB and balance metrics (device pointers into run.scratch that
// stay valid until the caller's enclosing scope ends; nullptr = not wanted).
struct MoeRoutingDevice {
  float* scores = nullptr;   // [N, E] sigmoid router scores
  float* cutoff = nullptr;   // [N]   (k+1)-th biased score
  int32_t* idx = nullptr;    // [N, k]
};
// How the routed experts run:
//   Grouped   dispatch plan + grouped tensor-core GEMMs (ops/cuda/moe.h) through
//             moe_gemm_default_path(): by default our grouped kernels, which read the plan's
//             offsets on the device (no synchronisation, capturable in a CUDA graph); with
//             DM_MOE_GEMM=cublas|loop, cuBLAS as GroupedCublas. Prefill, training, large N.
//   GroupedCublas  the same plan + cuBLAS' grouped GEMM: synchronises the stream once (the
//             per-expert row counts go to the host for its launches). Faster than ours at a few
//             rows per expert (our CTAs multiply 128-row tiles): the decoder's larger batches.
//   Gathered  ops/cuda/moe_decode.h: routing read on the device, each hit expert's weights
//             streamed once by CUDA-core GEMV kernels; never synchronises, so it can be captured
//             in a CUDA graph (the decode step). Needs moe_decode_supported; fast while
//             moe_decode_preferred (few rows per expert).
// Everything else (router, latent projections and norm, shared experts) is the same code.
enum class MoeExpertsPath : uint8_t { Grouped, GroupedCublas, Gathered };

// What the MoE forward keeps for its backward when training without recompute (Grouped path
// only): the routing (scores, idx, weights), the dispatch plan (with the host copy of its
// offsets when the GEMMs are cuBLAS'), the latent input z and the combined expert output u (fp32,
// before the latent norm), the experts' intermediates (the workspace moe_experts_recompute
// fills: sorted rows, g, u, h, outputs) and the shared experts' g and u. The backward then runs no
// router GEMM, no dispatch plan (so no stream synchronisation) and no expert GEMM of the forward
// again. `device` holds moe_layer_kept_gpu_bytes (256-byte aligned); the views below are set by the
// forward.
struct MoeKept {
  void* device = nullptr;
  size_t bytes = 0;
  float* scores = nullptr;             // [N, E]
  int32_t* idx = nullptr;              // [N, k]
  float* weight = nullptr;             // [N, k]
  MoeDispatchPlan plan;                // arrays in `device`, host_offsets → the vector below
  std::vector<int64_t> host_offsets;   // [E + 1]
  const uint16_t* z = nullptr;         // [N, ℓ] bf16 (latent; plain MoE: the caller's xn)
  float* u = nullptr;                  // [N, ℓ] fp32 (latent only)
  void* workspace = nullptr;           // moe_experts_backward_workspace_bytes
  // The shared experts' pre-activations g | u as [N, 2·Fs] bf16 rows (moe_backward.h
  // glu_ffn_backward): their backward skips the recompute GEMM (null without shared experts).
  const uint16_t* shared_gate_up = nullptr;
  int64_t N = 0;                       // rows the forward kept (the backward checks it)
};
size_t moe_layer_kept_gpu_bytes(const ModelConfig& c, int64_t N);

// Scratch for either path.
size_t moe_layer_forward_gpu_bytes(const ModelConfig& c, int64_t N,
                                   WeightPrecision precision = WeightPrecision::Bf16);
void moe_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MoeWeights& w,
                           const uint16_t* xn, float* y, int64_t N,
                           MoeRoutingDevice* routing = nullptr,
                           MoeExpertsPath path = MoeExpertsPath::Grouped, MoeKept* kept = nullptr,
                           const float* residual = nullptr);
// The fp32 mode: router, latent projections, experts (ops/cuda/moe.h fp32 experts, one cuBLAS
// fp32 GEMM per expert: synchronises the stream once for the plan) and shared experts in fp32.
// routing as above (idx, scores, cutoff wanted or nullptr).
void moe_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MoeWeights& w,
                           const float* xn, float* y, int64_t N,
                           MoeRoutingDevice* routing = nullptr);

// ---- Backward (training) ----------------------------------------------------------------------
// Each sub-layer backward RECOMPUTES its forward internals from xn (the model keeps only each
// layer's input between its forward and backward, like the CPU's per-layer recompute), then
// back-propagates, the twins of model/{kda,mla,moe}.h *_backward:
//   xn    [N, d] bf16 (device): the same rows the forward took (and the same doc_start).
//   dy    [N, d] fp32 (device): ∂L/∂y.
//   dxn   [N, d] fp32 (device): WRITTEN with ∂L/∂xn.
//   grads ACCUMULATED (+=), fp32, into every trainable parameter of the layer at grads.at(w.<p>)
//         (the MoE routing bias gets nothing: QB sets it).
// Scratch from run.scratch inside a DeviceArenaScope; *_backward_gpu_bytes is the most one call
// takes. GEMM operands are bf16 (dy is rounded once for them), accumulation and the gradients
// of element-wise parameters fp32. The MoE backward synchronises the stream once (its dispatch
// plan), the others never.
// kept: what kda_layer_forward_gpu kept (nullable: recompute); the scratch then excludes it.
size_t kda_layer_backward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T,
                                    bool kept = false);
void kda_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const KdaWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t B, int64_t T, const int32_t* doc_start = nullptr,
                            void* kept = nullptr);

// kept: what mla_layer_forward_gpu kept (nullable: recompute).
size_t mla_layer_backward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T);
void mla_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const MlaWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t B, int64_t T, const int32_t* doc_start = nullptr,
                            const void* kept = nullptr);

size_t dense_ffn_backward_gpu_bytes(const ModelConfig& c, int64_t N);
void dense_ffn_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const FfnWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t N, const uint16_t* kept_gate_up = nullptr);

// kept: what moe_layer_forward_gpu kept (nullable: recompute, with one stream synchronisation
// for the dispatch plan).
size_t moe_layer_backward_gpu_bytes(const ModelConfig& c, int64_t N);
void moe_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const MoeWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t N, const MoeKept* kept = nullptr);

}  // namespace dm::cuda
