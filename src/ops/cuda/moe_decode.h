// Routed experts for a few tokens without a host synchronisation (the decode step's MoE,
// model/cuda/decode_gpu.h): the twin of moe.h moe_experts_forward
//     y[t] = Σ_slot w[t, slot] · E_{idx[t, slot]}(x[t]),   E_j(x) = W_down,j · act(W_gate,j x,
//     W_up,j x)
// that reads the routing (idx, w) from DEVICE memory and launches a grid whose shape depends on
// (N, k, E) only, so the whole call can be captured in a CUDA graph and replayed. The grouped
// path (moe.h) instead copies per-expert row counts to the host to size its GEMMs.
// Plain C++17 header (no CUDA includes); kernels in moe_decode.cu.
//
// Up to 32 (token, expert) pairs (batch ≤ 4 at k = 8), two launches with no plan (plus N
// shared-expert pairs when SharedExpertBf16 is given):
//   gate/up   grid (F / (16·steps), pairs): block (f-tile, pair) streams rows of the pair's
//             expert's W_gate and W_up: h[pair, f] = act(g, u) in fp32, stored bf16 [pairs, F]
//   down      grid (Din / C): block (C channels), its warps over the pairs, the dots in shared
//             memory, then y[t, c] = Σ_slot w[t, slot]·dot[t·k + slot] in slot order
//   (steps = 2, C = 8 and a warp per pair up to 16 pairs, so each kernel is one wave on the 48B
//   shape; steps = 1, C = 4 and 8 warps beyond: moe_decode.cu pair_plan)
// Beyond that, four launches, each reading what the previous one wrote:
//   plan      one block: rows of each expert in (token, slot) order, the list of experts the
//             batch hits (ascending), their row ranges; a device count of them
//   gate/up   grid (F / 16, min(E, N·k)): block (f-tile, a) streams rows f..f+15 of W_gate and
//             W_up of the a-th hit expert ONCE and applies them to every token routed to it
//             (tokens in passes of 4 against the same rows, which later passes re-read from
//             L1/L2): h[pair, f] = act(g, u) in fp32, stored bf16 [N·k, F]
//   down      grid (Din / 32, min(E, N·k)): o[pair, c] = W_down,e[c, :]·h[pair, :], fp32
//             [N·k, Din]
//   combine   y[t, :] = Σ_slot w[t, slot]·o[t·k + slot, :] in slot order (deterministic)
// Blocks past the device count of hit experts exit at once. Both paths compute every dot and
// sum in the same order, so they give the same bits. A warp owns whole weight rows and
// streams them with 16-byte loads (lane i takes 16-byte chunks i, i + 32, …, four chunks in flight
// per row), dot products in fp32, one warp reduction per (row, token).
//
// Bytes: each hit expert's 3·F·Din bf16 weights once (+ the tiny x, h, o); FLOPs 6·F·Din per
// (token, slot), on CUDA cores: at ~14 FLOP per weight byte of ridge (H200: ~60 TFLOP/s fp32
// FMA vs ~4.8 TB/s) the kernels stay memory-bound up to ~8 rows per hit expert, hence
// moe_decode_preferred. Results do not depend on scheduling (no atomics on values).
//
// Preconditions: the experts of one token are distinct (moe_route guarantees it); an expert id
// outside [0, E) contributes nothing (no error is reported: that would need the host).
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/elementwise.h"  // GluKernelParams
#include "ops/cuda/gemm.h"         // GemmOutType
#include "ops/cuda/moe.h"          // ExpertWeightsBf16

struct CUstream_st;

namespace dm::cuda {

// Largest expert count of the plan kernel (its per-expert counters live in shared memory).
inline constexpr int kMoeDecodeMaxExperts = 4096;

// Shapes the kernels take: E ≤ kMoeDecodeMaxExperts, 1 ≤ k ≤ E, Din and F positive multiples
// of 8 (16-byte rows), N·k < 2^31.
bool moe_decode_supported(int64_t N, int k, const ExpertWeightsBf16& ew);
// The bound of the decode path: mean rows per expert N·k/E ≤ 1. By bytes the kernels could stay
// ahead up to ~8 (header comment), but measured at N·k = 2E the grouped GEMMs were faster
// (moe_decode.cu), so the bound is where the measurement says.
bool moe_decode_preferred(int64_t N, int k, int64_t E);

// The layer's shared experts, fused to one of width F (gate, up [F, Din], down [Din, F] bf16),
// for the pair path to take as N more pairs: pair N·k + t applies them to token t, and the
// combine adds its output after the routed slots with weight 1 (the CPU's y += shared_out).
// One launch each for gate/up and down instead of the separate GEMVs and GLU (three launches a
// decode layer fewer, and the router's GEMV no longer carries the shared gate and up).
struct SharedExpertBf16 {
  const uint16_t* gate = nullptr;
  const uint16_t* up = nullptr;
  const uint16_t* down = nullptr;
  // Ask for its rows into L2 before the kernels' PDL wait, where decode_l2_prefetch(N) says so.
  bool prefetch = true;
};
// Whether moe_decode_experts_forward takes a shared expert of width Fs for this call: the pair
// path (N·k ≤ 32, not forced to the plan) and Fs == F; env DM_MOE_DECODE_FOLD_SHARED=0 (read
// once) says no, keeping the shared expert's own launches.
bool moe_decode_folds_shared(int64_t N, int k, const ExpertWeightsBf16& ew, int64_t Fs);

// Device scratch: the plan, h [N·k (+ N with a shared expert), F] bf16 and o [N·k, Din] fp32.
size_t moe_decode_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew,
                                  bool shared = false);

// y[N, Din] (WRITTEN, fp32 or bf16 per y_type) = Σ_slot w[t, slot]·E_{idx[t, slot]}(x[t]).
// x [N, Din] bf16, idx [N, k] int32, w [N, k] fp32 (device); workspace ≥
// moe_decode_workspace_bytes (256-byte aligned; with `shared` true when shared is given). x and
// y 16-byte aligned. shared (optional, device weights): folded in as above; only where
// moe_decode_folds_shared says so. Never synchronises, never allocates.
void moe_decode_experts_forward(const uint16_t* x, const int32_t* idx, const float* w, int64_t N,
                                int k, const ExpertWeightsBf16& ew, const GluKernelParams& act,
                                void* y, GemmOutType y_type, void* workspace,
                                CUstream_st* stream = nullptr,
                                const SharedExpertBf16* shared = nullptr);

// Tests: take the planned path even up to 32 pairs, where the pair kernels run by default (the
// two must give the same bits). Process-wide; off by default.
void moe_decode_force_plan_kernel(bool on);

}  // namespace dm::cuda
