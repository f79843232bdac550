// Checked entry points of the GPU MoE ops (moe.h): argument validation with the CPU structs
// (RouterParams, GluActivation, QbHistogramRange), workspace carving and the orchestration of the
// dispatch, grouped GEMMs and GLU. Compiled as C++20 by the host compiler (the .cu files are
// C++17 and cannot include ops/cpu or train headers).
#include "ops/cuda/moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe_experts_chain.h"
#include "ops/cuda/moe_kernels.h"
#include "train/balance.h"

namespace dm::cuda {

namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

void check_aligned(const char* who, const void* p, const char* name) {
  DM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, who, ": ", name,
           " must be 16-byte aligned (vector loads)");
}

void check_plan(const char* who, const MoeDispatchPlan& plan) {
  DM_CHECK(plan.offsets && plan.row_of_pair && plan.token, who, ": dispatch plan not built");
  DM_CHECK(!plan.host_offsets || plan.host_offsets[plan.E] == plan.N * plan.k, who,
           ": plan covers ", plan.host_offsets ? plan.host_offsets[plan.E] : 0,
           " rows, expected N·k = ", plan.N * plan.k);
}

// The checks every expert chain makes: the plan (check_plan) matches the weights' E, Din and F
// are positive multiples of `multiple` within int32 index range, and the weights exist.
template <typename ExpertWeights>
void check_experts_call(const char* who, const MoeDispatchPlan& plan, const ExpertWeights& ew,
                        int64_t multiple) {
  check_plan(who, plan);
  DM_CHECK(plan.E == ew.E, who, ": plan has ", plan.E, " experts, weights have ", ew.E);
  DM_CHECK(ew.Din > 0 && ew.F > 0 && ew.Din % multiple == 0 && ew.F % multiple == 0, who,
           ": Din and F must be positive multiples of ", multiple, ", got Din=", ew.Din,
           " F=", ew.F);
  DM_CHECK(ew.Din <= std::numeric_limits<int32_t>::max() / 2 &&
               ew.F <= std::numeric_limits<int32_t>::max() / 2,
           who, ": expert dims exceed int32");
  DM_CHECK(ew.gate && ew.up && ew.down, who, ": null expert weights");
}

}  // namespace

void moe_route(const float* logits, const float* bias, int64_t N, const RouterParams& p,
               float* scores, int32_t* idx, float* w, float* cutoff, CUstream_st* stream) {
  const int E = p.num_experts, k = p.top_k;
  DM_CHECK(N >= 0, "moe_route (cuda): negative token count ", N);
  DM_CHECK(E > 0 && k >= 1 && k <= E, "moe_route (cuda): need 1 ≤ top_k ≤ num_experts, got k=", k,
           " E=", E);
  DM_CHECK(k + 1 <= moe_detail::kRouteMaxPicks, "moe_route (cuda): top_k ", k,
           " exceeds the supported maximum ", moe_detail::kRouteMaxPicks - 1);
  DM_CHECK(p.n_group >= 1, "moe_route (cuda): n_group must be >= 1, got ", p.n_group);
  if (p.n_group > 1) {
    DM_CHECK(p.n_group <= moe_detail::kRouteMaxGroups, "moe_route (cuda): n_group ", p.n_group,
             " exceeds the supported maximum ", moe_detail::kRouteMaxGroups);
    DM_CHECK(E % p.n_group == 0, "moe_route (cuda): num_experts ", E,
             " not divisible by n_group ", p.n_group);
    DM_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route (cuda): topk_group must be in [1, ", p.n_group, "], got ", p.topk_group);
    DM_CHECK(int64_t(p.topk_group) * (E / p.n_group) >= k, "moe_route (cuda): topk_group ",
             p.topk_group, " groups of ", E / p.n_group, " experts cannot supply top_k ", k);
  }
  if (N == 0) return;
  DM_CHECK(logits && scores && idx && w, "moe_route (cuda): null argument");
  moe_detail::RouteProblem problem;
  problem.N = N;
  problem.E = E;
  problem.k = k;
  problem.n_group = p.n_group;
  problem.topk_group = p.topk_group;
  problem.renormalize = p.renormalize;
  problem.scaling = p.scaling;
  moe_detail::launch_route(problem, logits, bias, scores, idx, w, cutoff, stream);
}

