// GPU dense GEMM (ops/cuda/gemm.h) and MoE ops (ops/cuda/moe.h) against the CPU: cuBLASLt GEMM
// vs core/gemm.h on the same bf16 values (odd sizes, every transpose, bf16/fp32 out, beta), and
// with tuning (timed algorithm choice) vs without;
// router indices identical to moe_route (ties aside) with weights/cutoffs within fp32 tolerance;
// dispatch plan identical to moe_plan_build and a permute/unpermute round trip; grouped experts
// (cuBLAS grouped and per-expert loop) vs moe_experts_reference; QB histogram counts identical to
// the CPU's and the bias within one bin width of the exact quantile. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/gemm.h"
#include "cuda_mla_test_util.h"
#include "cuda_test_util.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_backward.h"
#include "ops/cuda/moe_kernels.h"
#include "test_util.h"
#include "train/balance.h"

namespace dm {
namespace {

using test::mla::Bf16Host;
using test::mla::download;
using test::mla::random_bf16;
using test::mla::upload;

// ---- GEMM ------------------------------------------------------------------------------------

TEST(CudaGemm, MatchesCpuGemmOnOddShapes) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  cuda::GemmContext context;
  struct Shape {
    int64_t M, N, K;
  };
  uint32_t seed = 1;
  for (Shape shape : {Shape{1, 1, 1}, Shape{17, 33, 65}, Shape{128, 256, 64},
                      Shape{63, 1000, 129}, Shape{300, 7, 512}}) {
    for (int transposes = 0; transposes < 4; ++transposes) {
      for (auto out : {cuda::GemmOutType::F32, cuda::GemmOutType::Bf16}) {
        for (float beta : {0.0f, 0.5f}) {
          const bool ta = transposes & 1, tb = transposes & 2;
          const int64_t M = shape.M, N = shape.N, K = shape.K;
          SCOPED_TRACE(str_cat("M=", M, " N=", N, " K=", K, " ta=", ta, " tb=", tb,
                               " f32=", out == cuda::GemmOutType::F32, " beta=", beta));
          // Padded leading dimensions (+3) so lda ≠ the logical width is exercised.
          const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 3, ldc = N + 3;
          const Bf16Host A = random_bf16(size_t((ta ? K : M) * lda), seed++);
          const Bf16Host B = random_bf16(size_t((tb ? N : K) * ldb), seed++);
          const Bf16Host C0 = random_bf16(size_t(M * ldc), seed++);
          cuda::DeviceArena arena(size_t(16) << 20);
          const uint16_t* A_dev = upload(arena, A.bits);
          const uint16_t* B_dev = upload(arena, B.bits);
          void* C_dev;
          if (out == cuda::GemmOutType::F32)
            C_dev = upload(arena, C0.values);
          else
            C_dev = upload(arena, C0.bits);
          context.gemm_bf16(ta, tb, M, N, K, 1.25f, A_dev, lda, B_dev, ldb, beta, C_dev, out, ldc);
          cuda::synchronize();
          std::vector<float> C = C0.values;
          gemm(ta, tb, M, N, K, 1.25f, A.values.data(), lda, B.values.data(), ldb, beta, C.data(),
               ldc);
          std::vector<float> gpu;
          if (out == cuda::GemmOutType::F32)
            gpu = download(static_cast<float*>(C_dev), C.size());
          else
            gpu = test::mla::bf16_bits_to_floats(download(static_cast<uint16_t*>(C_dev), C.size()));
          ASSERT_TRUE(test::mla::all_finite(gpu));
          EXPECT_LE(test::rel_rms(gpu.data(), C.data(), C.size()),
                    out == cuda::GemmOutType::F32 ? 1e-5 : 1e-2);
        }
      }
    }
  }
}

// The few-row GEMV that GemmContext routes decode-sized linears to (gemv.h), called directly so
// the test cannot fall through to cuBLAS: every row count it takes, outputs not a multiple of a
// warp's columns, K with and without a remainder past the unrolled chunks, padded leading
// dimensions, both output types, beta 0 and 0.5; each of its kernels (small K at K = 8, 64 and
// 256; split K at two and, for an output count found here, four outputs per block). Same
// tolerances as the cuBLAS test above.
TEST(CudaGemm, FewRowGemvMatchesCpuGemm) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  // An output count at which some row count takes four outputs per block (K = 1024; which
  // counts do depends on the kernels' registers, gemv.cu choose_shape).
  int64_t wide_N = 0, wide_M = 0;
  for (int64_t M = 1; M <= cuda::kGemvMaxRows && wide_N == 0; ++M)
    for (int64_t N = 64; N <= (int64_t(1) << 16) && wide_N == 0; N += 64) {
      const cuda::GemvOutput o{nullptr, 1024, N, nullptr, cuda::GemmOutType::F32, N};
      if (cuda::gemv_columns_per_block(M, 1024, &o, 1) == 4) wide_N = N, wide_M = M;
    }
  ASSERT_GT(wide_N, 0) << "no output count picks four outputs per block";
  const cuda::GemvOutput ragged{nullptr,   1024, wide_N + 3, nullptr, cuda::GemmOutType::F32,
                                wide_N + 3};
  EXPECT_EQ(cuda::gemv_columns_per_block(wide_M, 1024, &ragged, 1), 4) << "N=" << wide_N + 3;
  std::printf("[          ] four outputs per block at M=%lld N=%lld\n", (long long)wide_M,
              (long long)wide_N);
  const cuda::GemvOutput small{nullptr, 64, 40, nullptr, cuda::GemmOutType::F32, 40};
  EXPECT_EQ(cuda::gemv_columns_per_block(1, 64, &small, 1), 0);
  EXPECT_EQ(cuda::gemv_columns_per_block(1, 136, &small, 1), 2);
  uint32_t seed = 900;
  for (int64_t M = 1; M <= cuda::kGemvMaxRows; ++M) {
    for (auto [N, K] : {std::pair<int64_t, int64_t>{1, 8},
                        {7, 136},
                        {1000, 2304},
                        {33, 4104},
                        {40, 64},
                        {515, 256},
                        {wide_N + 3, 1024}}) {
      for (auto out : {cuda::GemmOutType::F32, cuda::GemmOutType::Bf16}) {
        for (float beta : {0.0f, 0.5f}) {
          SCOPED_TRACE(str_cat("M=", M, " N=", N, " K=", K,
                               " f32=", out == cuda::GemmOutType::F32, " beta=", beta));
          const int64_t ldx = K + 8, ldw = K + 16, ldy = N + 3;
          const Bf16Host x = random_bf16(size_t(M * ldx), seed++);
          const Bf16Host w = random_bf16(size_t(N * ldw), seed++);
          const Bf16Host y0 = random_bf16(size_t(M * ldy), seed++);
          cuda::DeviceArena arena(size_t(N * ldw) * 2 + size_t(M * (ldx + ldy)) * 4 +
                                  (size_t(16) << 20));
          const uint16_t* x_dev = upload(arena, x.bits);
          const uint16_t* w_dev = upload(arena, w.bits);
          void* y_dev = out == cuda::GemmOutType::F32 ? static_cast<void*>(upload(arena, y0.values))
                                                      : static_cast<void*>(upload(arena, y0.bits));
          ASSERT_TRUE(cuda::gemv_applies(M, K, x_dev, ldx, w_dev, ldw));
          cuda::launch_gemv_bf16(M, N, K, 1.25f, x_dev, ldx, w_dev, ldw, beta, y_dev, out, ldy,
                                 nullptr);
          cuda::synchronize();
          std::vector<float> y = y0.values;
          gemm(false, true, M, N, K, 1.25f, x.values.data(), ldx, w.values.data(), ldw, beta,
               y.data(), ldy);
          const std::vector<float> gpu =
              out == cuda::GemmOutType::F32
                  ? download(static_cast<float*>(y_dev), y.size())
                  : test::mla::bf16_bits_to_floats(download(static_cast<uint16_t*>(y_dev), y.size()));
          ASSERT_TRUE(test::mla::all_finite(gpu));
          EXPECT_LE(test::rel_rms(gpu.data(), y.data(), y.size()),
                    out == cuda::GemmOutType::F32 ? 1e-5 : 1e-2);
        }
      }
    }
  }
}

// Several weights on one x in one launch (a decode layer's input projections): outputs of
// different widths (one empty, one narrower than a block's columns) and types, every row count.
TEST(CudaGemm, GemvManyMatchesCpuGemm) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  for (const int64_t K : {1048, 128}) {  // split K; small K
    SCOPED_TRACE(str_cat("K=", K));
    const std::vector<std::pair<int64_t, cuda::GemmOutType>> widths = {
        {4096, cuda::GemmOutType::Bf16},
        {1, cuda::GemmOutType::F32},
        {0, cuda::GemmOutType::F32},
        {130, cuda::GemmOutType::F32},
        {33, cuda::GemmOutType::Bf16}};
    uint32_t seed = 950;
    for (int64_t M = 1; M <= cuda::kGemvMaxRows; ++M) {
      SCOPED_TRACE(str_cat("M=", M));
      cuda::DeviceArena arena(size_t(64) << 20);
      const Bf16Host x = random_bf16(size_t(M * K), seed++);
      const uint16_t* x_dev = upload(arena, x.bits);
      std::vector<Bf16Host> weights;
      std::vector<cuda::GemvOutput> outputs;
      for (const auto& [N, type] : widths) {
        weights.push_back(random_bf16(size_t(std::max<int64_t>(N, 1) * K), seed++));
        void* y = type == cuda::GemmOutType::F32
                      ? static_cast<void*>(test::mla::alloc_poisoned<float>(
                            arena, size_t(M * std::max<int64_t>(N, 1))))
                      : static_cast<void*>(test::mla::alloc_poisoned<uint16_t>(
                            arena, size_t(M * std::max<int64_t>(N, 1))));
        outputs.push_back(cuda::GemvOutput{upload(arena, weights.back().bits), K, N, y, type, N});
      }
      cuda::launch_gemv_bf16_many(M, K, x_dev, K, outputs.data(), int(outputs.size()), nullptr);
      cuda::synchronize();
      for (size_t i = 0; i < widths.size(); ++i) {
        const auto [N, type] = widths[i];
        if (N == 0) continue;
        SCOPED_TRACE(str_cat("output ", i, " N=", N));
        std::vector<float> y(size_t(M * N), 0.0f);
        gemm(false, true, M, N, K, 1.0f, x.values.data(), K, weights[i].values.data(), K, 0.0f,
             y.data(), N);
        const std::vector<float> gpu = type == cuda::GemmOutType::F32
                                           ? download(static_cast<float*>(outputs[i].y), y.size())
                                           : test::mla::bf16_bits_to_floats(download(
                                                 static_cast<uint16_t*>(outputs[i].y), y.size()));
        ASSERT_TRUE(test::mla::all_finite(gpu));
        EXPECT_LE(test::rel_rms(gpu.data(), y.data(), y.size()),
                  type == cuda::GemmOutType::F32 ? 1e-5 : 1e-2);
      }
    }
  }
}

