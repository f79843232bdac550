// The KDA short conv + SiLU on the GPU (ops/cuda/short_conv.cu) against the double CPU reference
// (ops/cpu/kda_prep.h short_conv_silu_forward / _backward) on the same bf16 inputs:
//   forward y (bf16) and backward dx (bf16): relative RMS ≤ 1e-2 (bf16 output rounding);
//   dw (fp32, accumulated onto a nonzero start): relative RMS ≤ 1e-5;
//   dy is left untouched (read only).
// Shapes walk every edge of the run layout (16 tokens per thread, 8 in the 2-channel backward; 32
// lanes per block): T below, at and past one run, C not a multiple of 32, channel counts that take
// the wide kernels (forward 4 channels a thread when C % 4 == 0, backward 2 when C is even) and
// the one-channel ones, every tap count 1…8, packed documents whose starts fall inside the conv
// window and on run edges, B = 2 rows, and a taller grid with several runs per thread in the
// backward. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/kda_layer_ops.h"
#include "cuda_test_util.h"
#include "test_util.h"

namespace dm {
namespace {

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

double rel_rms_vs(const std::vector<float>& got, const std::vector<double>& want) {
  return test::rel_rms(to_double(got).data(), want.data(), want.size());
}

void run_conv_case(int64_t B, int64_t T, int64_t C, int Kc, bool packed) {
  const std::string name = "B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" +
                           std::to_string(C) + " Kc=" + std::to_string(Kc) +
                           (packed ? " packed" : "");
  SCOPED_TRACE(name);
  const int64_t N = B * T;
  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * C), 11 + Kc));
  const std::vector<float> w = test::random_normal(size_t(C * Kc), 13 + Kc, 0.5f);
  const std::vector<float> dy = test::random_normal(size_t(N * C), 17 + Kc);
  const std::vector<float> dw0 = test::random_normal(size_t(C * Kc), 19 + Kc);
  std::vector<int32_t> doc_start;
  if (packed)
    doc_start = test::packed_documents(
        B, T, {{1, 2, 16, 17, int32_t(T / 2)}, {int32_t(T - 1), 5, 32, 33}});
  const int32_t* docs_host = packed ? doc_start.data() : nullptr;

  // CPU reference in double.
  const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  std::vector<double> y_ref(size_t(N * C)), dx_ref(size_t(N * C), 0.0), dw_ref = to_double(dw0);
  short_conv_silu_forward<double>(xd.data(), wd.data(), nullptr, y_ref.data(), B, T, C, Kc,
                                  docs_host);
  short_conv_silu_backward<double>(xd.data(), wd.data(), nullptr, dyd.data(), dx_ref.data(),
                                   dw_ref.data(), B, T, C, Kc, docs_host);

  test::DeviceScratch dev(size_t(N * C) * 12 + size_t(C * Kc) * 8 +
                          cuda::kda_short_conv_silu_backward_partial_floats(N, C, Kc) * 4 +
                          size_t(N) * 4 + 8192);
  const uint16_t* x_d = dev.upload(test::to_bf16(x));
  const float* w_d = dev.upload(w);
  const float* dy_d = dev.upload(dy);
  float* dw_d = dev.upload(dw0);
  const int32_t* docs_d = packed ? dev.upload(doc_start) : nullptr;
  uint16_t* y_d = dev.zeros<uint16_t>(size_t(N * C));
  uint16_t* dx_d = dev.zeros<uint16_t>(size_t(N * C));
  float* partial =
      dev.zeros<float>(cuda::kda_short_conv_silu_backward_partial_floats(N, C, Kc));
  cuda::kda_short_conv_silu_forward(x_d, w_d, y_d, B, T, C, Kc, docs_d);
  cuda::kda_short_conv_silu_backward(x_d, w_d, dy_d, dx_d, dw_d, partial, B, T, C, Kc, docs_d);

  const std::vector<float> y = test::from_bf16(test::DeviceScratch::download(y_d, size_t(N * C)));
  const std::vector<float> dx =
      test::from_bf16(test::DeviceScratch::download(dx_d, size_t(N * C)));
  const std::vector<float> dw = test::DeviceScratch::download(dw_d, size_t(C * Kc));
  const std::vector<float> dy_after = test::DeviceScratch::download(dy_d, size_t(N * C));
  ASSERT_TRUE(test::all_finite(y) && test::all_finite(dx) && test::all_finite(dw));
  EXPECT_LE(rel_rms_vs(y, y_ref), 1e-2);
  EXPECT_LE(rel_rms_vs(dx, dx_ref), 1e-2);
  EXPECT_LE(rel_rms_vs(dw, dw_ref), 1e-5);
  EXPECT_EQ(dy_after, dy);
}

TEST(CudaShortConv, MatchesCpuAcrossRunAndChannelEdges) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {1, 3, 15, 16, 17, 47})
    for (int64_t C : {5, 64, 70}) run_conv_case(2, T, C, 4, false);
}

TEST(CudaShortConv, EveryTapCount) {
  DM_SKIP_WITHOUT_GPU();
  for (int Kc = 1; Kc <= 8; ++Kc) run_conv_case(2, 37, 40, Kc, false);
}