void qb_histogram_accumulate(const float* scores, const float* cutoff, int64_t N, int E,
                             const QbHistogramRange& range, int64_t* counts,
                             CUstream_st* stream) {
  DM_CHECK(N >= 0 && E > 0 && range.bins >= 1 && range.high > range.low,
           "qb_histogram_accumulate (cuda): bad shape or range");
  moe_detail::launch_qb_histogram(scores, cutoff, N, E, range.low, 1.0 / range.bin_width(),
                                  range.bins, counts, stream);
}

void qb_raw_bias_from_histogram(const int64_t* counts, int E, int k,
                                const QbHistogramRange& range, double* raw_bias,
                                CUstream_st* stream) {
  DM_CHECK(E > 0 && k >= 1 && k <= E && range.bins >= 1,
           "qb_raw_bias_from_histogram (cuda): bad shape");
  moe_detail::launch_qb_raw_bias(counts, E, k, range.bins, range.low, range.bin_width(), raw_bias,
                                 stream);
}

void expert_loads_accumulate(const int32_t* idx, int64_t N, int k, int E, int64_t* loads,
                             CUstream_st* stream) {
  DM_CHECK(N >= 0 && k >= 1 && E > 0 && E <= 8192, "expert_loads_accumulate (cuda): bad shape N=",
           N, " k=", k, " E=", E);
  moe_detail::launch_expert_loads(idx, N * k, E, loads, stream);
}

size_t quantile_balance_workspace_bytes(int E, int bins) {
  return round_up_256(size_t(E) * size_t(bins) * sizeof(int64_t)) +
         round_up_256(size_t(E) * sizeof(double));
}

void quantile_balance_update_device(const float* scores, const float* cutoff, int64_t N, int E,
                                    int k, const BalanceOptions& options,
                                    BalanceLayerState* state, float* bias, void* workspace,
                                    CUstream_st* stream) {
  DM_CHECK(options.rule == BalanceRule::Quantile &&
               options.estimator == QuantileEstimator::Histogram,
           "quantile_balance_update_device: the GPU path implements QB with the histogram "
           "estimator (set BalanceOptions::estimator = Histogram)");
  DM_CHECK(N >= 0 && E > 0 && k >= 1 && k <= E, "quantile_balance_update_device: bad shape N=", N,
           " E=", E, " k=", k);
  // Once per optimizer step and MoE layer: small host vectors are fine here.
  std::vector<float> host_bias(static_cast<size_t>(E));
  moe_detail::copy_to_host_and_wait(host_bias.data(), bias, host_bias.size() * sizeof(float),
                                    nullptr, nullptr, 0, stream);
  const QbHistogramRange range = qb_histogram_range(host_bias.data(), E, options.histogram_bins);
  int64_t* counts = static_cast<int64_t*>(workspace);
  double* raw_bias = reinterpret_cast<double*>(
      static_cast<char*>(workspace) +
      round_up_256(size_t(E) * size_t(range.bins) * sizeof(int64_t)));
  moe_detail::memset_async(counts, 0, size_t(E) * size_t(range.bins) * sizeof(int64_t), stream);
  qb_histogram_accumulate(scores, cutoff, N, E, range, counts, stream);
  qb_raw_bias_from_histogram(counts, E, k, range, raw_bias, stream);
  std::vector<int64_t> first_row(size_t(range.bins));
  std::vector<double> host_raw(static_cast<size_t>(E));
  moe_detail::copy_to_host_and_wait(first_row.data(), counts, first_row.size() * sizeof(int64_t),
                                    host_raw.data(), raw_bias, host_raw.size() * sizeof(double),
                                    stream);
  if (std::accumulate(first_row.begin(), first_row.end(), int64_t(0)) == 0) return;
  qb_set_bias(host_raw.data(), E, options, state, host_bias.data());
  moe_detail::copy_to_device_async(bias, host_bias.data(), host_bias.size() * sizeof(float),
                                   stream);
  moe_detail::copy_to_host_and_wait(nullptr, nullptr, 0, nullptr, nullptr, 0, stream);
}