// The MLA decode's absorption pattern: per head h, C[:, h·Nc..] = A[:, h·da..]·op(B_h), heads
// interleaved in A and C (ld = H·width) and stacked in B: one strided-batched call must equal the
// per-head loop bitwise (same algorithm family, same sums) or to bf16 rounding.
TEST(CudaGemm, StridedBatchedMatchesPerHeadLoop) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t n = 5, H = 6, da = 48, kvl = 64, rows_per_head = 80;
  for (bool tb : {false, true}) {
    cuda::GemmContext context;
    cuda::DeviceArena arena(size_t(8) << 20);
    const Bf16Host A = random_bf16(size_t(n * H * da), 11);
    const Bf16Host B = random_bf16(size_t(H * rows_per_head * kvl), 12);
    const uint16_t* A_dev = upload(arena, A.bits);
    const uint16_t* B_dev = upload(arena, B.bits);
    // tb = false: C_h [n, kvl] = A_h [n, da]·B_h [da, kvl] (B_h = rows h·rows_per_head.., ld kvl)
    // tb = true:  C_h [n, da]  = A_h' [n, kvl]·B_hᵀ with A_h' = columns h·kvl of [n, H·kvl].
    const int64_t K = tb ? kvl : da, Nc = tb ? da : kvl, lda = H * (tb ? kvl : da);
    const int64_t ldc = H * Nc;
    uint16_t* C_loop = arena.alloc<uint16_t>(size_t(n * ldc));
    uint16_t* C_batch = arena.alloc<uint16_t>(size_t(n * ldc));
    const uint16_t* A_use = A_dev;
    if (tb) {  // A' [n, H·kvl]
      const Bf16Host A3 = random_bf16(size_t(n * H * kvl), 13);
      A_use = upload(arena, A3.bits);
    }
    for (int64_t h = 0; h < H; ++h)
      context.gemm_bf16(false, tb, n, Nc, K, 1.0f, A_use + h * K, lda, B_dev + h * rows_per_head * kvl,
                        kvl, 0.0f, C_loop + h * Nc, cuda::GemmOutType::Bf16, ldc);
    context.gemm_bf16_strided_batched(false, tb, n, Nc, K, 1.0f, A_use, lda, K, B_dev, kvl,
                                      rows_per_head * kvl, 0.0f, C_batch, cuda::GemmOutType::Bf16,
                                      ldc, Nc, H);
    cuda::synchronize();
    const auto a = test::mla::bf16_bits_to_floats(download(C_loop, size_t(n * ldc)));
    const auto b = test::mla::bf16_bits_to_floats(download(C_batch, size_t(n * ldc)));
    ASSERT_TRUE(test::mla::all_finite(b));
    EXPECT_LE(test::rel_rms(b.data(), a.data(), a.size()), 1e-2) << "tb=" << tb;
  }
}

TEST(CudaGemm, CachesAlgorithmsAndHandlesEmptyK) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  cuda::GemmContext context;
  cuda::DeviceArena arena(1 << 20);
  const Bf16Host A = random_bf16(64 * 64, 7), B = random_bf16(64 * 64, 8);
  const uint16_t* A_dev = upload(arena, A.bits);
  const uint16_t* B_dev = upload(arena, B.bits);
  float* C_dev = arena.alloc<float>(64 * 64);
  for (int i = 0; i < 5; ++i)
    context.gemm_bf16(false, false, 64, 64, 64, 1.0f, A_dev, 64, B_dev, 64, 0.0f, C_dev,
                      cuda::GemmOutType::F32, 64);
  EXPECT_EQ(context.cached_algorithms(), 1);  // steady state: no new heuristic queries
  // K = 0: C ← beta·C.
  const std::vector<float> ones(64 * 64, 1.0f);
  cuda::copy_to_device(C_dev, ones.data(), ones.size() * 4);
  context.gemm_bf16(false, false, 64, 64, 0, 1.0f, A_dev, 64, B_dev, 64, 3.0f, C_dev,
                    cuda::GemmOutType::F32, 64);
  cuda::synchronize();
  const std::vector<float> C = download(C_dev, 64 * 64);
  EXPECT_EQ(C[0], 3.0f);
  EXPECT_EQ(C[64 * 64 - 1], 3.0f);
  EXPECT_THROW(context.gemm_bf16(false, false, 4, 8, 4, 1.0f, A_dev, 4, B_dev, 8, 0.0f, C_dev,
                                 cuda::GemmOutType::F32, 7),
               Error);  // ldc < N
}

// A separate C input (c_in: D = alpha·A·B + beta·c_in, the residual add in the epilogue) gives
// the bits of the in-place product on a copy of c_in, and leaves c_in as it was: through
// cuBLASLt (padded ldc, fp32 and bf16 out, with and without tuning), the few-row GEMV and K = 0.
TEST(CudaGemm, SeparateCInputMatchesInPlace) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  using cuda::GemmTuning;
  struct Case {
    int64_t M, N, K;
    GemmTuning tune;
  };
  uint32_t seed = 40;
  // Accumulating tunes these beta = 1 products (the residual adds' class), as All does.
  for (Case cs : {Case{300, 257, 96, GemmTuning::Off}, Case{300, 257, 96, GemmTuning::All},
                  Case{300, 257, 96, GemmTuning::Accumulating}, Case{2, 128, 256, GemmTuning::Off},
                  Case{64, 64, 0, GemmTuning::Off}}) {
    for (auto out : {cuda::GemmOutType::F32, cuda::GemmOutType::Bf16}) {
      const int64_t M = cs.M, N = cs.N, K = cs.K, ldc = N + 3;
      SCOPED_TRACE(str_cat("M=", M, " N=", N, " K=", K, " tune=", int(cs.tune),
                           " f32=", out == cuda::GemmOutType::F32));
      cuda::GemmContext context;
      context.set_tuning(cs.tune);
      const Bf16Host A = random_bf16(size_t(std::max<int64_t>(1, M * K)), seed++);
      const Bf16Host B = random_bf16(size_t(std::max<int64_t>(1, N * K)), seed++);
      const Bf16Host C0 = random_bf16(size_t(M * ldc), seed++);
      cuda::DeviceArena arena(size_t(16) << 20);
      const uint16_t* A_dev = upload(arena, A.bits);
      const uint16_t* B_dev = upload(arena, B.bits);
      const bool f32 = out == cuda::GemmOutType::F32;
      auto up = [&]() -> void* {
        return f32 ? static_cast<void*>(upload(arena, C0.values))
                   : static_cast<void*>(upload(arena, C0.bits));
      };
      void* c_in = up();
      void* in_place = up();
      void* separate = f32 ? static_cast<void*>(arena.alloc<float>(size_t(M * ldc)))
                           : static_cast<void*>(arena.alloc<uint16_t>(size_t(M * ldc)));
      // A [M, K] row-major, B [N, K] (the linear layers' x·Wᵀ).
      context.gemm_bf16(false, true, M, N, K, 1.0f, A_dev, K, B_dev, K, 1.0f, in_place, out, ldc);
      context.gemm_bf16(false, true, M, N, K, 1.0f, A_dev, K, B_dev, K, 1.0f, separate, out, ldc,
                        nullptr, c_in);
      cuda::synchronize();
      auto rows = [&](void* p) {  // the M×N block of a [M, ldc] matrix, as floats
        std::vector<float> all = f32 ? download(static_cast<float*>(p), size_t(M * ldc))
                                     : test::mla::bf16_bits_to_floats(
                                           download(static_cast<uint16_t*>(p), size_t(M * ldc)));
        std::vector<float> block;
        for (int64_t i = 0; i < M; ++i)
          block.insert(block.end(), all.begin() + i * ldc, all.begin() + i * ldc + N);
        return block;
      };
      EXPECT_EQ(rows(separate), rows(in_place));
      EXPECT_EQ(rows(c_in), rows(up()));  // c_in untouched
    }
  }
}

