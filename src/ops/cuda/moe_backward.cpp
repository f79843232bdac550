// Checked entry points of the GPU MoE / gated-FFN backward ops (moe_backward.h): argument
// validation with the CPU structs, workspace carving and the order of GEMMs and kernels.
// Compiled as C++20 by the host compiler (the .cu files are C++17).
#include "ops/cuda/moe_backward.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/env.h"
#include "core/error.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_experts_chain.h"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda {

namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

void check_aligned(const char* who, const void* p, const char* name) {
  DM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, who, ": ", name,
           " must be 16-byte aligned (vector loads)");
}

// GroupedOwn runs on a plan without host offsets; the cuBLAS paths need them.
void check_plan(const char* who, const MoeDispatchPlan& plan, const ExpertWeightsBf16& ew,
                MoeGemmPath path) {
  DM_CHECK(plan.offsets && plan.row_of_pair && plan.token && plan.slot, who,
           ": dispatch plan not built");
  DM_CHECK(plan.host_offsets || path == MoeGemmPath::GroupedOwn, who,
           ": the cuBLAS paths need the plan's host offsets (moe_dispatch_plan_build with a host "
           "buffer)");
  DM_CHECK(!plan.host_offsets || plan.host_offsets[plan.E] == plan.N * plan.k, who,
           ": plan covers ", plan.host_offsets ? plan.host_offsets[plan.E] : 0,
           " rows, expected N·k = ", plan.N * plan.k);
  DM_CHECK(plan.E == ew.E, who, ": plan has ", plan.E, " experts, weights have ", ew.E);
  DM_CHECK(ew.Din > 0 && ew.F > 0 && ew.Din % 8 == 0 && ew.F % 8 == 0, who,
           ": Din and F must be positive multiples of 8, got Din=", ew.Din, " F=", ew.F);
  DM_CHECK(ew.Din <= std::numeric_limits<int32_t>::max() / 2 &&
               ew.F <= std::numeric_limits<int32_t>::max() / 2,
           who, ": expert dims exceed int32");
  DM_CHECK(ew.gate && ew.up && ew.down, who, ": expert weights missing");
}

// The workspace of moe_experts_recompute / moe_experts_backward, carved the same way by both
// (R = N·k rows in the plan's expert-sorted order).
struct ExpertBuffers {
  uint16_t* x_sorted;      // [R, Din] gathered inputs
  uint16_t* gate;          // [R, F]   g (pre-activation)
  uint16_t* up;            // [R, F]   u (pre-activation) → du after the GLU backward
  uint16_t* h;             // [R, F]   act(g, u) → dh → dg
  uint16_t* out;           // [R, Din] E_j(x_t) per row → dout = w·dy rows
  float* dx_sorted;        // [R, Din] ∂L/∂x per row (fp32: summed per token afterwards)
  const void** pointers;   // grouped GEMM pointer arrays (9E: the recompute's forward layout;
                           // the backward's dh GEMM reuses the first 3E)
};

ExpertBuffers carve(void* workspace, int64_t rows, const ExpertWeightsBf16& ew) {
  char* cursor = static_cast<char*>(workspace);
  auto take = [&](size_t bytes) {
    void* p = cursor;
    cursor += round_up_256(bytes);
    return p;
  };
  const size_t R = size_t(std::max<int64_t>(rows, 1)), Din = size_t(ew.Din), F = size_t(ew.F);
  ExpertBuffers b;
  b.x_sorted = static_cast<uint16_t*>(take(R * Din * 2));
  b.gate = static_cast<uint16_t*>(take(R * F * 2));
  b.up = static_cast<uint16_t*>(take(R * F * 2));
  b.h = static_cast<uint16_t*>(take(R * F * 2));
  b.out = static_cast<uint16_t*>(take(R * Din * 2));
  b.dx_sorted = static_cast<float*>(take(R * Din * 4));
  b.pointers = static_cast<const void**>(take(moe_detail::expert_pointer_array_bytes(int(ew.E))));
  return b;
}

