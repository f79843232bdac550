// The gathered MoE decode kernels (ops/cuda/moe_decode.h) against the grouped expert GEMMs and
// the CPU reference, the pair kernels against the planned path bit for bit, a shared expert folded
// in. Skips without a GPU. (The decoders that use them: test_cuda_decode.cpp.)
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "cuda_mla_test_util.h"
#include "cuda_test_util.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_decode.h"
#include "test_util.h"

using namespace dm;

namespace {

// idx [N, k]: distinct ascending experts per token; with N ≥ 2 every token picks expert 3, so one
// expert serves all tokens (several passes of the kernels' token tile at N = 64).
std::vector<int32_t> shared_routing(int64_t N, int k, int E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> experts(static_cast<size_t>(E)), idx(static_cast<size_t>(N * k));
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::vector<int32_t> pick(experts.begin(), experts.begin() + k);
    if (N >= 2 && std::find(pick.begin(), pick.end(), 3) == pick.end()) pick[0] = 3;
    std::sort(pick.begin(), pick.end());
    std::copy(pick.begin(), pick.end(), idx.begin() + t * k);
  }
  return idx;
}

}  // namespace

// Against the grouped experts (moe_experts_forward, cuBLAS grouped GEMMs) and the CPU reference
// on the same bf16 values: N = 1, 3, 64 tokens, k = 2 and 8, E = 16 and 64, SwiGLU and SiTU,
// fp32 and bf16 outputs; up to 32 pairs the warp plan against the plan kernel, bit for bit. Din =
// 520 (65 chunks of 16 bytes: lanes loop three times) and F = 264 (a partly idle last block)
// exercise the tails.
TEST(CudaMoeDecode, GatheredMatchesGroupedExperts) {
  DM_SKIP_WITHOUT_GPU();
  namespace mla = test::mla;
  int case_index = 0;
  // Din, F: rows of 65 and 33 16-byte chunks, short of the kernels' unrolled 128-chunk steps;
  // 1160 and 1048 (145 and 131 chunks) run one unrolled step and a remainder.
  for (auto [N, k, E, Din, F] :
       {std::tuple<int64_t, int, int64_t, int64_t, int64_t>{1, 2, 16, 520, 264},
        {1, 8, 64, 520, 264},
        {3, 2, 16, 520, 264},
        {3, 8, 16, 520, 264},
        {3, 8, 64, 520, 264},
        {64, 2, 64, 520, 264},
        {64, 8, 16, 520, 264},
        {64, 8, 64, 520, 264},
        {1, 8, 16, 1160, 1048},
        {5, 2, 16, 1160, 1048}}) {
    const bool situ = case_index % 2 == 1, f32_out = case_index % 3 != 2;
    ++case_index;
    SCOPED_TRACE(str_cat("N=", N, " k=", k, " E=", E, " Din=", Din, " F=", F, " situ=", situ,
                         " f32=", f32_out));
    GluActivation act;
    act.kind = situ ? Activation::SiTU : Activation::SwiGLU;
    cuda::GluKernelParams params;
    params.situ = situ;
    params.beta1 = act.beta1;
    params.beta2 = act.beta2;
    const std::vector<int32_t> idx = shared_routing(N, k, int(E), uint32_t(N * 131 + k * 7 + E));
    const uint32_t seed = uint32_t(1000 + case_index * 10);
    const mla::Bf16Host x = mla::random_bf16(size_t(N * Din), seed);
    const mla::Bf16Host gate =
        mla::random_bf16(size_t(E * F * Din), seed + 1, 1.0f / std::sqrt(float(Din)));
    const mla::Bf16Host up =
        mla::random_bf16(size_t(E * F * Din), seed + 2, 1.0f / std::sqrt(float(Din)));
    const mla::Bf16Host down =
        mla::random_bf16(size_t(E * Din * F), seed + 3, 1.0f / std::sqrt(float(F)));
    std::mt19937 rng(seed + 4);
    std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
    std::vector<float> w(static_cast<size_t>(N * k));
    for (auto& value : w) value = uniform(rng);

    std::vector<float> y_cpu(static_cast<size_t>(N * Din));
    const ExpertWeights ew_cpu{gate.values.data(), up.values.data(), down.values.data(), E, Din, F};
    moe_experts_reference(x.values.data(), idx.data(), w.data(), N, k, ew_cpu, act, y_cpu.data());

    cuda::GemmContext context;
    cuda::DeviceArena arena(size_t(256) << 20);
    const cuda::ExpertWeightsBf16 ew{mla::upload(arena, gate.bits),
                                     mla::upload(arena, up.bits),
                                     mla::upload(arena, down.bits),
                                     E,
                                     Din,
                                     F};
    ASSERT_TRUE(cuda::moe_decode_supported(N, k, ew));
    const uint16_t* x_dev = mla::upload(arena, x.bits);
    const int32_t* idx_dev = mla::upload(arena, idx);
    const float* w_dev = mla::upload(arena, w);
    const cuda::GemmOutType out = f32_out ? cuda::GemmOutType::F32 : cuda::GemmOutType::Bf16;
    auto download_y = [&](void* y) {
      return f32_out ? mla::download(static_cast<float*>(y), size_t(N * Din))
                     : mla::bf16_bits_to_floats(
                           mla::download(static_cast<uint16_t*>(y), size_t(N * Din)));
    };

    // Grouped reference.
    std::vector<int64_t> host_offsets(static_cast<size_t>(E) + 1);
    cuda::MoeDispatchPlan plan;
    cuda::moe_dispatch_plan_build(idx_dev, N, k, int(E), &plan, arena, host_offsets.data());
    void* grouped_ws = arena.alloc_bytes(cuda::moe_experts_forward_workspace_bytes(N, k, ew));
    void* y_grouped = mla::alloc_poisoned<float>(arena, size_t(N * Din));
    cuda::moe_experts_forward(context, x_dev, plan, w_dev, ew, act, y_grouped, out, grouped_ws);

    // Gathered, twice into a poisoned output (every element written; same bits both times).
    void* gathered_ws = arena.alloc_bytes(cuda::moe_decode_workspace_bytes(N, k, ew));
    void* y_gathered = mla::alloc_poisoned<float>(arena, size_t(N * Din));
    cuda::moe_decode_experts_forward(x_dev, idx_dev, w_dev, N, k, ew, params, y_gathered, out,
                                     gathered_ws);
    cuda::synchronize();
    const std::vector<float> first = download_y(y_gathered);
    cuda::moe_decode_experts_forward(x_dev, idx_dev, w_dev, N, k, ew, params, y_gathered, out,
                                     gathered_ws);
    cuda::synchronize();
    const std::vector<float> gathered = download_y(y_gathered);
    const std::vector<float> grouped = download_y(y_grouped);
    ASSERT_TRUE(mla::all_finite(gathered));
    EXPECT_EQ(std::memcmp(first.data(), gathered.data(), gathered.size() * sizeof(float)), 0)
        << "not deterministic";
    // Up to 32 pairs the pair kernels run; the planned path must give the same bits.
    cuda::moe_decode_force_plan_kernel(true);
    cuda::moe_decode_experts_forward(x_dev, idx_dev, w_dev, N, k, ew, params, y_gathered, out,
                                     gathered_ws);
    cuda::synchronize();
    cuda::moe_decode_force_plan_kernel(false);
    const std::vector<float> planned = download_y(y_gathered);
    EXPECT_EQ(std::memcmp(planned.data(), gathered.data(), gathered.size() * sizeof(float)), 0)
        << "the pair kernels and the planned path differ";
    // A shared expert of the routed width folded in as N more pairs (the pair path only):
    // y = routed + shared_out, against the CPU reference of both.
    if (cuda::moe_decode_folds_shared(N, k, ew, F)) {
      const mla::Bf16Host shared_gate =
          mla::random_bf16(size_t(F * Din), seed + 5, 1.0f / std::sqrt(float(Din)));
      const mla::Bf16Host shared_up =
          mla::random_bf16(size_t(F * Din), seed + 6, 1.0f / std::sqrt(float(Din)));
      const mla::Bf16Host shared_down =
          mla::random_bf16(size_t(Din * F), seed + 7, 1.0f / std::sqrt(float(F)));
      const ExpertWeights shared_cpu{
          shared_gate.values.data(), shared_up.values.data(), shared_down.values.data(), 1, Din, F};
      const std::vector<int32_t> expert_zero(static_cast<size_t>(N), 0);
      const std::vector<float> weight_one(static_cast<size_t>(N), 1.0f);
      std::vector<float> expected(static_cast<size_t>(N * Din));
      moe_experts_reference(x.values.data(), expert_zero.data(), weight_one.data(), N, 1,
                            shared_cpu, act, expected.data());
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += y_cpu[i];
      const cuda::SharedExpertBf16 shared{mla::upload(arena, shared_gate.bits),
                                          mla::upload(arena, shared_up.bits),
                                          mla::upload(arena, shared_down.bits)};
      void* folded_ws = arena.alloc_bytes(cuda::moe_decode_workspace_bytes(N, k, ew, true));
      cuda::moe_decode_experts_forward(x_dev, idx_dev, w_dev, N, k, ew, params, y_gathered, out,
                                       folded_ws, nullptr, &shared);
      cuda::synchronize();
      const std::vector<float> folded = download_y(y_gathered);
      ASSERT_TRUE(mla::all_finite(folded));
      const double folded_vs_cpu = test::rel_rms(folded.data(), expected.data(), folded.size());
      std::printf("[          ] N=%lld k=%d with the shared expert folded in: vs CPU %.2e\n",
                  (long long)N, k, folded_vs_cpu);
      EXPECT_LE(folded_vs_cpu, 1e-2);
    } else {
      EXPECT_GT(N * k, 32) << "the pair path folds a shared expert of the routed width";
    }
    const double vs_grouped = test::rel_rms(gathered.data(), grouped.data(), gathered.size());
    const double vs_cpu = test::rel_rms(gathered.data(), y_cpu.data(), gathered.size());
    const double grouped_vs_cpu = test::rel_rms(grouped.data(), y_cpu.data(), grouped.size());
    std::printf(
        "[          ] N=%lld k=%d E=%lld %s %s: gathered vs grouped %.2e, vs CPU %.2e "
        "(grouped vs CPU %.2e)\n",
        (long long)N, k, (long long)E, situ ? "SiTU" : "SwiGLU", f32_out ? "fp32" : "bf16",
        vs_grouped, vs_cpu, grouped_vs_cpu);
    EXPECT_LE(vs_grouped, 1e-2);
    EXPECT_LE(vs_cpu, 1e-2);
  }
  // Up to one row per expert on average (measured: at two, batch 64 on the 48B shape, the
  // grouped GEMMs were faster; moe_decode.cu).
  EXPECT_TRUE(cuda::moe_decode_preferred(32, 8, 256));
  EXPECT_FALSE(cuda::moe_decode_preferred(64, 8, 256));
}

#else
TEST(CudaMoeDecode, SkippedWithoutCuda) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