// Tuning (GemmContext::set_tuning) against the heuristic's choice, and both against the CPU: the
// same products (bf16 rounding aside), one new cache entry per new key, none on a repeated call.
// The beta = 1 cases start from the same C and must come out as C + product: the timing runs the
// product up to 1 + 8·4 times into C, so a C not restored would hold a multiple of it. C is padded
// (ldc = N + 3) so the restore must respect the pitch; the batched case interleaves heads in C.
TEST(CudaGemm, TunedMatchesHeuristic) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  cuda::GemmContext plain, tuned;
  plain.set_tuning(false);  // whatever DM_GEMM_TUNE says
  tuned.set_tuning(true);
  EXPECT_EQ(plain.tuning(), cuda::GemmTuning::Off);
  EXPECT_EQ(tuned.tuning(), cuda::GemmTuning::All);
  struct Case {
    bool ta, tb;
    int64_t M, N, K;
    float beta;
    cuda::GemmOutType out;
    bool f32;  // gemm_f32 (fp32 operands) rather than gemm_bf16
  };
  uint32_t seed = 500;
  int keys = 0;
  for (Case c : {Case{false, false, 256, 512, 384, 0.0f, cuda::GemmOutType::Bf16, false},
                 Case{false, true, 300, 1000, 64, 0.0f, cuda::GemmOutType::Bf16, false},
                 Case{true, false, 200, 384, 256, 1.0f, cuda::GemmOutType::F32, false},
                 Case{false, true, 130, 257, 96, 1.0f, cuda::GemmOutType::F32, true}}) {
    const bool out_f32 = c.out == cuda::GemmOutType::F32;
    SCOPED_TRACE(str_cat("M=", c.M, " N=", c.N, " K=", c.K, " ta=", c.ta, " tb=", c.tb,
                         " beta=", c.beta, " f32 out=", out_f32, " gemm_f32=", c.f32));
    const int64_t lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.N, ldc = c.N + 3;
    const Bf16Host A = random_bf16(size_t((c.ta ? c.K : c.M) * lda), seed++);
    const Bf16Host B = random_bf16(size_t((c.tb ? c.N : c.K) * ldb), seed++);
    const Bf16Host C0 = random_bf16(size_t(c.M * ldc), seed++);
    cuda::DeviceArena arena(size_t(32) << 20);
    // C after one call on `context`, from C0.
    auto product = [&](cuda::GemmContext& context) {
      void* C_dev = out_f32 ? static_cast<void*>(upload(arena, C0.values))
                            : static_cast<void*>(upload(arena, C0.bits));
      if (c.f32)
        context.gemm_f32(c.ta, c.tb, c.M, c.N, c.K, 1.25f, upload(arena, A.values), lda,
                         upload(arena, B.values), ldb, c.beta, static_cast<float*>(C_dev), ldc);
      else
        context.gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, 1.25f, upload(arena, A.bits), lda,
                          upload(arena, B.bits), ldb, c.beta, C_dev, c.out, ldc);
      cuda::synchronize();
      return out_f32 ? download(static_cast<float*>(C_dev), C0.values.size())
                     : test::mla::bf16_bits_to_floats(
                           download(static_cast<uint16_t*>(C_dev), C0.values.size()));
    };
    std::vector<float> ref = C0.values;
    gemm(c.ta, c.tb, c.M, c.N, c.K, 1.25f, A.values.data(), lda, B.values.data(), ldb, c.beta,
         ref.data(), ldc);
    const double tolerance = out_f32 ? 1e-5 : 1e-2;
    const std::vector<float> heuristic = product(plain);
    const std::vector<float> timed = product(tuned);
    EXPECT_EQ(tuned.cached_algorithms(), ++keys);
    const std::vector<float> again = product(tuned);  // cached: no timing
    EXPECT_EQ(tuned.cached_algorithms(), keys);
    ASSERT_TRUE(test::mla::all_finite(timed));
    EXPECT_LE(test::rel_rms(timed.data(), heuristic.data(), ref.size()), tolerance);
    EXPECT_LE(test::rel_rms(timed.data(), ref.data(), ref.size()), tolerance);
    EXPECT_LE(test::rel_rms(again.data(), ref.data(), ref.size()), tolerance);
  }

  // Strided batched, beta = 1, fp32 out: heads h = 0..H-1 interleaved in A and C (ld = H·width,
  // stride = width), stacked in B; the restore covers the span of all heads.
  const int64_t H = 6, M = 40, N = 64, K = 48, lda = H * K, ldc = H * N;
  const Bf16Host A = random_bf16(size_t(M * lda), seed++);
  const Bf16Host B = random_bf16(size_t(H * K * N), seed++);
  const Bf16Host C0 = random_bf16(size_t(M * ldc), seed++);
  cuda::DeviceArena arena(size_t(8) << 20);
  auto batched = [&](cuda::GemmContext& context) {
    float* C_dev = upload(arena, C0.values);
    context.gemm_bf16_strided_batched(false, false, M, N, K, 1.0f, upload(arena, A.bits), lda, K,
                                      upload(arena, B.bits), N, K * N, 1.0f, C_dev,
                                      cuda::GemmOutType::F32, ldc, N, H);
    cuda::synchronize();
    return download(C_dev, C0.values.size());
  };
  std::vector<float> ref = C0.values;
  for (int64_t h = 0; h < H; ++h)
    gemm(false, false, M, N, K, 1.0f, A.values.data() + h * K, lda, B.values.data() + h * K * N, N,
         1.0f, ref.data() + h * N, ldc);
  const std::vector<float> heuristic = batched(plain);
  const std::vector<float> timed = batched(tuned);
  EXPECT_EQ(tuned.cached_algorithms(), ++keys);
  ASSERT_TRUE(test::mla::all_finite(timed));
  EXPECT_LE(test::rel_rms(timed.data(), heuristic.data(), ref.size()), 1e-5);
  EXPECT_LE(test::rel_rms(timed.data(), ref.data(), ref.size()), 1e-5);
}

// ---- router ------------------------------------------------------------------------------------

struct RouteCase {
  int E, k, n_group, topk_group;
  float scaling;
};

TEST(CudaMoeRoute, MatchesCpuRouter) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t N = 777;
  uint32_t seed = 40;
  for (RouteCase c : {RouteCase{64, 6, 1, 1, 2.5f}, RouteCase{64, 6, 8, 3, 1.0f},
                      RouteCase{256, 8, 1, 1, 2.446f}, RouteCase{7, 7, 1, 1, 1.0f},
                      // past the kernel's register-held 256 experts (Kimi-K2 has 384)
                      RouteCase{384, 8, 1, 1, 2.827f}, RouteCase{384, 8, 8, 4, 1.0f}}) {
    SCOPED_TRACE(str_cat("E=", c.E, " k=", c.k, " groups=", c.n_group, "/", c.topk_group));
    RouterParams p;
    p.num_experts = c.E;
    p.top_k = c.k;
    p.n_group = c.n_group;
    p.topk_group = c.topk_group;
    p.scaling = c.scaling;
    std::mt19937 rng(seed++);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> logits(static_cast<size_t>(N * c.E)), bias(static_cast<size_t>(c.E));
    for (auto& x : logits) x = normal(rng);
    for (auto& x : bias) x = 0.1f * normal(rng);
    std::vector<float> scores(logits.size()), w(static_cast<size_t>(N * c.k)), cutoff(static_cast<size_t>(N));
    std::vector<int32_t> idx(static_cast<size_t>(N * c.k));
    moe_route<float>(logits.data(), bias.data(), N, p, scores.data(), idx.data(), w.data(),
                     cutoff.data());

    cuda::DeviceArena arena(size_t(8) << 20);
    float* scores_dev = test::mla::alloc_poisoned<float>(arena, scores.size());
    float* w_dev = test::mla::alloc_poisoned<float>(arena, w.size());
    float* cutoff_dev = test::mla::alloc_poisoned<float>(arena, cutoff.size());
    int32_t* idx_dev = test::mla::alloc_poisoned<int32_t>(arena, idx.size());
    cuda::moe_route(upload(arena, logits), upload(arena, bias), N, p, scores_dev, idx_dev, w_dev,
                    cutoff_dev);
    cuda::synchronize();
    const std::vector<float> scores_gpu = download(scores_dev, scores.size());
    const std::vector<float> w_gpu = download(w_dev, w.size());
    const std::vector<float> cutoff_gpu = download(cutoff_dev, cutoff.size());
    const std::vector<int32_t> idx_gpu = download(idx_dev, idx.size());
    EXPECT_LE(test::rel_rms(scores_gpu.data(), scores.data(), scores.size()), 1e-6);

    int64_t compared = 0;
    for (int64_t t = 0; t < N; ++t) {
      // Ties aside: skip tokens whose biased scores have two values closer than the sigmoid
      // implementations can disagree by (1e-5) among their top k+2.
      std::vector<float> biased(static_cast<size_t>(c.E));
      for (int e = 0; e < c.E; ++e) biased[size_t(e)] = scores[size_t(t * c.E + e)] + bias[size_t(e)];
      std::sort(biased.begin(), biased.end(), std::greater<float>());
      bool near_tie = false;
      for (int i = 0; i + 1 < std::min(c.E, c.k + 2); ++i)
        near_tie |= biased[size_t(i)] - biased[size_t(i + 1)] < 1e-5f;
      if (c.n_group > 1) {  // group scores (sum of the two best biased values) near a tie
        const int group_size = c.E / c.n_group;
        std::vector<float> group_scores;
        for (int g = 0; g < c.n_group; ++g) {
          std::vector<float> members;
          for (int e = g * group_size; e < (g + 1) * group_size; ++e)
            members.push_back(scores[size_t(t * c.E + e)] + bias[size_t(e)]);
          std::sort(members.begin(), members.end(), std::greater<float>());
          group_scores.push_back(members[0] + members[1]);
        }
        std::sort(group_scores.begin(), group_scores.end(), std::greater<float>());
        for (int i = 0; i + 1 < std::min(c.n_group, c.topk_group + 1); ++i)
          near_tie |= group_scores[size_t(i)] - group_scores[size_t(i + 1)] < 1e-5f;
      }
      if (near_tie) continue;
      ++compared;
      for (int s = 0; s < c.k; ++s) {
        const size_t i = size_t(t * c.k + s);
        ASSERT_EQ(idx_gpu[i], idx[i]) << "token " << t << " slot " << s;
        EXPECT_NEAR(w_gpu[i], w[i], 1e-5f * std::max(1.0f, std::fabs(w[i])));
      }
      if (std::isinf(cutoff[size_t(t)]))
        EXPECT_TRUE(std::isinf(cutoff_gpu[size_t(t)]) && cutoff_gpu[size_t(t)] < 0);
      else
        EXPECT_NEAR(cutoff_gpu[size_t(t)], cutoff[size_t(t)], 1e-5f);
    }
    EXPECT_GT(compared, N / 2);
  }
}