// The grouped products through the wgmma kernels or the mma.sync ones (moe.h
// moe_grouped_wgmma_backward()); the same contracts (moe_kernels.h). store: C = the product
// (the wgmma kernel writes it without reading C; the mma.sync one accumulates onto zeros).
void grouped_weight_grad(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                         const int64_t* offsets, int E, int64_t R, int64_t M, int64_t N, float* C,
                         CUstream_st* stream, bool store) {
  if (moe_grouped_wgmma_backward()) {
    moe_detail::launch_grouped_weight_grad_wgmma(A, lda, B, ldb, offsets, E, R, M, N, C, stream,
                                                 store);
    return;
  }
  if (store) fill_zero_async(C, size_t(E * M * N) * sizeof(float), stream);
  moe_detail::launch_grouped_weight_grad(A, lda, B, ldb, offsets, E, M, N, C, stream);
}
void grouped_rows_bf16(const uint16_t* A, const uint16_t* B, const int64_t* offsets, int E,
                       int64_t R, int64_t K, int64_t N, uint16_t* Y, CUstream_st* stream) {
  if (moe_grouped_wgmma_backward())
    moe_detail::launch_grouped_rows_bf16_wgmma(A, B, offsets, E, R, K, N, Y, stream);
  else
    moe_detail::launch_grouped_rows_bf16(A, B, offsets, E, R, K, N, Y, stream);
}
void grouped_rows_f32(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                      const uint16_t* B2, const int64_t* offsets, int E, int64_t R, int64_t K,
                      int64_t N, float* Y, CUstream_st* stream) {
  if (moe_grouped_wgmma_backward())
    moe_detail::launch_grouped_rows_f32_wgmma(A1, B1, A2, B2, offsets, E, R, K, N, Y, stream);
  else
    moe_detail::launch_grouped_rows_f32(A1, B1, A2, B2, offsets, E, R, K, N, Y, stream);
}

}  // namespace

size_t moe_experts_backward_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew) {
  const size_t R = size_t(std::max<int64_t>(N * k, 1)), Din = size_t(ew.Din), F = size_t(ew.F);
  return round_up_256(R * Din * 2) + 3 * round_up_256(R * F * 2) + round_up_256(R * Din * 2) +
         round_up_256(R * Din * 4) +
         round_up_256(moe_detail::expert_pointer_array_bytes(int(ew.E)));
}

void moe_experts_recompute(GemmContext& gemm, const uint16_t* x, const MoeDispatchPlan& plan,
                           const float* w, const ExpertWeightsBf16& ew, const GluActivation& act,
                           float* y, void* workspace, MoeGemmPath path, CUstream_st* stream) {
  const char* who = "moe_experts_recompute (cuda)";
  check_plan(who, plan, ew, path);
  DM_CHECK(x && w && workspace, who, ": null argument");
  if (plan.N == 0) return;
  const int64_t rows = plan.N * plan.k, Din = ew.Din, F = ew.F;
  const ExpertBuffers buf = carve(workspace, rows, ew);
  moe_permute_rows(x, plan, Din, buf.x_sorted, stream);
  // The forward's chain, with h in its own buffer so g survives for the backward.
  moe_detail::ExpertGemmBuffers b;
  b.gate_w = ew.gate;
  b.up_w = ew.up;
  b.down_w = ew.down;
  b.x_sorted = buf.x_sorted;
  b.gate_out = buf.gate;
  b.up_out = buf.up;
  b.expert_out = buf.out;
  b.pointer_arrays = buf.pointers;
  b.E = int(ew.E);
  b.Din = Din;
  b.F = F;
  moe_detail::run_expert_chain(gemm, b, plan, act, buf.h, path, stream);
  if (y) moe_unpermute_rows(buf.out, plan, w, Din, y, GemmOutType::F32, stream);
}

// DM_MOE_GROUPED_F32=cublas: the grouped path's fp32-output GEMMs one cuBLAS call per expert.
static bool grouped_f32_kernels() {
  static const bool on = [] { return env_choice("DM_MOE_GROUPED_F32", {"own", "cublas"}) == 0; }();
  return on;
}