size_t moe_dispatch_plan_bytes(int64_t N, int k, int E) {
  const size_t pairs = size_t(std::max<int64_t>(N * k, 1));
  return round_up_256((size_t(E) + 1) * sizeof(int64_t)) +
         3 * round_up_256(pairs * sizeof(int32_t)) +
         round_up_256(moe_detail::dispatch_scratch_bytes(N, E)) + round_up_256(sizeof(int32_t));
}

void moe_dispatch_plan_build(const int32_t* idx, int64_t N, int k, int E, MoeDispatchPlan* plan,
                             DeviceArena& arena, int64_t* host_offsets, CUstream_st* stream) {
  DM_CHECK(N >= 0 && k >= 1 && E >= 1, "moe_dispatch_plan_build: bad shape N=", N, " k=", k,
           " E=", E);
  DM_CHECK(E <= moe_detail::kDispatchMaxExperts, "moe_dispatch_plan_build: E=", E,
           " exceeds the supported maximum ", moe_detail::kDispatchMaxExperts);
  DM_CHECK(N * k <= int64_t(std::numeric_limits<int32_t>::max()),
           "moe_dispatch_plan_build: N·k = ", N * k, " rows exceed int32 row ids");
  const size_t pairs = size_t(std::max<int64_t>(N * k, 1));
  plan->N = N;
  plan->k = k;
  plan->E = E;
  plan->offsets = arena.alloc<int64_t>(size_t(E) + 1);
  plan->token = arena.alloc<int32_t>(pairs);
  plan->slot = arena.alloc<int32_t>(pairs);
  plan->row_of_pair = arena.alloc<int32_t>(pairs);
  void* scratch = arena.alloc_bytes(moe_detail::dispatch_scratch_bytes(N, E));
  int32_t* error_flag = arena.alloc<int32_t>(1);
  moe_detail::memset_async(error_flag, 0, sizeof(int32_t), stream);
  moe_detail::launch_dispatch_plan(idx, N, k, E, plan->offsets, plan->token, plan->slot,
                                   plan->row_of_pair, scratch, error_flag, stream);
  plan->host_offsets = nullptr;
  if (!host_offsets) return;  // no copy, no synchronisation, no id check (see moe.h)
  int32_t host_error = 0;
  moe_detail::copy_to_host_and_wait(host_offsets, plan->offsets, (size_t(E) + 1) * sizeof(int64_t),
                                    &host_error, error_flag, sizeof(int32_t), stream);
  DM_CHECK(host_error == 0, "moe_dispatch_plan_build: an expert id in idx lies outside [0, ", E,
           ")");
  plan->host_offsets = host_offsets;
}

void moe_permute_rows(const uint16_t* x, const MoeDispatchPlan& plan, int64_t D, uint16_t* sorted,
                      CUstream_st* stream) {
  check_plan("moe_permute_rows", plan);
  DM_CHECK(D > 0 && D % 8 == 0, "moe_permute_rows: D must be a positive multiple of 8, got ", D);
  check_aligned("moe_permute_rows", x, "x");
  check_aligned("moe_permute_rows", sorted, "sorted");
  moe_detail::launch_permute_rows(x, plan.token, plan.N * plan.k, D, sorted, stream);
}

void moe_unpermute_rows(const uint16_t* sorted, const MoeDispatchPlan& plan, const float* w,
                        int64_t D, void* y, GemmOutType y_type, CUstream_st* stream) {
  check_plan("moe_unpermute_rows", plan);
  DM_CHECK(D > 0 && D % 8 == 0, "moe_unpermute_rows: D must be a positive multiple of 8, got ", D);
  check_aligned("moe_unpermute_rows", sorted, "sorted");
  check_aligned("moe_unpermute_rows", y, "y");
  moe_detail::launch_unpermute_rows(sorted, plan.row_of_pair, w, plan.N, plan.k, D, y,
                                    y_type == GemmOutType::F32, stream);
}