// Exact ties everywhere: logits from four values and no bias, so every token's top k + 1 holds
// equal scores and the picks are decided by the tie rule alone (the lower expert first), the
// same on both sides because equal logits give equal sigmoids within each implementation.
TEST(CudaMoeRoute, TiesGoToTheLowerExpert) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t N = 64;
  for (int E : {256, 64, 7}) {
    SCOPED_TRACE(str_cat("E=", E));
    RouterParams p;
    p.num_experts = E;
    p.top_k = std::min(8, E - 1);
    const int k = p.top_k;
    std::mt19937 gen{uint32_t(E)};
    const float values[] = {-1.0f, 0.0f, 0.5f, 1.0f};
    std::vector<float> logits(static_cast<size_t>(N * E)), bias(static_cast<size_t>(E), 0.0f);
    for (auto& x : logits) x = values[gen() % 4];
    std::vector<float> scores(logits.size()), w(static_cast<size_t>(N * k)),
        cutoff(static_cast<size_t>(N));
    std::vector<int32_t> idx(static_cast<size_t>(N * k));
    moe_route<float>(logits.data(), bias.data(), N, p, scores.data(), idx.data(), w.data(),
                     cutoff.data());
    cuda::DeviceArena arena(size_t(4) << 20);
    float* scores_dev = arena.alloc<float>(scores.size());
    float* w_dev = arena.alloc<float>(w.size());
    float* cutoff_dev = arena.alloc<float>(cutoff.size());
    int32_t* idx_dev = arena.alloc<int32_t>(idx.size());
    cuda::moe_route(upload(arena, logits), upload(arena, bias), N, p, scores_dev, idx_dev, w_dev,
                    cutoff_dev);
    cuda::synchronize();
    EXPECT_EQ(download(idx_dev, idx.size()), idx);
    const std::vector<float> cutoff_gpu = download(cutoff_dev, cutoff.size());
    for (int64_t t = 0; t < N; ++t)
      EXPECT_NEAR(cutoff_gpu[size_t(t)], cutoff[size_t(t)], 1e-6f) << "token " << t;
  }
}

// Parameter checks run before any device work (no GPU needed).
TEST(CudaMoeRoute, RejectsBadParameters) {
  auto* fake = reinterpret_cast<float*>(uintptr_t(1) << 12);
  auto* fake_idx = reinterpret_cast<int32_t*>(uintptr_t(1) << 12);
  RouterParams p;
  p.num_experts = 8;
  p.top_k = 9;  // more than the experts
  EXPECT_THROW(cuda::moe_route(fake, nullptr, 4, p, fake, fake_idx, fake, nullptr), Error);
  p.top_k = 2;
  p.n_group = 3;  // 8 experts do not split into 3 groups
  p.topk_group = 1;
  EXPECT_THROW(cuda::moe_route(fake, nullptr, 4, p, fake, fake_idx, fake, nullptr), Error);
  p.n_group = 4;
  p.topk_group = 5;  // more groups kept than exist
  EXPECT_THROW(cuda::moe_route(fake, nullptr, 4, p, fake, fake_idx, fake, nullptr), Error);
}

// ---- dispatch ----------------------------------------------------------------------------------

// idx [N,k]: k distinct experts per token drawn from the first `used_experts` of E (so some
// experts stay empty), each row ascending like moe_route's.
std::vector<int32_t> random_routing(int64_t N, int k, int E, int used_experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> experts(static_cast<size_t>(used_experts)), idx(static_cast<size_t>(N * k));
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::sort(experts.begin(), experts.begin() + k);
    std::copy(experts.begin(), experts.begin() + k, idx.begin() + t * k);
  }
  (void)E;
  return idx;
}

TEST(CudaMoeDispatch, PlanMatchesCpuAndRoundTrips) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  for (auto [N, k, E, used] : {std::tuple<int64_t, int, int, int>{1, 1, 4, 4}, {700, 6, 64, 50},
                               {3000, 8, 256, 256}}) {
    SCOPED_TRACE(str_cat("N=", N, " k=", k, " E=", E));
    const std::vector<int32_t> idx = random_routing(N, k, E, used, uint32_t(N + k));
    Arena host_arena(moe_plan_bytes(N, k, E));
    MoePlan cpu;
    moe_plan_build(idx.data(), N, k, E, &cpu, host_arena);

    cuda::DeviceArena arena(size_t(32) << 20);
    const int32_t* idx_dev = upload(arena, idx);
    std::vector<int64_t> host_offsets(static_cast<size_t>(E) + 1);
    cuda::MoeDispatchPlan plan;
    cuda::moe_dispatch_plan_build(idx_dev, N, k, E, &plan, arena, host_offsets.data());
    EXPECT_TRUE(std::equal(host_offsets.begin(), host_offsets.end(), cpu.offsets));
    const std::vector<int32_t> token = download(plan.token, size_t(N * k));
    const std::vector<int32_t> slot = download(plan.slot, size_t(N * k));
    EXPECT_TRUE(std::equal(token.begin(), token.end(), cpu.token));
    EXPECT_TRUE(std::equal(slot.begin(), slot.end(), cpu.slot));
    // Built without the host copy (no synchronisation): the same device arrays.
    cuda::MoeDispatchPlan device_only;
    cuda::moe_dispatch_plan_build(idx_dev, N, k, E, &device_only, arena, nullptr);
    EXPECT_EQ(device_only.host_offsets, nullptr);
    const std::vector<int64_t> offsets = download(device_only.offsets, size_t(E) + 1);
    EXPECT_TRUE(std::equal(offsets.begin(), offsets.end(), cpu.offsets));
    EXPECT_EQ(download(device_only.row_of_pair, size_t(N * k)),
              download(plan.row_of_pair, size_t(N * k)));
    EXPECT_EQ(download(device_only.token, size_t(N * k)), token);

    // Round trip: permute rows, unpermute with weights 1/k → the original rows.
    const int64_t D = 40;
    const Bf16Host x = random_bf16(size_t(N * D), 5);
    uint16_t* sorted = test::mla::alloc_poisoned<uint16_t>(arena, size_t(N * k * D));
    cuda::moe_permute_rows(upload(arena, x.bits), plan, D, sorted);
    const std::vector<float> w(static_cast<size_t>(N * k), 1.0f / float(k));
    float* y = test::mla::alloc_poisoned<float>(arena, size_t(N * D));
    cuda::moe_unpermute_rows(sorted, plan, upload(arena, w), D, y, cuda::GemmOutType::F32);
    cuda::synchronize();
    const std::vector<float> back = download(y, size_t(N * D));
    EXPECT_LE(test::rel_rms(back.data(), x.values.data(), back.size()), 1e-6);
  }
  // An expert id outside [0, E) is reported.
  cuda::DeviceArena arena(1 << 20);
  const std::vector<int32_t> bad = {0, 1, 2, 4};
  std::vector<int64_t> host_offsets(5);
  cuda::MoeDispatchPlan plan;
  EXPECT_THROW(cuda::moe_dispatch_plan_build(upload(arena, bad), 2, 2, 4, &plan, arena,
                                             host_offsets.data()),
               Error);
}

// ---- grouped experts ---------------------------------------------------------------------------

// A grouped-experts forward problem: routing over the first `used` of E experts (the rest get no
// token, so grouped GEMMs must skip them), bf16 x and weights (scaled by 1/√fan-in), slot weights
// in [0.1, 1).
struct ExpertsCase {
  int64_t N, E, Din, F;
  int k;
  std::vector<int32_t> idx;
  Bf16Host x, gate, up, down;
  std::vector<float> w;