void moe_experts_backward(GemmContext& gemm, const MoeDispatchPlan& plan, const float* w,
                          const ExpertWeightsBf16& ew, const GluActivation& act, const float* dy,
                          float* dweights, float* dx, bool dx_accumulate,
                          const ExpertGradsF32& grads, void* workspace, CUstream_st* stream,
                          MoeGemmPath path) {
  const char* who = "moe_experts_backward (cuda)";
  check_plan(who, plan, ew, path);
  DM_CHECK(w && dy && workspace, who, ": null argument");
  check_aligned(who, dy, "dy");
  if (dx) check_aligned(who, dx, "dx");
  if (plan.N == 0) return;
  const int64_t N = plan.N, rows = N * plan.k, Din = ew.Din, F = ew.F;
  const int k = plan.k;
  const ExpertBuffers buf = carve(workspace, rows, ew);

  // Routing-weight gradients read the expert outputs before `out` is reused for dout.
  if (dweights)
    moe_detail::launch_expert_weight_grads(dy, buf.out, plan.row_of_pair, N, k, Din, dweights,
                                           stream);
  // dout[r] = w(t, s)·dy[t] [R, Din] bf16: the expert's output enters y scaled by its routing
  // weight, so the whole expert chain sees w·dy.
  uint16_t* dout = buf.out;
  moe_detail::launch_scale_permute_rows(dy, plan.token, plan.slot, w, rows, k, Din, dout, stream);

  // Down projection out = h·W_downᵀ per expert e (rows [begin, begin + n)):
  //   dW_down[e] [Din, F] += doutᵀ[Din, n]·h[n, F];  dh [n, F] = dout[n, Din]·W_down[e][Din, F]
  // dh overwrites h (stream order: every dW GEMM that reads h_e is queued before the dh GEMM
  // that writes it).
  auto down_weight_grad = [&](int64_t e, int64_t begin, int64_t n) {
    gemm.gemm_bf16(true, false, Din, F, n, 1.0f, dout + begin * Din, Din, buf.h + begin * F, F,
                   1.0f, grads.down + e * Din * F, GemmOutType::F32, F, stream);
  };
  // The grouped paths' fp32-output GEMMs run as our grouped kernels (one launch each); for
  // Grouped, DM_MOE_GROUPED_F32=cublas asks for one cuBLAS GEMM per expert instead (A/B
  // timing). GroupedOwn also runs the dh GEMM as our kernel, so nothing reads host offsets.
  const bool own = path == MoeGemmPath::GroupedOwn;
  const bool grouped = path == MoeGemmPath::Grouped || own;
  const bool ours = own || (grouped && grouped_f32_kernels());
  // grads.store: the gradients hold garbage and the first product stores. Our grouped kernels do
  // that themselves; the cuBLAS products (loop, or Grouped with cuBLAS dW) accumulate onto zeros.
  const bool store = grads.store && ours;
  // GroupedOwn's dh product applies the GLU backward in its epilogue (moe_wgmma_fused_glu).
  const bool fused_glu = own && moe_grouped_wgmma_backward() && moe_wgmma_fused_glu() &&
                         moe_detail::grouped_rows_glu_backward_applies(F, buf.h, buf.gate, buf.up);
  if (grads.store && !ours)
    for (float* g : {grads.gate, grads.up, grads.down})
      if (g) fill_zero_async(g, size_t(ew.E * F * Din) * sizeof(float), stream);
  if (own) {
    if (grads.down)
      grouped_weight_grad(dout, Din, buf.h, F, plan.offsets, int(ew.E), rows, Din, F, grads.down,
                          stream, store);
    // dh [R, F] = dout_e [n_e, Din]·W_down_e [Din, F], written over h (queued after dW_down);
    // with the fused GLU, its epilogue writes dg there and du over u.
    if (fused_glu) {
      moe_detail::launch_grouped_rows_glu_backward_wgmma(dout, ew.down, plan.offsets, int(ew.E),
                                                         rows, Din, F, buf.gate, buf.up, buf.h,
                                                         glu_kernel_params(act), stream);
    } else {
      grouped_rows_bf16(dout, ew.down, plan.offsets, int(ew.E), rows, Din, F, buf.h, stream);
    }
  } else if (grouped) {
    // dW_down has an fp32 C, which cuBLAS' grouped GEMM does not take with bf16 A/B: every
    // expert's in one launch of our grouped kernel, queued before the dh GEMMs overwrite h; then
    // every expert's dh in one grouped call. The recompute's pointer arrays are dead by now
    // (stream order), so the dh arrays reuse the first 3E entries of the same region.
    if (grads.down && ours)
      grouped_weight_grad(dout, Din, buf.h, F, plan.offsets, int(ew.E), rows, Din, F, grads.down,
                          stream, store);
    if (grads.down && !ours)
      for (int64_t e = 0; e < ew.E; ++e) {
        const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
        if (n > 0) down_weight_grad(e, begin, n);
      }
    DM_CHECK(rows <= std::numeric_limits<int32_t>::max(), who, ": ", rows,
             " rows exceed the grouped GEMM's int32 sizes");
    moe_detail::DownBackwardGemm g;
    g.dout = dout;
    g.down_w = ew.down;
    g.dh = buf.h;
    g.pointer_arrays = buf.pointers;
    g.E = int(ew.E);
    g.Din = Din;
    g.F = F;
    void* host = gemm.host_scratch(moe_detail::down_backward_grouped_host_bytes(g.E));
    moe_detail::run_down_backward_grouped(gemm.cublas_handle(), g, plan.host_offsets,
                                          plan.offsets, host, stream);
  } else {
    for (int64_t e = 0; e < ew.E; ++e) {
      const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
      if (n == 0) continue;
      if (grads.down) down_weight_grad(e, begin, n);
      gemm.gemm_bf16(false, false, n, F, Din, 1.0f, dout + begin * Din, Din,
                     ew.down + e * Din * F, F, 0.0f, buf.h + begin * F, GemmOutType::Bf16, F,
                     stream);
    }
  }
  // (dg, du) = GLU backward at the recomputed (g, u): dg over dh, du over u.
  if (!fused_glu) glu_backward(buf.gate, buf.up, buf.h, buf.h, buf.up, rows * F, act, stream);
  const uint16_t* dg = buf.h;
  const uint16_t* du = buf.up;

  // Gate/up projections g = x·W_gateᵀ, u = x·W_upᵀ per expert (every GEMM here has an fp32 C):
  //   dW_gate[e] [F, Din] += dgᵀ[F, n]·x[n, Din] (dW_up likewise with du);
  //   dx rows [n, Din] fp32 = dg·W_gate[e] + du·W_up[e].
  // Grouped path: one launch of our grouped kernels each; loop path: per expert through cuBLAS
  // (the reference).
  if (ours) {
    if (grads.gate)
      grouped_weight_grad(dg, F, buf.x_sorted, Din, plan.offsets, int(ew.E), rows, F, Din,
                          grads.gate, stream, store);
    if (grads.up)
      grouped_weight_grad(du, F, buf.x_sorted, Din, plan.offsets, int(ew.E), rows, F, Din, grads.up,
                          stream, store);
    if (dx)
      grouped_rows_f32(dg, ew.gate, du, ew.up, plan.offsets, int(ew.E), rows, F, Din, buf.dx_sorted,
                       stream);
  }
  for (int64_t e = 0; e < ew.E && !ours; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    const uint16_t* x_rows = buf.x_sorted + begin * Din;
    if (grads.gate)
      gemm.gemm_bf16(true, false, F, Din, n, 1.0f, dg + begin * F, F, x_rows, Din, 1.0f,
                     grads.gate + e * F * Din, GemmOutType::F32, Din, stream);
    if (grads.up)
      gemm.gemm_bf16(true, false, F, Din, n, 1.0f, du + begin * F, F, x_rows, Din, 1.0f,
                     grads.up + e * F * Din, GemmOutType::F32, Din, stream);
    if (dx) {
      float* dx_rows = buf.dx_sorted + begin * Din;
      gemm.gemm_bf16(false, false, n, Din, F, 1.0f, dg + begin * F, F, ew.gate + e * F * Din,
                     Din, 0.0f, dx_rows, GemmOutType::F32, Din, stream);
      gemm.gemm_bf16(false, false, n, Din, F, 1.0f, du + begin * F, F, ew.up + e * F * Din, Din,
                     1.0f, dx_rows, GemmOutType::F32, Din, stream);
    }
  }
  // Per-token sums over the token's k rows, in slot order (one writer per token).
  if (dx)
    moe_detail::launch_unpermute_sum_rows(buf.dx_sorted, plan.row_of_pair, N, k, Din, dx,
                                          dx_accumulate, stream);
}