namespace moe_detail {
void run_expert_chain(GemmContext& gemm, ExpertGemmBuffers b, const MoeDispatchPlan& plan,
                      const GluActivation& act, uint16_t* h, MoeGemmPath path,
                      CUstream_st* stream) {
  const int64_t rows = plan.N * plan.k, Din = b.Din, F = b.F;
  b.down_in = h == b.gate_out ? nullptr : h;
  if (path == MoeGemmPath::GroupedOwn) {
    const int E = b.E;
    // Few rows per expert (decode batches): weight-streaming kernel; else 128-row tiles.
    const bool few = rows < kMoeFewRowsPerExpert * E;
    const bool pingpong = moe_grouped_wgmma() && moe_wgmma_pingpong();
    auto product = [&](const uint16_t* A, const uint16_t* W, int64_t K, int64_t N, uint16_t* Y) {
      if (few)
        launch_grouped_few_rows_nk_bf16(A, W, plan.offsets, E, rows, K, N, Y, stream);
      else if (pingpong && grouped_rows_tma_applies(A, W, K, N, Y))
        launch_grouped_rows_nk_bf16_pingpong(A, W, plan.offsets, E, rows, K, N, Y, stream);
      else if (moe_grouped_wgmma() && moe_wgmma_tma() && grouped_rows_tma_applies(A, W, K, N, Y))
        launch_grouped_rows_nk_bf16_tma(A, W, plan.offsets, E, rows, K, N, Y, moe_wgmma_wide(),
                                        stream);
      else if (moe_grouped_wgmma() && moe_wgmma_wide() && grouped_rows_wide_applies(N, Y))
        launch_grouped_rows_nk_bf16_wgmma_wide(A, W, plan.offsets, E, rows, K, N, Y, stream);
      else if (moe_grouped_wgmma())
        launch_grouped_rows_nk_bf16_wgmma(A, W, plan.offsets, E, rows, K, N, Y, stream);
      else
        launch_grouped_rows_nk_bf16(A, W, plan.offsets, E, rows, K, N, Y, stream);
    };
    // In place (h = gate_out: nothing keeps g and u), the fused kernel writes h alone.
    const bool in_place = h == b.gate_out;
    uint16_t* keep_gate = in_place ? nullptr : b.gate_out;
    uint16_t* keep_up = in_place ? nullptr : b.up_out;
    if (!few && pingpong && moe_wgmma_pingpong_glu() &&
        grouped_gate_up_glu_pingpong_applies(b.x_sorted, b.gate_w, b.up_w, Din, F, keep_gate,
                                             keep_up, h)) {
      launch_grouped_gate_up_glu_pingpong(b.x_sorted, b.gate_w, b.up_w, plan.offsets, E, rows, Din,
                                          F, keep_gate, keep_up, h, glu_kernel_params(act), stream);
    } else if (!few && moe_grouped_wgmma() && moe_wgmma_fused_glu() &&
               grouped_gate_up_glu_applies(F, keep_gate, keep_up, h)) {
      launch_grouped_gate_up_glu_wgmma(b.x_sorted, b.gate_w, b.up_w, plan.offsets, E, rows, Din, F,
                                       keep_gate, keep_up, h, glu_kernel_params(act), stream);
    } else {
      product(b.x_sorted, b.gate_w, Din, F, b.gate_out);
      product(b.x_sorted, b.up_w, Din, F, b.up_out);
      glu_forward(b.gate_out, b.up_out, h, rows * F, act, stream);
    }
    product(h, b.down_w, F, Din, b.expert_out);
    return;
  }
  DM_CHECK(plan.host_offsets,
           "MoE expert GEMMs (cuda): the cuBLAS paths need the plan's host offsets "
           "(moe_dispatch_plan_build with a host buffer)");
  if (path == MoeGemmPath::Grouped) {
    void* host = gemm.host_scratch(expert_grouped_host_bytes(b.E));
    run_expert_gemms_grouped(gemm.cublas_handle(), b, plan.host_offsets, plan.offsets, 0, host,
                             stream);
    glu_forward(b.gate_out, b.up_out, h, rows * F, act, stream);
    run_expert_gemms_grouped(gemm.cublas_handle(), b, plan.host_offsets, plan.offsets, 1, host,
                             stream);
    return;
  }
  for (int64_t e = 0; e < b.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_bf16(false, true, n, F, Din, 1.0f, b.x_sorted + begin * Din, Din,
                   b.gate_w + e * F * Din, Din, 0.0f, b.gate_out + begin * F, GemmOutType::Bf16,
                   F, stream);
    gemm.gemm_bf16(false, true, n, F, Din, 1.0f, b.x_sorted + begin * Din, Din,
                   b.up_w + e * F * Din, Din, 0.0f, b.up_out + begin * F, GemmOutType::Bf16, F,
                   stream);
  }
  glu_forward(b.gate_out, b.up_out, h, rows * F, act, stream);
  for (int64_t e = 0; e < b.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_bf16(false, true, n, Din, F, 1.0f, h + begin * F, F, b.down_w + e * Din * F, F,
                   0.0f, b.expert_out + begin * Din, GemmOutType::Bf16, Din, stream);
  }
}
}  // namespace moe_detail