  ExpertsCase(int64_t n, int64_t e, int64_t din, int64_t f, int k_, int used, uint32_t seed)
      : N(n), E(e), Din(din), F(f), k(k_), idx(random_routing(n, k_, int(e), used, seed)),
        x(random_bf16(size_t(n * din), seed + 1)),
        gate(random_bf16(size_t(e * f * din), seed + 2, 1.0f / std::sqrt(float(din)))),
        up(random_bf16(size_t(e * f * din), seed + 3, 1.0f / std::sqrt(float(din)))),
        down(random_bf16(size_t(e * din * f), seed + 4, 1.0f / std::sqrt(float(f)))),
        w(size_t(n * k_)) {
    std::mt19937 rng(seed + 5);
    std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
    for (auto& value : w) value = uniform(rng);
  }
  // Expert e's weights become NaN (an expert without rows: no kernel may read them for another
  // expert's rows, e.g. through a tile reaching past N into the next expert's matrix).
  void poison_expert(int64_t e) {
    for (Bf16Host* m : {&gate, &up, &down}) {
      const size_t begin = size_t(e * F * Din), end = size_t((e + 1) * F * Din);
      std::fill(m->bits.begin() + begin, m->bits.begin() + end, uint16_t(0x7FC0));
      std::fill(m->values.begin() + begin, m->values.begin() + end,
                std::numeric_limits<float>::quiet_NaN());
    }
  }
  // y [N, Din] of the CPU reference.
  std::vector<float> reference(const GluActivation& act) const {
    std::vector<float> y(size_t(N * Din));
    ExpertWeights ew{gate.values.data(), up.values.data(), down.values.data(), E, Din, F};
    moe_experts_reference(x.values.data(), idx.data(), w.data(), N, k, ew, act, y.data());
    return y;
  }
  // y [N, Din] of moe_experts_forward on the GPU through `path`; host_offsets (optional) gets
  // the plan's offsets. GroupedOwn runs on a plan built without its host copy, as the layers
  // build it for that path.
  // recompute: through moe_experts_recompute (the training forward: g and u kept beside h)
  // instead of moe_experts_forward (h in place of g).
  std::vector<float> gpu(const GluActivation& act, cuda::MoeGemmPath path,
                         std::vector<int64_t>* offsets_out = nullptr,
                         bool recompute = false) const {
    cuda::GemmContext context;
    cuda::DeviceArena arena(size_t(64) << 20);
    std::vector<int64_t> host_offsets(static_cast<size_t>(E) + 1);
    cuda::MoeDispatchPlan plan;
    const bool host_plan = path != cuda::MoeGemmPath::GroupedOwn;
    cuda::moe_dispatch_plan_build(upload(arena, idx), N, k, int(E), &plan, arena,
                                  host_plan ? host_offsets.data() : nullptr);
    if (!host_plan) host_offsets = download(plan.offsets, static_cast<size_t>(E) + 1);
    cuda::ExpertWeightsBf16 ew{
        upload(arena, gate.bits), upload(arena, up.bits), upload(arena, down.bits), E, Din, F};
    float* y = test::mla::alloc_poisoned<float>(arena, size_t(N * Din));
    if (recompute) {
      void* workspace = arena.alloc_bytes(cuda::moe_experts_backward_workspace_bytes(N, k, ew));
      cuda::moe_experts_recompute(context, upload(arena, x.bits), plan, upload(arena, w), ew, act,
                                  y, workspace, path);
    } else {
      void* workspace = arena.alloc_bytes(cuda::moe_experts_forward_workspace_bytes(N, k, ew));
      cuda::moe_experts_forward(context, upload(arena, x.bits), plan, upload(arena, w), ew, act, y,
                                cuda::GemmOutType::F32, workspace, path);
    }
    cuda::synchronize();
    if (offsets_out) *offsets_out = host_offsets;
    return download(y, size_t(N * Din));
  }
};

TEST(CudaMoeExperts, GroupedMatchesReference) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const ExpertsCase c(200, 16, 64, 48, 4, /*used=*/12, 77);  // experts 12..15 get no token
  for (auto kind : {Activation::SwiGLU, Activation::SiTU}) {
    GluActivation act;
    act.kind = kind;
    const std::vector<float> y_ref = c.reference(act);
    for (auto path : {cuda::MoeGemmPath::Grouped, cuda::MoeGemmPath::Loop,
                      cuda::MoeGemmPath::GroupedOwn}) {
      SCOPED_TRACE(str_cat("situ=", kind == Activation::SiTU, " path=", int(path)));
      const std::vector<float> y_gpu = c.gpu(act, path);
      ASSERT_TRUE(test::mla::all_finite(y_gpu));
      EXPECT_LE(test::rel_rms(y_gpu.data(), y_ref.data(), y_ref.size()), 1e-2);
    }
  }
}

// Our grouped forward kernel (MoeGemmPath::GroupedOwn, DM_MOE_GEMM=own) at a shape the test above
// does not reach: two row tiles per expert with a partial last one, partial column tiles, K tails
// (Din = 200 = 3·64 + 8 for gate/up, F = 136 = 2·64 + 8 for down) and two empty experts. Against
// one cuBLASLt GEMM per expert (Loop: the same bf16 operands, fp32 accumulation in another order,
// so only bf16 roundings of the gate/up intermediates differ) and against the CPU reference.
// The wgmma conventions alone (wgmma.cuh: 128-byte-swizzled K-major descriptors, the k16
// advance, the accumulator layout) on one 64 × 128 × 64 tile against the CPU: if the grouped
// wgmma kernel below fails and this passes, the fault is in its ring or tiling.
TEST(CudaMoeExperts, WgmmaTileMatchesCpu) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const Bf16Host a = random_bf16(64 * 64, 301), b = random_bf16(128 * 64, 302);
  cuda::DeviceArena arena(size_t(1) << 20);
  const uint16_t* a_dev = upload(arena, a.bits);
  const uint16_t* b_dev = upload(arena, b.bits);
  std::vector<float> ref(64 * 128);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 128; ++j) {
      double sum = 0.0;
      for (int k = 0; k < 64; ++k)
        sum += double(a.values[size_t(i * 64 + k)]) * double(b.values[size_t(j * 64 + k)]);
      ref[size_t(i * 128 + j)] = float(sum);
    }
  // Both operands K-major (the forward), B MN-major (the backward's rows), both MN-major (its
  // weight gradients).
  for (int transposed : {0, 1, 2}) {
    SCOPED_TRACE(str_cat("transposed=", transposed));
    float* c_dev = test::mla::alloc_poisoned<float>(arena, 64 * 128);
    cuda::moe_wgmma_tile_check(a_dev, b_dev, c_dev, transposed);
    const std::vector<float> c = download(c_dev, 64 * 128);
    ASSERT_TRUE(test::mla::all_finite(c));
    // fp32 accumulation of exact bf16 products: only the summation order differs.
    EXPECT_LE(test::rel_rms(c.data(), ref.data(), ref.size()), 1e-5);
  }
}

// The 128 × 256-tile forward product (launch_grouped_rows_nk_bf16_wgmma_wide, DM_MOE_WGMMA_WIDE)
// and the TMA-fed ones (launch_grouped_rows_nk_bf16_tma, DM_MOE_TMA, both widths)
// against the 128 × 128 one and a double-precision reference: three column tiles of 256 with a
// partial last one (N = 520), a K tail (200 = 3·64 + 8), experts of 150, 0, 270, 10 and 270 rows
// (partial row tiles, an empty expert), both schedules. Each output element sums the same bf16
// products in the same k16 order, so the two kernels should agree to the bit.
TEST(CudaMoeExperts, WideTilesMatchNarrowTiles) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t R = 700, K = 200, N = 520;
  const int E = 5;
  const std::vector<int64_t> offsets = {0, 150, 150, 420, 430, 700};
  const Bf16Host a = random_bf16(size_t(R * K), 401);
  const Bf16Host w = random_bf16(size_t(E * N * K), 402, 1.0f / std::sqrt(float(K)));
  std::vector<double> ref(size_t(R * N));
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[size_t(e)]; r < offsets[size_t(e) + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (int64_t k = 0; k < K; ++k)
          sum +=
              double(a.values[size_t(r * K + k)]) * double(w.values[size_t((e * N + n) * K + k)]);
        ref[size_t(r * N + n)] = sum;
      }
  cuda::DeviceArena arena(size_t(16) << 20);
  const uint16_t* a_dev = upload(arena, a.bits);
  const uint16_t* w_dev = upload(arena, w.bits);
  const int64_t* offsets_dev = upload(arena, offsets);
  const bool overlap_before = cuda::moe_wgmma_overlap();
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(str_cat("overlap=", overlap));
    cuda::moe_set_wgmma_overlap(overlap);
    uint16_t* narrow = test::mla::alloc_poisoned<uint16_t>(arena, size_t(R * N));
    cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(a_dev, w_dev, offsets_dev, E, R, K, N,
                                                        narrow, nullptr);
    cuda::synchronize();
    const std::vector<uint16_t> narrow_bits = download(narrow, size_t(R * N));
    // The 128 × 256 cp.async kernel, then the TMA-fed ones (moe_grouped_gemm_tma.cu) on 128 × 128
    // and 128 × 256 tiles (the schedule flag does not apply to them).
    // Then the persistent pingpong kernel (moe_grouped_gemm_pingpong.cu).
    for (int kernel : {0, 1, 2, 3}) {
      SCOPED_TRACE(str_cat("kernel=", kernel));
      uint16_t* other = test::mla::alloc_poisoned<uint16_t>(arena, size_t(R * N));
      if (kernel == 0) {
        ASSERT_TRUE(cuda::moe_detail::grouped_rows_wide_applies(N, other));
        cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma_wide(a_dev, w_dev, offsets_dev, E, R, K,
                                                                 N, other, nullptr);
      } else if (kernel == 3) {
        cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(a_dev, w_dev, offsets_dev, E, R, K,
                                                               N, other, nullptr);
      } else {
        ASSERT_TRUE(cuda::moe_detail::grouped_rows_tma_applies(a_dev, w_dev, K, N, other));
        cuda::moe_detail::launch_grouped_rows_nk_bf16_tma(a_dev, w_dev, offsets_dev, E, R, K, N,
                                                          other, kernel == 2, nullptr);
      }
      cuda::synchronize();
      const std::vector<uint16_t> other_bits = download(other, size_t(R * N));
      std::vector<float> other_values(other_bits.size()), ref_values(ref.size());
      for (size_t i = 0; i < other_bits.size(); ++i) other_values[i] = bf16_to_f32(other_bits[i]);
      for (size_t i = 0; i < ref.size(); ++i) ref_values[i] = float(ref[i]);
      ASSERT_TRUE(test::mla::all_finite(other_values));
      EXPECT_LE(test::rel_rms(other_values.data(), ref_values.data(), ref.size()), 5e-3);
      size_t differing = 0;
      for (size_t i = 0; i < other_bits.size(); ++i) differing += other_bits[i] != narrow_bits[i];
      EXPECT_EQ(differing, 0u) << "of " << other_bits.size() << " outputs";
    }
  }
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma_wide(
                   a_dev, w_dev, offsets_dev, E, R, K, 518, nullptr, nullptr),
               Error);
  // The TMA wants 16-byte row strides: K = 198 is refused, as is a misaligned A.
  EXPECT_FALSE(cuda::moe_detail::grouped_rows_tma_applies(a_dev, w_dev, 198, N, a_dev));
  EXPECT_FALSE(cuda::moe_detail::grouped_rows_tma_applies(a_dev + 1, w_dev, K, N, a_dev));
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_nk_bf16_tma(a_dev, w_dev, offsets_dev, E, R,
                                                                 198, N, nullptr, false, nullptr),
               Error);
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(a_dev, w_dev, offsets_dev, E,
                                                                      R, 198, N, nullptr, nullptr),
               Error);
  cuda::moe_set_wgmma_overlap(overlap_before);
}