void moe_route_backward(const float* scores, const int32_t* idx, const float* dweights,
                        int64_t N, const RouterParams& p, float* dlogits, CUstream_st* stream) {
  const int E = p.num_experts, k = p.top_k;
  DM_CHECK(N >= 0 && E > 0 && k >= 1 && k <= E, "moe_route_backward (cuda): bad shape N=", N,
           " E=", E, " k=", k);
  if (N == 0) return;
  DM_CHECK(scores && idx && dweights && dlogits, "moe_route_backward (cuda): null argument");
  moe_detail::launch_route_backward(scores, idx, dweights, N, E, k, p.renormalize, p.scaling,
                                    dlogits, stream);
}

size_t glu_ffn_backward_workspace_bytes(int64_t N, int64_t F) {
  return 3 * round_up_256(size_t(std::max<int64_t>(N, 1)) * size_t(std::max<int64_t>(F, 1)) * 2);
}

void glu_ffn_backward(GemmContext& gemm, const uint16_t* x, const uint16_t* w_gate,
                      const uint16_t* w_up, const uint16_t* w_down, const uint16_t* dy, float* dx,
                      float dx_beta, float* dw_gate, float* dw_up, float* dw_down, int64_t N,
                      int64_t d, int64_t F, const GluActivation& act, void* workspace,
                      CUstream_st* stream, const uint16_t* kept_gate_up, uint16_t* dgu_out,
                      int64_t ld_dgu) {
  DM_CHECK(N >= 0 && d > 0 && F > 0, "glu_ffn_backward (cuda): bad shape N=", N, " d=", d,
           " F=", F);
  DM_CHECK(!dgu_out || (ld_dgu >= 2 * F && glu_gate_up_adjacent(w_gate, w_up, F, d)),
           "glu_ffn_backward (cuda): dg | du into the caller's rows needs adjacent gate and up ",
           "weights and ld_dgu >= 2F (ld_dgu=", ld_dgu, ", F=", F, ")");
  if (N == 0) return;
  DM_CHECK(x && w_gate && w_up && w_down && dy && workspace,
           "glu_ffn_backward (cuda): null argument");
  char* cursor = static_cast<char*>(workspace);
  const size_t view = round_up_256(size_t(N) * size_t(F) * 2);
  uint16_t* h = reinterpret_cast<uint16_t*>(cursor + 2 * view);  // [N, F] h → dh → dg (unfused)
  if (glu_gate_up_adjacent(w_gate, w_up, F, d)) {
    // [N, 2F] rows: g | u (kept, else recomputed by one GEMM), then dg | du over the recomputed
    // ones (the GLU backward reads each element before it writes it) or beside the kept ones.
    uint16_t* dgu = reinterpret_cast<uint16_t*>(cursor);  // the first two views: [N, 2F]
    const uint16_t* gu = kept_gate_up;
    if (!gu) {
      gemm.gemm_bf16(false, true, N, 2 * F, d, 1.0f, x, d, w_gate, d, 0.0f, dgu, GemmOutType::Bf16,
                     2 * F, stream);
      gu = dgu;
    }
    const GluRows rows{F, 2 * F, 0, dgu_out ? ld_dgu : 0};
    const int64_t ld = dgu_out ? ld_dgu : 2 * F;  // dg | du's row stride
    if (dgu_out) dgu = dgu_out;
    glu_forward(gu, gu + F, h, N * F, act, stream, GluRows{F, 2 * F});
    if (dw_down)
      gemm.gemm_bf16(true, false, d, F, N, 1.0f, dy, d, h, F, 1.0f, dw_down, GemmOutType::F32, F,
                     stream);
    gemm.gemm_bf16(false, false, N, F, d, 1.0f, dy, d, w_down, F, 0.0f, h, GemmOutType::Bf16, F,
                   stream);
    glu_backward(gu, gu + F, h, dgu, dgu + F, N * F, act, stream, rows);
    if (dw_gate && dw_up && dw_up == dw_gate + F * d) {
      gemm.gemm_bf16(true, false, 2 * F, d, N, 1.0f, dgu, ld, x, d, 1.0f, dw_gate, GemmOutType::F32,
                     d, stream);
    } else {
      if (dw_gate)
        gemm.gemm_bf16(true, false, F, d, N, 1.0f, dgu, ld, x, d, 1.0f, dw_gate, GemmOutType::F32,
                       d, stream);
      if (dw_up)
        gemm.gemm_bf16(true, false, F, d, N, 1.0f, dgu + F, ld, x, d, 1.0f, dw_up, GemmOutType::F32,
                       d, stream);
    }
    if (dx)
      gemm.gemm_bf16(false, false, N, d, 2 * F, 1.0f, dgu, ld, w_gate, d, dx_beta, dx,
                     GemmOutType::F32, d, stream);
    return;
  }
  uint16_t* gate = reinterpret_cast<uint16_t*>(cursor);       // [N, F] g
  uint16_t* up = reinterpret_cast<uint16_t*>(cursor + view);  // [N, F] u → du
  // Recompute the forward's bf16 pre-activations and h = act(g, u).
  gemm.gemm_bf16(false, true, N, F, d, 1.0f, x, d, w_gate, d, 0.0f, gate, GemmOutType::Bf16, F,
                 stream);
  gemm.gemm_bf16(false, true, N, F, d, 1.0f, x, d, w_up, d, 0.0f, up, GemmOutType::Bf16, F, stream);
  glu_forward(gate, up, h, N * F, act, stream);
  // y = h·W_downᵀ: dW_down [d, F] += dyᵀ[d, N]·h[N, F]; then dh [N, F] = dy[N, d]·W_down[d, F]
  // over h (queued after the GEMM that reads it).
  if (dw_down)
    gemm.gemm_bf16(true, false, d, F, N, 1.0f, dy, d, h, F, 1.0f, dw_down, GemmOutType::F32, F,
                   stream);
  gemm.gemm_bf16(false, false, N, F, d, 1.0f, dy, d, w_down, F, 0.0f, h, GemmOutType::Bf16, F,
                 stream);
  glu_backward(gate, up, h, h, up, N * F, act, stream);
  const uint16_t* dg = h;
  const uint16_t* du = up;
  // g = x·W_gateᵀ: dW_gate [F, d] += dgᵀ[F, N]·x[N, d]; dx [N, d] (+)= dg·W_gate; same for up.
  if (dw_gate)
    gemm.gemm_bf16(true, false, F, d, N, 1.0f, dg, F, x, d, 1.0f, dw_gate, GemmOutType::F32, d,
                   stream);
  if (dw_up)
    gemm.gemm_bf16(true, false, F, d, N, 1.0f, du, F, x, d, 1.0f, dw_up, GemmOutType::F32, d,
                   stream);
  if (dx) {
    gemm.gemm_bf16(false, false, N, d, F, 1.0f, dg, F, w_gate, d, dx_beta, dx, GemmOutType::F32,
                   d, stream);
    gemm.gemm_bf16(false, false, N, d, F, 1.0f, du, F, w_up, d, 1.0f, dx, GemmOutType::F32, d,
                   stream);
  }
}

}  // namespace dm::cuda