TEST(CudaShortConv, PackedDocuments) {
  DM_SKIP_WITHOUT_GPU();
  for (int Kc : {1, 3, 4, 8}) {
    run_conv_case(2, 70, 36, Kc, true);  // forward 4 and backward 2 channels a thread
    run_conv_case(2, 70, 37, Kc, true);  // one channel a thread both ways
  }
}

TEST(CudaShortConv, SeveralRunsPerThread) {
  DM_SKIP_WITHOUT_GPU();
  // N = 2·33000 rows: 4126 runs, more than the backward's 256 block rows × 8 runs per pass.
  run_conv_case(2, 33000, 34, 4, true);
}

// dx written as a column block of a wider matrix (row stride ld_dx: the KDA backward's fused
// q/k/v input-gradient product): the same bits as the contiguous dx in its block, nothing written
// outside it, for the two-channel (even C, even stride) and one-channel (odd stride) kernels.
TEST(CudaShortConv, StridedDxMatchesContiguous) {
  DM_SKIP_WITHOUT_GPU();
  for (const int64_t C : {64, 37})
    for (const int64_t ld : {3 * C + 6, 3 * C + 1}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " ld=" + std::to_string(ld));
      const int64_t B = 2, T = 70, N = B * T, col = C + 2;  // the block starts at column C + 2
      const int Kc = 4;
      const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * C), 5));
      const std::vector<float> w = test::random_normal(size_t(C * Kc), 6, 0.5f);
      const std::vector<float> dy = test::random_normal(size_t(N * C), 7);
      const std::vector<int32_t> doc_start = test::packed_documents(B, T, {{1, 17}, {33}});
      const size_t partial_floats = cuda::kda_short_conv_silu_backward_partial_floats(N, C, Kc);
      test::DeviceScratch dev(size_t(N * C) * 8 + size_t(N * ld) * 2 + size_t(C * Kc) * 12 +
                              partial_floats * 4 + size_t(N) * 4 + 8192);
      const uint16_t* x_d = dev.upload(test::to_bf16(x));
      const float* w_d = dev.upload(w);
      const float* dy_d = dev.upload(dy);
      const int32_t* docs_d = dev.upload(doc_start);
      float* dw_a = dev.zeros<float>(size_t(C * Kc));
      float* dw_b = dev.zeros<float>(size_t(C * Kc));
      float* partial = dev.zeros<float>(partial_floats);
      uint16_t* dx_d = dev.zeros<uint16_t>(size_t(N * C));
      const uint16_t kUntouched = 0x7777;
      uint16_t* wide_d = dev.upload(std::vector<uint16_t>(size_t(N * ld), kUntouched));
      cuda::kda_short_conv_silu_backward(x_d, w_d, dy_d, dx_d, dw_a, partial, B, T, C, Kc, docs_d);
      cuda::kda_short_conv_silu_backward(x_d, w_d, dy_d, wide_d + col, dw_b, partial, B, T, C, Kc,
                                         docs_d, nullptr, ld);
      const auto dx = test::DeviceScratch::download(dx_d, size_t(N * C));
      const auto wide = test::DeviceScratch::download(wide_d, size_t(N * ld));
      int64_t mismatches = 0, outside = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < ld; ++j) {
          const uint16_t got = wide[size_t(n * ld + j)];
          if (j >= col && j < col + C)
            mismatches += got != dx[size_t(n * C + j - col)];
          else
            outside += got != kUntouched;
        }
      EXPECT_EQ(mismatches, 0);
      EXPECT_EQ(outside, 0);
      // dw: the same bits when both calls take the same kernel; an odd stride takes the
      // one-channel kernel, whose runs (and so dw's partial sums) are shorter.
      const auto dw_contiguous = test::DeviceScratch::download(dw_a, size_t(C * Kc));
      const auto dw_strided = test::DeviceScratch::download(dw_b, size_t(C * Kc));
      if (ld % 2 == 0 || C % 2 != 0)
        EXPECT_EQ(dw_strided, dw_contiguous);
      else
        EXPECT_LE(test::rel_rms(dw_strided.data(), dw_contiguous.data(), dw_contiguous.size()),
                  1e-6);
    }
}

// The row strides of the KDA backward's column-block writers are checked on the host before any
// launch (runs without a GPU).
TEST(CudaShortConv, BadRowStridesAreClearErrors) {
  EXPECT_THROW(cuda::kda_short_conv_silu_backward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                  nullptr, 1, 4, 8, 4, nullptr, nullptr,
                                                  /*ld_dx=*/4),
               Error);  // a row stride below C
  EXPECT_THROW(cuda::kda_beta_sigmoid_backward(nullptr, nullptr, nullptr, 10, nullptr,
                                               /*width=*/4, /*ld_dz=*/8),
               Error);  // 10 values are not rows of 4
}

TEST(CudaShortConv, TooManyTapsIsAClearError) {
  DM_SKIP_WITHOUT_GPU();
  test::DeviceScratch dev(4096);
  uint16_t* x = dev.zeros<uint16_t>(16);
  float* w = dev.zeros<float>(16);
  EXPECT_THROW(cuda::kda_short_conv_silu_forward(x, w, x + 8, 1, 1, 1, 9, nullptr), Error);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaShortConv, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