namespace {
// A kernel variant's process-wide switch from env `var` ("1" on, "0" off; unset or empty: the
// fallback; anything else an error), read once by each setting below.
std::atomic<bool>& grouped_wgmma_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_WGMMA", true)};
  return on;
}
std::atomic<bool>& grouped_wgmma_backward_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_WGMMA_BACKWARD", true)};
  return on;
}
std::atomic<bool>& wgmma_overlap_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_WGMMA_OVERLAP", false)};
  return on;
}
std::atomic<bool>& wgmma_fused_glu_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_GLU_FUSED", false)};
  return on;
}
std::atomic<bool>& wgmma_wide_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_WGMMA_WIDE", false)};
  return on;
}
std::atomic<bool>& wgmma_tma_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_TMA", true)};
  return on;
}
std::atomic<bool>& wgmma_pingpong_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_PINGPONG", true)};
  return on;
}
std::atomic<bool>& wgmma_pingpong_glu_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_PINGPONG_GLU", true)};
  return on;
}
std::atomic<bool>& wgmma_pingpong_weight_grad_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_PINGPONG_WEIGHT_GRAD", true)};
  return on;
}
std::atomic<bool>& wgmma_pingpong_rows_backward_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_PINGPONG_ROWS_BACKWARD", true)};
  return on;
}
std::atomic<bool>& wgmma_staged_output_setting() {
  static std::atomic<bool> on{env_flag("DM_MOE_WGMMA_STAGED", true)};
  return on;
}
}  // namespace

bool moe_wgmma_pingpong() { return wgmma_pingpong_setting().load(std::memory_order_relaxed); }
void moe_set_wgmma_pingpong(bool on) {
  wgmma_pingpong_setting().store(on, std::memory_order_relaxed);
}
bool moe_wgmma_pingpong_glu() {
  return wgmma_pingpong_glu_setting().load(std::memory_order_relaxed);
}
void moe_set_wgmma_pingpong_glu(bool on) {
  wgmma_pingpong_glu_setting().store(on, std::memory_order_relaxed);
}
bool moe_wgmma_pingpong_weight_grad() {
  return wgmma_pingpong_weight_grad_setting().load(std::memory_order_relaxed);
}
void moe_set_wgmma_pingpong_weight_grad(bool on) {
  wgmma_pingpong_weight_grad_setting().store(on, std::memory_order_relaxed);
}
bool moe_wgmma_pingpong_rows_backward() {
  return wgmma_pingpong_rows_backward_setting().load(std::memory_order_relaxed);
}
void moe_set_wgmma_pingpong_rows_backward(bool on) {
  wgmma_pingpong_rows_backward_setting().store(on, std::memory_order_relaxed);
}
bool moe_wgmma_tma() { return wgmma_tma_setting().load(std::memory_order_relaxed); }
void moe_set_wgmma_tma(bool on) { wgmma_tma_setting().store(on, std::memory_order_relaxed); }
bool moe_wgmma_wide() { return wgmma_wide_setting().load(std::memory_order_relaxed); }
void moe_set_wgmma_wide(bool on) { wgmma_wide_setting().store(on, std::memory_order_relaxed); }
bool moe_wgmma_fused_glu() { return wgmma_fused_glu_setting().load(std::memory_order_relaxed); }
void moe_set_wgmma_fused_glu(bool on) {
  wgmma_fused_glu_setting().store(on, std::memory_order_relaxed);
}

bool moe_wgmma_staged_output() {
  return wgmma_staged_output_setting().load(std::memory_order_relaxed);
}
void moe_set_wgmma_staged_output(bool on) {
  wgmma_staged_output_setting().store(on, std::memory_order_relaxed);
}