// The persistent pingpong kernels where each CTA walks many tiles (more than two per SM, so both
// consumer warpgroups take several and the ring wraps across tiles): bitwise against the
// cp.async wgmma kernels, the plain product and the gate/up products with the GLU epilogue (g, u
// kept and not), over 7 uneven experts (one empty, partial row tiles), K = 520 (a k tail of 8),
// N = F = 264 (a partial column tile of 8, reaching into the next expert's weight rows, which are
// NaN for an expert with no rows: a tile that read them into a stored column would fail).
TEST(CudaMoeExperts, PingpongMatchesAcrossManyTiles) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t R = 20000, K = 520, N = 264;
  const int E = 7;
  const std::vector<int64_t> offsets = {0, 3001, 3001, 9000, 9130, 15000, 15001, 20000};
  const Bf16Host a = random_bf16(size_t(R * K), 411);
  Bf16Host w = random_bf16(size_t(E * N * K), 412, 1.0f / std::sqrt(float(K)));
  Bf16Host w_up = random_bf16(size_t(E * N * K), 413, 1.0f / std::sqrt(float(K)));
  for (int64_t i = N * K; i < 2 * N * K; ++i)  // expert 1 (no rows) follows expert 0
    w.bits[size_t(i)] = w_up.bits[size_t(i)] = 0x7fc0;
  cuda::DeviceArena arena(size_t(256) << 20);
  const uint16_t* a_dev = upload(arena, a.bits);
  const uint16_t* w_dev = upload(arena, w.bits);
  const uint16_t* w_up_dev = upload(arena, w_up.bits);
  const int64_t* offsets_dev = upload(arena, offsets);
  const size_t out = size_t(R * N);
  std::vector<uint16_t*> y(8);
  for (uint16_t*& p : y) p = test::mla::alloc_poisoned<uint16_t>(arena, out);
  cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(a_dev, w_dev, offsets_dev, E, R, K, N, y[0],
                                                      nullptr);
  cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(a_dev, w_dev, offsets_dev, E, R, K, N,
                                                         y[1], nullptr);
  cuda::GluKernelParams act;
  act.situ = true;
  // GLU: cp.async kernel (g, u, h) into y[2..4], pingpong into y[5..7].
  ASSERT_TRUE(cuda::moe_detail::grouped_gate_up_glu_pingpong_applies(a_dev, w_dev, w_up_dev, K, N,
                                                                     y[5], y[6], y[7]));
  cuda::moe_detail::launch_grouped_gate_up_glu_wgmma(a_dev, w_dev, w_up_dev, offsets_dev, E, R, K,
                                                     N, y[2], y[3], y[4], act, nullptr);
  cuda::moe_detail::launch_grouped_gate_up_glu_pingpong(a_dev, w_dev, w_up_dev, offsets_dev, E, R,
                                                        K, N, y[5], y[6], y[7], act, nullptr);
  uint16_t* h_alone = test::mla::alloc_poisoned<uint16_t>(arena, out);  // g and u not kept
  cuda::moe_detail::launch_grouped_gate_up_glu_pingpong(
      a_dev, w_dev, w_up_dev, offsets_dev, E, R, K, N, nullptr, nullptr, h_alone, act, nullptr);
  cuda::synchronize();
  std::vector<std::vector<uint16_t>> bits;
  for (uint16_t* p : y) bits.push_back(download(p, out));
  const std::vector<uint16_t> h_alone_bits = download(h_alone, out);
  auto differing = [&](const std::vector<uint16_t>& x, const std::vector<uint16_t>& ref) {
    size_t n = 0;
    for (size_t i = 0; i < out; ++i) n += x[i] != ref[i];
    return n;
  };
  std::vector<float> values(out);
  for (size_t i = 0; i < out; ++i) values[i] = bf16_to_f32(bits[1][i]);
  ASSERT_TRUE(test::mla::all_finite(values));
  EXPECT_EQ(differing(bits[1], bits[0]), 0u) << "plain product";
  EXPECT_EQ(differing(bits[5], bits[2]), 0u) << "g";
  EXPECT_EQ(differing(bits[6], bits[3]), 0u) << "u";
  EXPECT_EQ(differing(bits[7], bits[4]), 0u) << "h";
  EXPECT_EQ(differing(h_alone_bits, bits[4]), 0u) << "h without g, u";
  // The g the GLU kernels keep is the plain product with W_gate.
  EXPECT_EQ(differing(bits[5], bits[0]), 0u) << "g vs the plain product";
}