bool moe_wgmma_overlap() { return wgmma_overlap_setting().load(std::memory_order_relaxed); }
void moe_set_wgmma_overlap(bool on) {
  wgmma_overlap_setting().store(on, std::memory_order_relaxed);
}
bool moe_grouped_wgmma_backward() {
  return grouped_wgmma_backward_setting().load(std::memory_order_relaxed);
}
void moe_set_grouped_wgmma_backward(bool on) {
  grouped_wgmma_backward_setting().store(on, std::memory_order_relaxed);
}
bool moe_grouped_wgmma() { return grouped_wgmma_setting().load(std::memory_order_relaxed); }
void moe_set_grouped_wgmma(bool on) { grouped_wgmma_setting().store(on, std::memory_order_relaxed); }

MoeGemmPath moe_gemm_default_path() {
  static const MoeGemmPath path = [] {
    const char* env = std::getenv("DM_MOE_GEMM");
    if (env == nullptr || env[0] == '\0' || std::strcmp(env, "own") == 0)
      return MoeGemmPath::GroupedOwn;
    if (std::strcmp(env, "cublas") == 0) return MoeGemmPath::Grouped;
    DM_CHECK(std::strcmp(env, "loop") == 0, "DM_MOE_GEMM must be 'cublas', 'own' or 'loop', got '",
             env, "'");
    return MoeGemmPath::Loop;
  }();
  return path;
}

size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew) {
  const size_t rows = size_t(std::max<int64_t>(N * k, 1));
  return 2 * round_up_256(rows * size_t(ew.Din) * 2) + 2 * round_up_256(rows * size_t(ew.F) * 2) +
         round_up_256(moe_detail::expert_pointer_array_bytes(int(ew.E)));
}

void moe_experts_forward(GemmContext& gemm, const uint16_t* x, const MoeDispatchPlan& plan,
                         const float* w, const ExpertWeightsBf16& ew, const GluActivation& act,
                         void* y, GemmOutType y_type, void* workspace, MoeGemmPath path,
                         CUstream_st* stream) {
  const char* who = "moe_experts_forward (cuda)";
  check_experts_call(who, plan, ew, /*multiple=*/8);
  DM_CHECK(x && w && y && workspace, who, ": null argument");
  if (plan.N == 0) return;
  const int64_t rows = plan.N * plan.k, Din = ew.Din, F = ew.F;
  char* cursor = static_cast<char*>(workspace);
  auto take = [&](size_t bytes) {
    void* p = cursor;
    cursor += round_up_256(bytes);
    return p;
  };
  moe_detail::ExpertGemmBuffers b;
  auto* x_sorted = static_cast<uint16_t*>(take(size_t(rows) * Din * 2));
  b.gate_out = static_cast<uint16_t*>(take(size_t(rows) * F * 2));
  b.up_out = static_cast<uint16_t*>(take(size_t(rows) * F * 2));
  b.expert_out = static_cast<uint16_t*>(take(size_t(rows) * Din * 2));
  b.pointer_arrays =
      static_cast<const void**>(take(moe_detail::expert_pointer_array_bytes(int(ew.E))));
  b.gate_w = ew.gate;
  b.up_w = ew.up;
  b.down_w = ew.down;
  b.x_sorted = x_sorted;
  b.E = int(ew.E);
  b.Din = Din;
  b.F = F;

  moe_permute_rows(x, plan, Din, x_sorted, stream);
  moe_detail::run_expert_chain(gemm, b, plan, act, b.gate_out, path, stream);
  moe_unpermute_rows(b.expert_out, plan, w, Din, y, y_type, stream);
}

// ---- fp32 (the fp32 GPU mode): checked entry points of the fp32 row moves (kernels in moe.cu)
// and the fp32 expert chain
//   x [N, Din] → sorted rows [N·k, Din] → gate, up [N·k, F] → h = act(gate, up) (in place)
//   → expert outputs [N·k, Din] → y[t] = Σ_s w[t, s]·out[row_of_pair[t, s]]
// with one cuBLASLt fp32 GEMM (GemmContext::gemm_f32: full-precision multiplies, no TF32) per
// non-empty expert and projection, as the bf16 MoeGemmPath::Loop does. Nothing is rounded below
// fp32, so the result is the CPU float moe_experts_forward up to each GEMM's summation order.

void moe_permute_rows(const float* x, const MoeDispatchPlan& plan, int64_t D, float* sorted,
                      CUstream_st* stream) {
  const char* who = "moe_permute_rows (fp32)";
  check_plan(who, plan);
  DM_CHECK(D > 0, who, ": D must be positive, got ", D);
  const int64_t rows = plan.N * plan.k;
  if (rows == 0) return;
  DM_CHECK(x && sorted, who, ": null argument");
  moe_detail::launch_permute_rows(x, plan.token, rows, D, sorted, stream);
}

void moe_unpermute_rows(const float* sorted, const MoeDispatchPlan& plan, const float* w, int64_t D,
                        float* y, CUstream_st* stream) {
  const char* who = "moe_unpermute_rows (fp32)";
  check_plan(who, plan);
  DM_CHECK(D > 0, who, ": D must be positive, got ", D);
  if (plan.N == 0) return;
  DM_CHECK(sorted && w && y, who, ": null argument");
  moe_detail::launch_unpermute_rows(sorted, plan.row_of_pair, w, plan.N, plan.k, D, y, stream);
}

size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeightsF32& ew) {
  const size_t rows = size_t(std::max<int64_t>(N * k, 1));
  return 2 * round_up_256(rows * size_t(ew.Din) * sizeof(float)) +
         2 * round_up_256(rows * size_t(ew.F) * sizeof(float));
}

void moe_experts_forward(GemmContext& gemm, const float* x, const MoeDispatchPlan& plan,
                         const float* w, const ExpertWeightsF32& ew, const GluActivation& act,
                         float* y, void* workspace, CUstream_st* stream) {
  const char* who = "moe_experts_forward (cuda, fp32)";
  // The loop below launches one GEMM per non-empty expert, so it needs the row counts on the host.
  DM_CHECK(plan.host_offsets, who,
           ": the per-expert fp32 GEMMs need the plan's host offsets (moe_dispatch_plan_build "
           "with a host buffer)");
  check_experts_call(who, plan, ew, /*multiple=*/1);
  DM_CHECK(x && w && y && workspace, who, ": null argument");
  if (plan.N == 0) return;
  const int64_t rows = plan.N * plan.k, Din = ew.Din, F = ew.F;
  // Workspace, each region 256-byte aligned: sorted x [rows, Din], gate (then h) [rows, F],
  // up [rows, F], expert outputs [rows, Din].
  char* cursor = static_cast<char*>(workspace);
  auto take = [&](int64_t elements) {
    float* p = reinterpret_cast<float*>(cursor);
    cursor += round_up_256(size_t(elements) * sizeof(float));
    return p;
  };
  float* x_sorted = take(rows * Din);
  float* gate_out = take(rows * F);
  float* up_out = take(rows * F);
  float* expert_out = take(rows * Din);

  moe_permute_rows(x, plan, Din, x_sorted, stream);
  // Rows [begin, begin + n) of expert e: gate/up[n, F] = x_sorted[n, Din]·W_e[F, Din]ᵀ.
  for (int64_t e = 0; e < ew.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_f32(false, true, n, F, Din, 1.0f, x_sorted + begin * Din, Din, ew.gate + e * F * Din,
                  Din, 0.0f, gate_out + begin * F, F, stream);
    gemm.gemm_f32(false, true, n, F, Din, 1.0f, x_sorted + begin * Din, Din, ew.up + e * F * Din,
                  Din, 0.0f, up_out + begin * F, F, stream);
  }
  // One element-wise pass over every row (empty experts own no rows): h overwrites gate.
  glu_forward(gate_out, up_out, gate_out, rows * F, act, stream);
  // expert_out[n, Din] = h[n, F]·down_e[Din, F]ᵀ.
  for (int64_t e = 0; e < ew.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_f32(false, true, n, Din, F, 1.0f, gate_out + begin * F, F, ew.down + e * Din * F, F,
                  0.0f, expert_out + begin * Din, Din, stream);
  }
  moe_unpermute_rows(expert_out, plan, w, Din, y, stream);
}

}  // namespace dm::cuda