// The pingpong kernels' preconditions are host arithmetic on the arguments, checked before any
// CUDA call: this runs (and must refuse) without a GPU. Pointers are never dereferenced.
TEST(CudaMoeExperts, PingpongPreconditionsRefuseBadShapes) {
  alignas(16) static uint16_t operand[64];
  alignas(16) static float out[64];
  const uint16_t* a = operand;
  const uint16_t* misaligned = operand + 1;  // 2 bytes off a 16-byte boundary
  const int64_t offsets[2] = {0, 8};
  using cuda::moe_detail::grouped_rows_backward_pingpong_applies;
  using cuda::moe_detail::grouped_weight_grad_pingpong_applies;
  // Weight gradient: row strides multiples of 8 and ≥ M, N; N % 4; 16-byte aligned A, B, C;
  // 0 < R < 2^31.
  EXPECT_TRUE(grouped_weight_grad_pingpong_applies(a, 1024, a, 512, 24576, 1024, 512, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(misaligned, 1024, a, 512, 8, 1024, 512, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(a, 1020, a, 512, 8, 1020, 512, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(a, 1024, a, 512, 8, 1032, 512, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(a, 1024, a, 520, 8, 1024, 518, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(a, 1024, a, 512, 8, 1024, 512, out + 1));
  EXPECT_FALSE(
      grouped_weight_grad_pingpong_applies(a, 1024, a, 512, int64_t(1) << 31, 1024, 512, out));
  EXPECT_FALSE(grouped_weight_grad_pingpong_applies(a, 1024, a, 512, 0, 1024, 512, out));
  EXPECT_THROW(cuda::moe_detail::launch_grouped_weight_grad_pingpong(a, 1020, a, 512, offsets, 1, 8,
                                                                     1020, 512, out, nullptr, true),
               Error);
  // Rows: K, N multiples of 8, aligned operands and Y, A2 and B2 both or neither.
  EXPECT_TRUE(grouped_rows_backward_pingpong_applies(a, a, a, a, 8, 512, 1024, out));
  EXPECT_TRUE(grouped_rows_backward_pingpong_applies(a, a, nullptr, nullptr, 8, 512, 1024, out));
  EXPECT_FALSE(grouped_rows_backward_pingpong_applies(a, a, a, nullptr, 8, 512, 1024, out));
  EXPECT_FALSE(grouped_rows_backward_pingpong_applies(a, a, nullptr, nullptr, 8, 516, 1024, out));
  EXPECT_FALSE(grouped_rows_backward_pingpong_applies(a, a, nullptr, nullptr, 8, 512, 1020, out));
  EXPECT_FALSE(
      grouped_rows_backward_pingpong_applies(a, misaligned, nullptr, nullptr, 8, 512, 1024, out));
  EXPECT_FALSE(
      grouped_rows_backward_pingpong_applies(nullptr, a, nullptr, nullptr, 8, 512, 1024, out));
  // The GLU epilogue takes one product with bf16 out.
  cuda::GluKernelParams act;
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_backward_pingpong(
                   a, a, nullptr, nullptr, offsets, 1, 8, 512, 1024, out, /*y_f32=*/true, a,
                   operand, &act, nullptr),
               Error);
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_backward_pingpong(
                   a, a, a, a, offsets, 1, 8, 512, 1024, out, false, a, operand, &act, nullptr),
               Error);
  // Forward: K, N multiples of 8 and aligned A, W, Y; the GLU kernel also W_up and the outputs.
  EXPECT_THROW(cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(a, a, offsets, 1, 8, 516,
                                                                      1024, operand, nullptr),
               Error);
  EXPECT_FALSE(cuda::moe_detail::grouped_gate_up_glu_pingpong_applies(a, a, misaligned, 512, 1024,
                                                                      nullptr, nullptr, operand));
  EXPECT_TRUE(cuda::moe_detail::grouped_gate_up_glu_pingpong_applies(a, a, a, 512, 1024, nullptr,
                                                                     nullptr, operand));
}

// The pingpong weight gradient (launch_grouped_weight_grad_pingpong) bitwise against the TMA-fed
// kernel, storing (C from NaN) and accumulating (C from random values), where each CTA walks
// more than two tiles: 7 experts of 3001, 0, 5999, 130, 5870, 1 and 4999 rows (an empty expert,
// last steps of 1 … 63 rows, which read the next expert's rows into k lines that must be zeroed),
// M = 1032 and N = 520 (partial tiles at both edges; 315 tiles).
TEST(CudaMoeExperts, PingpongWeightGradMatchesTmaAcrossManyTiles) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t R = 20000, M = 1032, N = 520;
  const int E = 7;
  const std::vector<int64_t> offsets = {0, 3001, 3001, 9000, 9130, 15000, 15001, 20000};
  const Bf16Host a = random_bf16(size_t(R * M), 421);
  const Bf16Host b = random_bf16(size_t(R * N), 422);
  cuda::DeviceArena arena(size_t(256) << 20);
  const uint16_t* a_dev = upload(arena, a.bits);
  const uint16_t* b_dev = upload(arena, b.bits);
  const int64_t* offsets_dev = upload(arena, offsets);
  const size_t out = size_t(E * M * N);
  const std::vector<float> start = test::random_normal(out, 423);
  const bool tma_before = cuda::moe_wgmma_tma(), pingpong_before = cuda::moe_wgmma_pingpong();
  cuda::moe_set_wgmma_tma(true);
  cuda::moe_set_wgmma_pingpong(false);  // launch_grouped_weight_grad_wgmma: the TMA-fed kernel
  for (bool store : {true, false}) {
    SCOPED_TRACE(str_cat("store=", store));
    std::vector<std::vector<float>> c(2);
    for (int kernel = 0; kernel < 2; ++kernel) {
      float* c_dev = test::mla::alloc_poisoned<float>(arena, out);
      if (!store) cuda::copy_to_device(c_dev, start.data(), out * sizeof(float));
      ASSERT_TRUE(cuda::moe_detail::grouped_weight_grad_pingpong_applies(a_dev, M, b_dev, N, R, M,
                                                                         N, c_dev));
      if (kernel == 0)
        cuda::moe_detail::launch_grouped_weight_grad_wgmma(a_dev, M, b_dev, N, offsets_dev, E, R, M,
                                                           N, c_dev, nullptr, store);
      else
        cuda::moe_detail::launch_grouped_weight_grad_pingpong(a_dev, M, b_dev, N, offsets_dev, E, R,
                                                              M, N, c_dev, nullptr, store);
      cuda::synchronize();
      c[size_t(kernel)] = download(c_dev, out);
    }
    ASSERT_TRUE(test::mla::all_finite(c[1]));
    size_t differing = 0;
    for (size_t i = 0; i < out; ++i) differing += c[1][i] != c[0][i];
    EXPECT_EQ(differing, 0u) << "of " << out << " gradients";
    // The empty expert's block: zeros (store) or untouched.
    for (int64_t i = M * N; i < 2 * M * N; ++i)
      ASSERT_EQ(c[1][size_t(i)], store ? 0.0f : start[size_t(i)]);
    // Spot checks against a double-precision sum: expert 3's (130 rows) corners.
    for (int64_t m : {int64_t(0), M - 1})
      for (int64_t n : {int64_t(0), N - 1}) {
        double sum = store ? 0.0 : double(start[size_t((3 * M + m) * N + n)]);
        for (int64_t r = offsets[3]; r < offsets[4]; ++r)
          sum += double(a.values[size_t(r * M + m)]) * double(b.values[size_t(r * N + n)]);
        EXPECT_NEAR(c[1][size_t((3 * M + m) * N + n)], sum, 1e-3 * (1.0 + std::fabs(sum)));
      }
  }
  cuda::moe_set_wgmma_tma(tma_before);
  cuda::moe_set_wgmma_pingpong(pingpong_before);
}

// The backward's row products on the pingpong kernel (launch_grouped_rows_backward_pingpong)
// bitwise against the TMA-fed kernels where each CTA walks several tiles: dx (two products, fp32),
// dh (bf16) and dh with the GLU backward (dg, du), over the experts of the weight-gradient test
// above (the empty one's matrices NaN: the 3-D maps never read past an expert's own), K = 520
// (a k tail of 8), N = 264 (a partial column tile).
TEST(CudaMoeExperts, PingpongRowsBackwardMatchesTmaAcrossManyTiles) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t R = 20000, K = 520, N = 264;
  const int E = 7;
  const std::vector<int64_t> offsets = {0, 3001, 3001, 9000, 9130, 15000, 15001, 20000};
  const Bf16Host a1 = random_bf16(size_t(R * K), 431), a2 = random_bf16(size_t(R * K), 432);
  Bf16Host b1 = random_bf16(size_t(E * K * N), 433, 1.0f / std::sqrt(float(K)));
  Bf16Host b2 = random_bf16(size_t(E * K * N), 434, 1.0f / std::sqrt(float(K)));
  for (int64_t i = K * N; i < 2 * K * N; ++i) b1.bits[size_t(i)] = b2.bits[size_t(i)] = 0x7fc0;
  const Bf16Host g = random_bf16(size_t(R * N), 435), u = random_bf16(size_t(R * N), 436);
  cuda::DeviceArena arena(size_t(256) << 20);
  const uint16_t* a1_dev = upload(arena, a1.bits);
  const uint16_t* a2_dev = upload(arena, a2.bits);
  const uint16_t* b1_dev = upload(arena, b1.bits);
  const uint16_t* b2_dev = upload(arena, b2.bits);
  const uint16_t* g_dev = upload(arena, g.bits);
  const int64_t* offsets_dev = upload(arena, offsets);
  const size_t out = size_t(R * N);
  cuda::GluKernelParams act;
  act.situ = true;
  const bool tma_before = cuda::moe_wgmma_tma(), pingpong_before = cuda::moe_wgmma_pingpong();
  cuda::moe_set_wgmma_tma(true);
  cuda::moe_set_wgmma_pingpong(false);  // the wgmma launchers: the TMA-fed kernel
  auto differing = [&](const auto& x, const auto& ref) {
    size_t n = 0;
    for (size_t i = 0; i < out; ++i) n += x[i] != ref[i];
    return n;
  };
  // dx
  float* dx_tma = test::mla::alloc_poisoned<float>(arena, out);
  float* dx_pp = test::mla::alloc_poisoned<float>(arena, out);
  ASSERT_TRUE(cuda::moe_detail::grouped_rows_backward_pingpong_applies(a1_dev, b1_dev, a2_dev,
                                                                       b2_dev, R, K, N, dx_pp));
  cuda::moe_detail::launch_grouped_rows_f32_wgmma(a1_dev, b1_dev, a2_dev, b2_dev, offsets_dev, E, R,
                                                  K, N, dx_tma, nullptr);
  cuda::moe_detail::launch_grouped_rows_backward_pingpong(a1_dev, b1_dev, a2_dev, b2_dev,
                                                          offsets_dev, E, R, K, N, dx_pp, true,
                                                          nullptr, nullptr, nullptr, nullptr);
  // dh, and dh with the GLU backward (du over a copy of u each)
  uint16_t* dh_tma = test::mla::alloc_poisoned<uint16_t>(arena, out);
  uint16_t* dh_pp = test::mla::alloc_poisoned<uint16_t>(arena, out);
  cuda::moe_detail::launch_grouped_rows_bf16_wgmma(a1_dev, b1_dev, offsets_dev, E, R, K, N, dh_tma,
                                                   nullptr);
  cuda::moe_detail::launch_grouped_rows_backward_pingpong(a1_dev, b1_dev, nullptr, nullptr,
                                                          offsets_dev, E, R, K, N, dh_pp, false,
                                                          nullptr, nullptr, nullptr, nullptr);
  uint16_t* dg_tma = test::mla::alloc_poisoned<uint16_t>(arena, out);
  uint16_t* dg_pp = test::mla::alloc_poisoned<uint16_t>(arena, out);
  uint16_t* du_tma = upload(arena, u.bits);
  uint16_t* du_pp = upload(arena, u.bits);
  cuda::moe_detail::launch_grouped_rows_glu_backward_wgmma(a1_dev, b1_dev, offsets_dev, E, R, K, N,
                                                           g_dev, du_tma, dg_tma, act, nullptr);
  cuda::moe_detail::launch_grouped_rows_backward_pingpong(a1_dev, b1_dev, nullptr, nullptr,
                                                          offsets_dev, E, R, K, N, dg_pp, false,
                                                          g_dev, du_pp, &act, nullptr);
  cuda::synchronize();
  const std::vector<float> dx_ref = download(dx_tma, out), dx = download(dx_pp, out);
  ASSERT_TRUE(test::mla::all_finite(dx));
  EXPECT_EQ(differing(dx, dx_ref), 0u) << "dx";
  EXPECT_EQ(differing(download(dh_pp, out), download(dh_tma, out)), 0u) << "dh";
  EXPECT_EQ(differing(download(dg_pp, out), download(dg_tma, out)), 0u) << "dg";
  EXPECT_EQ(differing(download(du_pp, out), download(du_tma, out)), 0u) << "du";
  // A spot check of dx against a double-precision sum: expert 3's last row, last column.
  {
    const int64_t r = offsets[4] - 1, n = N - 1;
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k)
      sum += double(a1.values[size_t(r * K + k)]) * double(b1.values[size_t((3 * K + k) * N + n)]) +
             double(a2.values[size_t(r * K + k)]) * double(b2.values[size_t((3 * K + k) * N + n)]);
    EXPECT_NEAR(dx[size_t(r * N + n)], sum, 1e-3 * (1.0 + std::fabs(sum)));
  }
  cuda::moe_set_wgmma_tma(tma_before);
  cuda::moe_set_wgmma_pingpong(pingpong_before);
}

// Every version of the kernel: mma.sync (DM_MOE_WGMMA=0), warpgroup MMA (the default), its
// overlapped schedule (DM_MOE_WGMMA_OVERLAP=1), its output straight from the fragments
// (DM_MOE_WGMMA_STAGED=0), the gate and up products with the GLU apart (DM_MOE_GLU_FUSED=0;
// fused, F = 136 is two 64-column tiles and a partial one of 8) and those on 128 × 256 tiles
// (DM_MOE_WGMMA_WIDE=1), each through the inference
// forward (h over g) and the training one (g and u kept beside h).
TEST(CudaMoeExperts, GroupedOwnMatchesLoopAcrossTiles) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  ExpertsCase c(300, 8, 200, 136, 4, /*used=*/6, 91);  // experts 6, 7 get no token
  c.poison_expert(6);  // expert 5's last column tile (F = 136) reaches into expert 6's rows
  c.poison_expert(7);
  GluActivation act;
  act.kind = Activation::SiTU;
  const std::vector<float> loop = c.gpu(act, cuda::MoeGemmPath::Loop);
  const std::vector<float> y_ref = c.reference(act);
  const bool wgmma_before = cuda::moe_grouped_wgmma(), overlap_before = cuda::moe_wgmma_overlap();
  const bool staged_before = cuda::moe_wgmma_staged_output();
  const bool fused_before = cuda::moe_wgmma_fused_glu();
  std::vector<float> fused, separate;
  const bool wide_before = cuda::moe_wgmma_wide();
  const bool tma_before = cuda::moe_wgmma_tma();
  // mma.sync, wgmma (fused GLU), wgmma overlapped, wgmma unstaged, wgmma with the GLU apart,
  // wgmma with the GLU apart on 128 × 256 tiles, TMA-fed on 128 × 128 and on 128 × 256 tiles,
  // the pingpong kernel with the GLU apart and in its epilogue
  const bool pingpong_before = cuda::moe_wgmma_pingpong();
  const bool pingpong_glu_before = cuda::moe_wgmma_pingpong_glu();
  for (int variant : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(str_cat("variant=", variant, " recompute=", recompute));
      cuda::moe_set_grouped_wgmma(variant > 0);
      cuda::moe_set_wgmma_overlap(variant == 2);
      cuda::moe_set_wgmma_staged_output(variant != 3);
      cuda::moe_set_wgmma_fused_glu(variant < 4);
      cuda::moe_set_wgmma_wide(variant == 5 || variant == 7);
      cuda::moe_set_wgmma_tma(variant >= 6);
      cuda::moe_set_wgmma_pingpong(variant >= 8);
      cuda::moe_set_wgmma_pingpong_glu(variant == 9);
      std::vector<int64_t> offsets;
      const std::vector<float> own = c.gpu(act, cuda::MoeGemmPath::GroupedOwn, &offsets, recompute);
      ASSERT_GT(offsets[1] - offsets[0], 128);  // more than one row tile per expert
      ASSERT_EQ(offsets[8], offsets[6]);        // experts 6, 7 empty
      ASSERT_TRUE(test::mla::all_finite(own));
      EXPECT_LE(test::rel_rms(own.data(), loop.data(), own.size()), 5e-3);
      EXPECT_LE(test::rel_rms(own.data(), y_ref.data(), y_ref.size()), 1e-2);
      if (variant == 1 && !recompute) fused = own;
      if (variant == 4 && !recompute) separate = own;
      if (variant >= 5 && variant != 9 && !recompute)
        EXPECT_TRUE(own == separate) << "vs wgmma 128 x 128";
      if (variant == 9 && !recompute) EXPECT_TRUE(own == fused) << "vs the wgmma fused GLU";
      // Keeping g and u changes what is stored, not what is computed.
      if (variant == 1 && recompute) EXPECT_TRUE(own == fused) << "recompute vs forward";
    }
  // The fused epilogue rounds g and u to bf16 before the GLU as the separate pass reads them.
  const double fused_vs_separate = test::rel_rms(fused.data(), separate.data(), fused.size());
  std::printf("[CudaMoeExperts] fused GLU vs separate rel RMS %.3e (%s)\n", fused_vs_separate,
              fused == separate ? "bitwise equal" : "not bitwise equal");
  EXPECT_LE(fused_vs_separate, 1e-4);
  cuda::moe_set_grouped_wgmma(wgmma_before);
  cuda::moe_set_wgmma_overlap(overlap_before);
  cuda::moe_set_wgmma_staged_output(staged_before);
  cuda::moe_set_wgmma_fused_glu(fused_before);
  cuda::moe_set_wgmma_wide(wide_before);
  cuda::moe_set_wgmma_tma(tma_before);
  cuda::moe_set_wgmma_pingpong(pingpong_before);
  cuda::moe_set_wgmma_pingpong_glu(pingpong_glu_before);
}

// The few-rows kernel (launch_grouped_few_rows_nk_bf16), which GroupedOwn takes below
// kMoeFewRowsPerExpert rows per expert on average (the decoder's batches), with 1, 2 and 4 token
// groups per pass (by the mean rows per expert): experts of ~1 row (one partial group), of 40
// rows (several passes over the weights, the last partial), and empty ones; K tails (Din = 200 is 6
// steps of 32 + 8; F = 136 is 4 + 8) and a partial weight tile (N = 136 = 128 + 8 for gate/up).
// Against Loop (cuBLAS per expert) and the CPU reference.
TEST(CudaMoeExperts, GroupedOwnFewRowsMatchesLoop) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  for (auto [N, E, used] :
       {std::tuple<int64_t, int64_t, int>{8, 64, 60}, {60, 64, 6}, {120, 64, 12}}) {
    SCOPED_TRACE(str_cat("N=", N, " E=", E, " used=", used));
    const ExpertsCase c(N, E, 200, 136, 4, used, 93);
    ASSERT_LT(N * 4, cuda::kMoeFewRowsPerExpert * E);  // the few-rows kernel runs
    GluActivation act;
    act.kind = Activation::SiTU;
    std::vector<int64_t> offsets;
    const std::vector<float> own = c.gpu(act, cuda::MoeGemmPath::GroupedOwn, &offsets);
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e)
      most = std::max(most, offsets[size_t(e) + 1] - offsets[size_t(e)]);
    if (used != 60) EXPECT_GT(most, 32);  // several passes over an expert's weights
    const std::vector<float> loop = c.gpu(act, cuda::MoeGemmPath::Loop);
    const std::vector<float> y_ref = c.reference(act);
    ASSERT_TRUE(test::mla::all_finite(own));
    EXPECT_LE(test::rel_rms(own.data(), loop.data(), own.size()), 5e-3);
    EXPECT_LE(test::rel_rms(own.data(), y_ref.data(), y_ref.size()), 1e-2);
  }
}

// ---- QB statistics -----------------------------------------------------------------------------

TEST(CudaMoeBalance, HistogramMatchesCpuAndExactQuantile) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t N = 3000;
  const int E = 32, k = 4, bins = 1000;
  RouterParams p;
  p.num_experts = E;
  p.top_k = k;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(N * E)), bias(static_cast<size_t>(E));
  for (auto& x : logits) x = normal(rng);
  for (auto& x : bias) x = 0.2f * normal(rng);
  std::vector<float> scores(logits.size()), w(static_cast<size_t>(N * k)), cutoff(static_cast<size_t>(N));
  std::vector<int32_t> idx(static_cast<size_t>(N * k));
  moe_route<float>(logits.data(), bias.data(), N, p, scores.data(), idx.data(), w.data(),
                   cutoff.data());
  cutoff[5] = -INFINITY;  // a token without a finite cutoff is skipped by both

  const QbHistogramRange range = qb_histogram_range(bias.data(), E, bins);
  std::vector<int64_t> counts_cpu(static_cast<size_t>(E) * bins, 0);
  qb_histogram_accumulate(scores.data(), cutoff.data(), N, E, range, counts_cpu.data());
  std::vector<double> raw_hist_cpu(static_cast<size_t>(E)), raw_exact(static_cast<size_t>(E));
  qb_raw_bias_from_histogram(counts_cpu.data(), E, k, range, raw_hist_cpu.data());
  qb_raw_bias_exact(scores.data(), cutoff.data(), N, E, k, raw_exact.data());

  cuda::DeviceArena arena(size_t(8) << 20);
  const float* scores_dev = upload(arena, scores);
  const float* cutoff_dev = upload(arena, cutoff);
  int64_t* counts_dev = test::mla::alloc_zeroed<int64_t>(arena, counts_cpu.size());
  double* raw_dev = arena.alloc<double>(size_t(E));
  cuda::qb_histogram_accumulate(scores_dev, cutoff_dev, N, E, range, counts_dev);
  cuda::qb_raw_bias_from_histogram(counts_dev, E, k, range, raw_dev);
  cuda::synchronize();
  EXPECT_EQ(download(counts_dev, counts_cpu.size()), counts_cpu);
  const std::vector<double> raw_gpu = download(raw_dev, size_t(E));
  for (int j = 0; j < E; ++j) {
    EXPECT_NEAR(raw_gpu[size_t(j)], raw_hist_cpu[size_t(j)], 1e-12) << "expert " << j;
    EXPECT_LE(std::fabs(raw_gpu[size_t(j)] - raw_exact[size_t(j)]), range.bin_width())
        << "expert " << j;
  }

  // The one-call update equals the CPU update with the histogram estimator.
  BalanceOptions options;
  options.estimator = QuantileEstimator::Histogram;
  options.histogram_bins = bins;
  std::vector<float> bias_cpu = bias;
  quantile_balance_update(scores.data(), cutoff.data(), N, E, k, options, nullptr,
                          bias_cpu.data());
  float* bias_dev = upload(arena, bias);
  void* workspace = arena.alloc_bytes(cuda::quantile_balance_workspace_bytes(E, bins));
  cuda::quantile_balance_update_device(scores_dev, cutoff_dev, N, E, k, options, nullptr,
                                       bias_dev, workspace);
  const std::vector<float> bias_gpu = download(bias_dev, size_t(E));
  for (int j = 0; j < E; ++j) EXPECT_NEAR(bias_gpu[size_t(j)], bias_cpu[size_t(j)], 1e-6);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaGemm, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
