// CUDA element/norm/loss/optimizer ops (ops/cuda/elementwise.h) against the CPU references
// (ops/cpu/rmsnorm.h, ffn.h, loss.h, the AdamW rule of train/optimizer.cpp), fp32 and bf16
// storage, on ragged shapes. fp32 paths: relative RMS error ≤ 1e-5; bf16 paths: the CPU op run in
// fp32 on the bf16-rounded inputs, compared with the GPU's bf16 outputs, ≤ 1e-2. Without a GPU
// every test skips (GTEST_SKIP), so CI only checks that this compiles.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_test_util.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/loss.h"
#include "ops/cpu/rmsnorm.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe_layer_ops.h"
#include "ops/cuda/residual_ops.h"
#include "ops/cuda/zero_ranges.h"
#include "test_util.h"

namespace {

namespace cu = dm::cuda;

using dm::test::all_finite;
using dm::test::DeviceScratch;
using dm::test::from_bf16;
using dm::test::random_normal;
using dm::test::round_bf16;
using dm::test::to_bf16;

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return dm::test::rel_rms(a.data(), b.data(), a.size());
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct RmsnormCase {
  int64_t N, D;
};
// D % 4 == 0 (300, 1000, 2048, 4100) takes the fp32 backward's 16-byte kernel: under one quad a
// thread, two (the gpu_1b width), and a tail pass over part of the block.
const RmsnormCase kRmsnormCases[] = {{1, 1},    {3, 7},    {5, 300},   {65, 1000},
                                     {4, 2048}, {2, 4100}, {300, 4099}};

TEST(CudaOpsRmsnorm, ForwardBackwardF32MatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const RmsnormCase& c : kRmsnormCases) {
    const size_t nd = size_t(c.N * c.D);
    const std::vector<float> x = random_normal(nd, 1 + uint64_t(c.D)), dy = random_normal(nd, 2);
    std::vector<float> w = random_normal(size_t(c.D), 3, 0.5f);
    for (float& e : w) e += 1.0f;
    const std::vector<float> dx0 = random_normal(nd, 4), dw0 = random_normal(size_t(c.D), 5);
    const double eps = 1e-5;

    std::vector<float> y_ref(nd), dx_ref = dx0, dw_ref = dw0;
    dm::rmsnorm_forward(x.data(), w.data(), y_ref.data(), c.N, c.D, eps);
    dm::rmsnorm_backward(x.data(), w.data(), dy.data(), dx_ref.data(), dw_ref.data(), c.N, c.D, eps);

    DeviceScratch dev(8 * nd * 4 + 64 * size_t(c.D) * 4 + cu::rmsnorm_backward_workspace_bytes(c.N, c.D) + (1 << 16));
    float* x_d = dev.upload(x);
    float* w_d = dev.upload(w);
    float* dy_d = dev.upload(dy);
    float* y_d = dev.zeros<float>(nd);
    float* dx_d = dev.upload(dx0);
    float* dw_d = dev.upload(dw0);
    void* ws = dev.raw(cu::rmsnorm_backward_workspace_bytes(c.N, c.D));
    cu::rmsnorm_forward(x_d, w_d, y_d, c.N, c.D, eps);
    cu::rmsnorm_backward(x_d, w_d, dy_d, dx_d, dw_d, c.N, c.D, eps, ws);
    const auto y = DeviceScratch::download(y_d, nd);
    const auto dx = DeviceScratch::download(dx_d, nd);
    const auto dw = DeviceScratch::download(dw_d, size_t(c.D));
    EXPECT_TRUE(all_finite(y) && all_finite(dx) && all_finite(dw));
    EXPECT_LE(rel_rms(y, y_ref), 1e-5) << "N=" << c.N << " D=" << c.D;
    EXPECT_LE(rel_rms(dx, dx_ref), 1e-5) << "N=" << c.N << " D=" << c.D;
    EXPECT_LE(rel_rms(dw, dw_ref), 1e-5) << "N=" << c.N << " D=" << c.D;

    // Stored dx (accumulate_dx = false): the gradient alone over whatever dx held; dw still
    // accumulates.
    std::vector<float> dx_alone(nd, 0.0f), dw_twice = dw_ref;
    dm::rmsnorm_backward(x.data(), w.data(), dy.data(), dx_alone.data(), dw_twice.data(), c.N, c.D,
                         eps);
    cu::rmsnorm_backward(x_d, w_d, dy_d, dx_d, dw_d, c.N, c.D, eps, ws, nullptr,
                         /*accumulate_dx=*/false);
    EXPECT_LE(rel_rms(DeviceScratch::download(dx_d, nd), dx_alone), 1e-5) << "N=" << c.N;
    EXPECT_LE(rel_rms(DeviceScratch::download(dw_d, size_t(c.D)), dw_twice), 1e-5) << "N=" << c.N;

    // In place (y aliases x).
    cu::rmsnorm_forward(x_d, w_d, x_d, c.N, c.D, eps);
    EXPECT_LE(rel_rms(DeviceScratch::download(x_d, nd), y_ref), 1e-5);
  }
}

TEST(CudaOpsRmsnorm, ForwardBackwardBf16MatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const RmsnormCase& c : kRmsnormCases) {
    const size_t nd = size_t(c.N * c.D);
    const std::vector<float> x = round_bf16(random_normal(nd, 11 + uint64_t(c.D)));
    const std::vector<float> dy = round_bf16(random_normal(nd, 12));
    std::vector<float> w = random_normal(size_t(c.D), 13, 0.5f);
    for (float& e : w) e += 1.0f;
    w = round_bf16(w);
    const std::vector<float> dx0 = round_bf16(random_normal(nd, 14));
    const std::vector<float> dw0 = random_normal(size_t(c.D), 15);
    const double eps = 1e-6;

    std::vector<float> y_ref(nd), dx_ref = dx0, dw_ref = dw0;
    dm::rmsnorm_forward(x.data(), w.data(), y_ref.data(), c.N, c.D, eps);
    dm::rmsnorm_backward(x.data(), w.data(), dy.data(), dx_ref.data(), dw_ref.data(), c.N, c.D, eps);

    DeviceScratch dev(8 * nd * 2 + 4 * size_t(c.D) * 4 + cu::rmsnorm_backward_workspace_bytes(c.N, c.D) + (1 << 16));
    uint16_t* x_d = dev.upload(to_bf16(x));
    uint16_t* w_d = dev.upload(to_bf16(w));
    uint16_t* dy_d = dev.upload(to_bf16(dy));
    uint16_t* y_d = dev.zeros<uint16_t>(nd);
    uint16_t* dx_d = dev.upload(to_bf16(dx0));
    float* dw_d = dev.upload(dw0);
    void* ws = dev.raw(cu::rmsnorm_backward_workspace_bytes(c.N, c.D));
    cu::rmsnorm_forward(x_d, w_d, y_d, c.N, c.D, eps);
    cu::rmsnorm_backward(x_d, w_d, dy_d, dx_d, dw_d, c.N, c.D, eps, ws);
    const auto y = from_bf16(DeviceScratch::download(y_d, nd));
    const auto dx = from_bf16(DeviceScratch::download(dx_d, nd));
    const auto dw = DeviceScratch::download(dw_d, size_t(c.D));
    EXPECT_TRUE(all_finite(y) && all_finite(dx) && all_finite(dw));
    EXPECT_LE(rel_rms(y, y_ref), 1e-2) << "N=" << c.N << " D=" << c.D;
    EXPECT_LE(rel_rms(dx, dx_ref), 1e-2) << "N=" << c.N << " D=" << c.D;
    EXPECT_LE(rel_rms(dw, dw_ref), 1e-4) << "N=" << c.N << " D=" << c.D;  // fp32 output
  }
}

// The residual stream's fp32 → bf16 norm (residual_ops.h): the float4 kernel (D % 4 == 0 and
// D ≤ 4096, the model widths) and the scalar one (the rest), against the CPU norm in fp32.
TEST(CudaOpsRmsnorm, ToBf16MatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const RmsnormCase& c : {RmsnormCase{1, 7}, RmsnormCase{1, 2304}, RmsnormCase{3, 4096},
                               RmsnormCase{5, 4100}, RmsnormCase{4, 300}, RmsnormCase{2, 1028}}) {
    const size_t nd = size_t(c.N * c.D);
    const std::vector<float> x = random_normal(nd, 31 + uint64_t(c.D));
    std::vector<float> w = random_normal(size_t(c.D), 32, 0.5f);
    for (float& e : w) e += 1.0f;
    const float eps = 1e-5f;
    std::vector<float> y_ref(nd);
    dm::rmsnorm_forward(x.data(), w.data(), y_ref.data(), c.N, c.D, double(eps));
    DeviceScratch dev(nd * 8 + size_t(c.D) * 4 + (1 << 16));
    const float* x_d = dev.upload(x);
    const float* w_d = dev.upload(w);
    uint16_t* y_d = dev.zeros<uint16_t>(nd);
    cu::rmsnorm_to_bf16(x_d, w_d, y_d, c.N, c.D, eps, nullptr);
    const auto y = from_bf16(DeviceScratch::download(y_d, nd));
    EXPECT_TRUE(all_finite(y));
    EXPECT_LE(rel_rms(y, y_ref), 1e-2) << "N=" << c.N << " D=" << c.D;
    // bf16 rounding of each element is at most 2^-9 relative: a wrong element would show.
    double worst = 0.0;
    for (size_t i = 0; i < nd; ++i)
      worst = std::max(worst, std::abs(double(y[i]) - y_ref[i]) / (std::abs(y_ref[i]) + 1e-3));
    EXPECT_LE(worst, 5e-3) << "N=" << c.N << " D=" << c.D;
  }
}

// The residual walk's fused add + norm equals add_inplace then rmsnorm_to_bf16 bit for bit
// (same arithmetic), on the float4 path and the two-kernel fallback (D % 4 != 0).
TEST(CudaOpsRmsnorm, FusedAddNormEqualsAddThenNorm) {
  DM_SKIP_WITHOUT_GPU();
  for (const RmsnormCase& c : {RmsnormCase{1, 2304}, RmsnormCase{3, 4096}, RmsnormCase{2, 300},
                               RmsnormCase{4, 1001}}) {
    const size_t nd = size_t(c.N * c.D);
    const std::vector<float> p0 = random_normal(nd, 41 + uint64_t(c.D)),
                             out = random_normal(nd, 42);
    std::vector<float> w = random_normal(size_t(c.D), 43, 0.5f);
    for (float& e : w) e += 1.0f;
    DeviceScratch dev(nd * 20 + size_t(c.D) * 4 + (1 << 16));
    float* p_fused = dev.upload(p0);
    float* p_plain = dev.upload(p0);
    const float* out_d = dev.upload(out);
    const float* w_d = dev.upload(w);
    uint16_t* y_fused = dev.zeros<uint16_t>(nd);
    uint16_t* y_plain = dev.zeros<uint16_t>(nd);
    cu::add_rmsnorm_to_bf16(p_fused, out_d, w_d, y_fused, c.N, c.D, 1e-5f, nullptr);
    cu::add_inplace(p_plain, out_d, int64_t(nd), nullptr);
    cu::rmsnorm_to_bf16(p_plain, w_d, y_plain, c.N, c.D, 1e-5f, nullptr);
    EXPECT_EQ(DeviceScratch::download(p_fused, nd), DeviceScratch::download(p_plain, nd))
        << "N=" << c.N << " D=" << c.D;
    EXPECT_EQ(DeviceScratch::download(y_fused, nd), DeviceScratch::download(y_plain, nd))
        << "N=" << c.N << " D=" << c.D;
    std::vector<float> sum(nd);
    for (size_t i = 0; i < nd; ++i) sum[i] = p0[i] + out[i];
    EXPECT_EQ(DeviceScratch::download(p_fused, nd), sum) << "N=" << c.N << " D=" << c.D;
  }
}

// add_inplace and convert_f32_to_bf16 on their float4 paths (n % 4 == 0, aligned) and on the
// scalar ones (odd n, or pointers one float off 16 bytes): exact against the host.
TEST(CudaOpsElementwise, AddInplaceAndBf16ConvertOnBothPaths) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t(1000), int64_t(1001), int64_t(262144)})
    for (size_t offset : {size_t(0), size_t(1)}) {
      const std::vector<float> a = random_normal(size_t(n), 51), b = random_normal(size_t(n), 52);
      DeviceScratch dev(size_t(n) * 12 + (1 << 16));
      float* a_d = dev.upload(std::vector<float>(size_t(n) + offset)) + offset;
      float* b_d = dev.upload(std::vector<float>(size_t(n) + offset)) + offset;
      dm::cuda::copy_to_device(a_d, a.data(), size_t(n) * 4);
      dm::cuda::copy_to_device(b_d, b.data(), size_t(n) * 4);
      uint16_t* y_d = dev.zeros<uint16_t>(size_t(n) + offset) + offset;
      cu::add_inplace(a_d, b_d, n, nullptr);
      cu::convert_f32_to_bf16(a_d, y_d, n, nullptr);
      std::vector<float> sum(static_cast<size_t>(n));
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + b[i];
      EXPECT_EQ(DeviceScratch::download(a_d, size_t(n)), sum) << "n=" << n << " offset=" << offset;
      EXPECT_EQ(DeviceScratch::download(y_d, size_t(n)), to_bf16(sum))
          << "n=" << n << " offset=" << offset;
    }
}

// convert_f32_to_bf16_rows into a column block of wider rows: the float4 path (width and row
// stride multiples of 4) and the scalar one (width 6), exact against the host, the other columns
// untouched.
TEST(CudaOpsElementwise, Bf16ConvertIntoColumnBlock) {
  DM_SKIP_WITHOUT_GPU();
  for (const int64_t width : {int64_t(32), int64_t(6)}) {
    const int64_t rows = 101, ld = width + 12, col = 8;
    const std::vector<float> x = random_normal(size_t(rows * width), 55);
    DeviceScratch dev(size_t(rows * ld) * 2 + size_t(rows * width) * 4 + (1 << 16));
    const float* x_d = dev.upload(x);
    const uint16_t kUntouched = 0x1234;
    uint16_t* y_d = dev.upload(std::vector<uint16_t>(size_t(rows * ld), kUntouched));
    cu::convert_f32_to_bf16_rows(x_d, y_d + col, rows, width, ld, nullptr);
    const auto y = DeviceScratch::download(y_d, size_t(rows * ld));
    const auto want = to_bf16(x);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < ld; ++j) {
        const bool inside = j >= col && j < col + width;
        bad += y[size_t(r * ld + j)] != (inside ? want[size_t(r * width + j - col)] : kUntouched);
      }
    EXPECT_EQ(bad, 0) << "width " << width;
  }
}

// add (dst = a + b) out of place and with dst aliasing b, on the float4 path and the scalar one
// (odd n, or one pointer a float off 16 bytes): exact against the host.
TEST(CudaOpsElementwise, AddOutOfPlaceAndAliased) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t(1000), int64_t(1001), int64_t(262144)})
    for (size_t offset : {size_t(0), size_t(1)}) {
      const std::vector<float> a = random_normal(size_t(n), 53), b = random_normal(size_t(n), 54);
      DeviceScratch dev(size_t(n) * 16 + (1 << 16));
      const float* a_d = dev.upload(a);
      float* b_d = dev.upload(b);
      float* out_d = dev.zeros<float>(size_t(n) + offset) + offset;
      std::vector<float> sum(static_cast<size_t>(n));
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + b[i];
      cu::add(out_d, a_d, b_d, n, nullptr);
      EXPECT_EQ(DeviceScratch::download(out_d, size_t(n)), sum)
          << "n=" << n << " offset=" << offset;
      EXPECT_EQ(DeviceScratch::download(b_d, size_t(n)), b);  // inputs untouched
      cu::add(b_d, a_d, b_d, n, nullptr);                     // dst = b
      EXPECT_EQ(DeviceScratch::download(b_d, size_t(n)), sum) << "n=" << n;
    }
}

TEST(CudaOpsRmsnorm, RejectsBadShape) {
  DM_SKIP_WITHOUT_GPU();
  EXPECT_THROW(cu::rmsnorm_forward(static_cast<const float*>(nullptr), nullptr, nullptr, 4, 0, 1e-5),
               dm::Error);
  EXPECT_THROW(cu::rmsnorm_backward(static_cast<const float*>(nullptr), nullptr, nullptr, nullptr,
                                    nullptr, 4, 8, 1e-5, nullptr),
               dm::Error);  // missing workspace
}

// ---------------------------------------------------------------------------------------------
// GLU

std::vector<dm::GluActivation> glu_kinds() {
  dm::GluActivation swiglu, situ;
  swiglu.kind = dm::Activation::SwiGLU;
  situ.kind = dm::Activation::SiTU;
  return {swiglu, situ};
}

TEST(CudaOpsGlu, ForwardBackwardMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(300001)}) {
    // Wide inputs so SiTU's tanh saturation and σ's tails are exercised.
    const std::vector<float> g = random_normal(size_t(n), 21, 6.0f);
    const std::vector<float> u = random_normal(size_t(n), 22, 30.0f);
    const std::vector<float> dh = random_normal(size_t(n), 23);
    for (const dm::GluActivation& a : glu_kinds()) {
      const char* name = a.kind == dm::Activation::SiTU ? "SiTU" : "SwiGLU";
      // fp32
      const size_t count = static_cast<size_t>(n);
      std::vector<float> h_ref(count), dg_ref(count), du_ref(count);
      dm::glu_forward(g.data(), u.data(), h_ref.data(), n, a);
      dm::glu_backward(g.data(), u.data(), dh.data(), dg_ref.data(), du_ref.data(), n, a);
      DeviceScratch dev(size_t(n) * 4 * 12 + (1 << 16));
      float* g_d = dev.upload(g);
      float* u_d = dev.upload(u);
      float* dh_d = dev.upload(dh);
      float* h_d = dev.zeros<float>(size_t(n));
      float* dg_d = dev.zeros<float>(size_t(n));
      float* du_d = dev.zeros<float>(size_t(n));
      cu::glu_forward(g_d, u_d, h_d, n, a);
      cu::glu_backward(g_d, u_d, dh_d, dg_d, du_d, n, a);
      const auto h = DeviceScratch::download(h_d, size_t(n));
      const auto dg = DeviceScratch::download(dg_d, size_t(n));
      const auto du = DeviceScratch::download(du_d, size_t(n));
      EXPECT_TRUE(all_finite(h) && all_finite(dg) && all_finite(du)) << name;
      EXPECT_LE(rel_rms(h, h_ref), 1e-5) << name << " n=" << n;
      EXPECT_LE(rel_rms(dg, dg_ref), 1e-5) << name << " n=" << n;
      EXPECT_LE(rel_rms(du, du_ref), 1e-5) << name << " n=" << n;

      // bf16 storage, CPU reference on the rounded inputs.
      const std::vector<float> g16 = round_bf16(g), u16 = round_bf16(u), dh16 = round_bf16(dh);
      dm::glu_forward(g16.data(), u16.data(), h_ref.data(), n, a);
      dm::glu_backward(g16.data(), u16.data(), dh16.data(), dg_ref.data(), du_ref.data(), n, a);
      uint16_t* g_b = dev.upload(to_bf16(g16));
      uint16_t* u_b = dev.upload(to_bf16(u16));
      uint16_t* dh_b = dev.upload(to_bf16(dh16));
      uint16_t* h_b = dev.zeros<uint16_t>(size_t(n));
      uint16_t* dg_b = dev.zeros<uint16_t>(size_t(n));
      uint16_t* du_b = dev.zeros<uint16_t>(size_t(n));
      cu::glu_forward(g_b, u_b, h_b, n, a);
      cu::glu_backward(g_b, u_b, dh_b, dg_b, du_b, n, a);
      EXPECT_LE(rel_rms(from_bf16(DeviceScratch::download(h_b, size_t(n))), h_ref), 1e-2) << name;
      EXPECT_LE(rel_rms(from_bf16(DeviceScratch::download(dg_b, size_t(n))), dg_ref), 1e-2) << name;
      EXPECT_LE(rel_rms(from_bf16(DeviceScratch::download(du_b, size_t(n))), du_ref), 1e-2) << name;
      // bf16 in place (n = 1000 takes the 8-wide kernel, the others the scalar one).
      cu::glu_backward(g_b, u_b, dh_b, dh_b, u_b, n, a);
      EXPECT_LE(rel_rms(from_bf16(DeviceScratch::download(dh_b, size_t(n))), dg_ref), 1e-2) << name;
      EXPECT_LE(rel_rms(from_bf16(DeviceScratch::download(u_b, size_t(n))), du_ref), 1e-2) << name;

      // In place: dg overwrites dh, du overwrites u (allowed by the contract).
      cu::glu_backward(g_d, u_d, dh_d, dh_d, u_d, n, a);
      dm::glu_backward(g.data(), u.data(), dh.data(), dg_ref.data(), du_ref.data(), n, a);
      EXPECT_LE(rel_rms(DeviceScratch::download(dh_d, size_t(n)), dg_ref), 1e-5) << name;
      EXPECT_LE(rel_rms(DeviceScratch::download(u_d, size_t(n)), du_ref), 1e-5) << name;
    }
  }
}

// g and u as the two halves of [rows, 2F] rows (GluRows, the gated FFNs' one gate/up GEMM): h
// and, in place over g | u, dg | du give the bits of the contiguous operands. F = 64 takes the
// 8-wide kernels, F = 12 the scalar ones. h written as a column block of wider rows (h_ld, the
// MoE's joint output operand) holds the same bits, the columns past F untouched.
TEST(CudaOpsGlu, RowsLayoutMatchesContiguous) {
  DM_SKIP_WITHOUT_GPU();
  for (const int64_t F : {int64_t(64), int64_t(12)}) {
    const int64_t rows = 37, n = rows * F;
    const std::vector<float> g = round_bf16(random_normal(size_t(n), 41, 6.0f));
    const std::vector<float> u = round_bf16(random_normal(size_t(n), 42, 30.0f));
    const std::vector<float> dh = round_bf16(random_normal(size_t(n), 43));
    std::vector<float> gu(size_t(2 * n));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < F; ++j) {
        gu[size_t(r * 2 * F + j)] = g[size_t(r * F + j)];
        gu[size_t(r * 2 * F + F + j)] = u[size_t(r * F + j)];
      }
    for (const dm::GluActivation& a : glu_kinds()) {
      SCOPED_TRACE(std::to_string(F) + (a.kind == dm::Activation::SiTU ? " SiTU" : " SwiGLU"));
      DeviceScratch dev(size_t(n) * 2 * 16 + (1 << 16));
      const uint16_t* g_b = dev.upload(to_bf16(g));
      const uint16_t* u_b = dev.upload(to_bf16(u));
      const uint16_t* dh_b = dev.upload(to_bf16(dh));
      uint16_t* gu_b = dev.upload(to_bf16(gu));
      uint16_t* h_flat = dev.zeros<uint16_t>(size_t(n));
      uint16_t* h_rows = dev.zeros<uint16_t>(size_t(n));
      uint16_t* dg_flat = dev.zeros<uint16_t>(size_t(n));
      uint16_t* du_flat = dev.zeros<uint16_t>(size_t(n));
      const cu::GluRows layout{F, 2 * F};
      cu::glu_forward(g_b, u_b, h_flat, n, a);
      cu::glu_forward(gu_b, gu_b + F, h_rows, n, a, nullptr, layout);
      cu::glu_backward(g_b, u_b, dh_b, dg_flat, du_flat, n, a);
      const int64_t h_ld = F + (F % 8 == 0 ? 16 : 8);
      uint16_t* h_wide = dev.zeros<uint16_t>(size_t(rows * h_ld));
      const int64_t h_col = F % 8 == 0 ? 0 : 5;  // the scalar kernel at an odd column offset
      cu::glu_forward(gu_b, gu_b + F, h_wide + h_col, n, a, nullptr, cu::GluRows{F, 2 * F, h_ld});
      // dg | du into other rows (d_ld, the MoE backward's joint operand), before the in-place
      // call below overwrites g | u.
      const int64_t d_ld = 2 * F + (F % 8 == 0 ? 24 : 5);
      uint16_t* dgu_wide = dev.zeros<uint16_t>(size_t(rows * d_ld));
      cu::glu_backward(gu_b, gu_b + F, dh_b, dgu_wide, dgu_wide + F, n, a, nullptr,
                       cu::GluRows{F, 2 * F, 0, d_ld});
      cu::glu_backward(gu_b, gu_b + F, dh_b, gu_b, gu_b + F, n, a, nullptr, layout);
      const auto dgu_block = DeviceScratch::download(dgu_wide, size_t(rows * d_ld));
      const auto h_ref = DeviceScratch::download(h_flat, size_t(n));
      EXPECT_EQ(DeviceScratch::download(h_rows, size_t(n)), h_ref);
      const auto h_block = DeviceScratch::download(h_wide, size_t(rows * h_ld));
      int64_t h_mismatches = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < h_ld; ++j) {
          const bool in_block = j >= h_col && j < h_col + F;
          const uint16_t want = in_block ? h_ref[size_t(r * F + j - h_col)] : uint16_t(0);
          h_mismatches += h_block[size_t(r * h_ld + j)] != want;
        }
      EXPECT_EQ(h_mismatches, 0);
      const auto dgu = DeviceScratch::download(gu_b, size_t(2 * n));
      const auto dg = DeviceScratch::download(dg_flat, size_t(n));
      const auto du = DeviceScratch::download(du_flat, size_t(n));
      int64_t mismatches = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < F; ++j)
          mismatches += (dgu[size_t(r * 2 * F + j)] != dg[size_t(r * F + j)]) +
                        (dgu[size_t(r * 2 * F + F + j)] != du[size_t(r * F + j)]) +
                        (dgu_block[size_t(r * d_ld + j)] != dg[size_t(r * F + j)]) +
                        (dgu_block[size_t(r * d_ld + F + j)] != du[size_t(r * F + j)]);
      for (int64_t r = 0; r < rows; ++r)  // the columns past 2F untouched
        for (int64_t j = 2 * F; j < d_ld; ++j) mismatches += dgu_block[size_t(r * d_ld + j)] != 0;
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// The row-stride arguments of the column-block writers are checked on the host before any launch
// (this runs without a GPU): values that are not whole rows, a stride below the width.
TEST(CudaOpsRowStrides, BadStridesAreClearErrors) {
  uint16_t* y = nullptr;
  const std::string glu = dm::test::error_message([&] {
    cu::glu_forward(static_cast<const uint16_t*>(nullptr), nullptr, y, 10, glu_kinds()[0], nullptr,
                    cu::GluRows{4, 8});
  });
  EXPECT_NE(glu.find("cuda glu_forward: bad rows (n=10, width=4, ld=8)"), std::string::npos) << glu;
  const std::string glu_back = dm::test::error_message([&] {
    cu::glu_backward(static_cast<const uint16_t*>(nullptr), nullptr, nullptr, y, y, 16,
                     glu_kinds()[1], nullptr, cu::GluRows{8, 4});
  });
  EXPECT_NE(glu_back.find("cuda glu_backward: bad rows"), std::string::npos) << glu_back;
  const std::string h_rows = dm::test::error_message([&] {
    cu::glu_forward(static_cast<const uint16_t*>(nullptr), nullptr, y, 16, glu_kinds()[0], nullptr,
                    cu::GluRows{8, 16, 4});
  });
  EXPECT_NE(h_rows.find("cuda glu_forward: bad h rows (width=8, h_ld=4)"), std::string::npos)
      << h_rows;
  const std::string convert =
      dm::test::error_message([&] { cu::convert_f32_to_bf16_rows(nullptr, y, 3, 8, 7, nullptr); });
  EXPECT_NE(convert.find("convert_f32_to_bf16_rows: bad shape rows=3 width=8 ld=7"),
            std::string::npos)
      << convert;
}

TEST(CudaOpsGlu, RejectsBadSituBeta) {
  DM_SKIP_WITHOUT_GPU();
  dm::GluActivation a;
  a.kind = dm::Activation::SiTU;
  a.beta1 = 0.0f;
  EXPECT_THROW(cu::glu_forward(static_cast<const float*>(nullptr), nullptr, nullptr, 4, a),
               dm::Error);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

template <typename Storage>
void check_cross_entropy(int64_t N, int64_t V, uint64_t seed, bool bf16) {
  std::vector<float> logits = random_normal(size_t(N * V), seed, 3.0f);
  if (bf16) logits = round_bf16(logits);
  std::mt19937_64 rng(seed + 1);
  std::vector<int64_t> targets(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t r = rng() % 10;
    // Mostly valid targets; some −1 (masked) and some ≥ V (treated as masked, like the CPU op).
    targets[size_t(n)] = r == 0 ? -1 : r == 1 && n > 0 ? V + 3 : int64_t(rng() % uint64_t(V));
  }
  // Make one row's target its argmax so `correct` is non-zero.
  if (N > 0 && targets[0] >= 0) {
    logits[size_t(targets[0])] = 50.0f;
  }
  const double scale = 1.0 / double(N);
  std::vector<float> dlogits_ref(size_t(N * V));
  const dm::CrossEntropyResult ref = dm::cross_entropy_forward_backward(
      logits.data(), targets.data(), dlogits_ref.data(), N, V, scale);

  DeviceScratch dev(size_t(N * V) * 10 + size_t(N) * 8 + cu::cross_entropy_workspace_bytes(N) +
                    (1 << 16));
  Storage* logits_d;
  if constexpr (sizeof(Storage) == 2) logits_d = dev.upload(to_bf16(logits));
  else logits_d = dev.upload(logits);
  Storage* dlogits_d = dev.zeros<Storage>(size_t(N * V));
  const int64_t* targets_d = dev.upload(targets);
  auto* result_d = static_cast<cu::CrossEntropyDeviceResult*>(dev.raw(sizeof(cu::CrossEntropyDeviceResult)));
  void* ws = dev.raw(cu::cross_entropy_workspace_bytes(N) + 8);
  cu::cross_entropy_forward_backward(logits_d, targets_d, dlogits_d, N, V, scale, result_d, ws);
  const auto result = DeviceScratch::download(result_d, 1)[0];
  std::vector<float> dlogits;
  if constexpr (sizeof(Storage) == 2) dlogits = from_bf16(DeviceScratch::download(dlogits_d, size_t(N * V)));
  else dlogits = DeviceScratch::download(dlogits_d, size_t(N * V));

  EXPECT_EQ(result.count, ref.count) << "N=" << N << " V=" << V;
  EXPECT_EQ(result.correct, ref.correct) << "N=" << N << " V=" << V;
  EXPECT_NEAR(result.loss_sum, ref.loss_sum, 1e-5 * std::max(1.0, std::fabs(ref.loss_sum)));
  EXPECT_TRUE(all_finite(dlogits));
  EXPECT_LE(rel_rms(dlogits, dlogits_ref), bf16 ? 1e-2 : 1e-5) << "N=" << N << " V=" << V;

  if constexpr (sizeof(Storage) == 4) {  // fp32 logits, bf16 gradient: the fp32 one rounded
    uint16_t* dlogits_b = dev.zeros<uint16_t>(size_t(N * V));
    cu::cross_entropy_forward_backward(logits_d, targets_d, dlogits_b, N, V, scale, result_d, ws);
    EXPECT_EQ(DeviceScratch::download(dlogits_b, size_t(N * V)), to_bf16(dlogits))
        << "N=" << N << " V=" << V;
    EXPECT_EQ(DeviceScratch::download(result_d, 1)[0].loss_sum, result.loss_sum);
  }
}

TEST(CudaOpsCrossEntropy, MatchesCpuF32) {
  DM_SKIP_WITHOUT_GPU();
  check_cross_entropy<float>(1, 1, 31, false);
  check_cross_entropy<float>(7, 33, 32, false);
  check_cross_entropy<float>(64, 5003, 33, false);
  check_cross_entropy<float>(3, 163840, 34, false);
  // V % 4 == 0 takes the float4 row kernel (the ones above with V odd the scalar one): a vocab
  // of the 1B config's size over rows with masked targets, and rows shorter than a block.
  check_cross_entropy<float>(300, 32000, 35, false);
  check_cross_entropy<float>(5, 8, 36, false);
}

// The scalar row kernel on the shapes the float4 one takes (DM_CROSS_ENTROPY_ROWS=scalar: its
// A/B reference), against the CPU too.
TEST(CudaOpsCrossEntropy, ScalarRowsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  const dm::test::ScopedEnv env("DM_CROSS_ENTROPY_ROWS", "scalar");
  check_cross_entropy<float>(300, 32000, 35, false);
  check_cross_entropy<float>(3, 163840, 34, false);
}

TEST(CudaOpsCrossEntropy, MatchesCpuBf16) {
  DM_SKIP_WITHOUT_GPU();
  check_cross_entropy<uint16_t>(7, 33, 42, true);
  check_cross_entropy<uint16_t>(64, 5003, 43, true);
}

TEST(CudaOpsCrossEntropy, AllRowsMaskedGivesZero) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t N = 5, V = 9;
  DeviceScratch dev(1 << 16);
  const float* logits_d = dev.upload(random_normal(size_t(N * V), 50));
  const int64_t* targets_d = dev.upload(std::vector<int64_t>(size_t(N), -1));
  float* dlogits_d = dev.upload(std::vector<float>(size_t(N * V), 7.0f));
  auto* result_d = static_cast<cu::CrossEntropyDeviceResult*>(dev.raw(sizeof(cu::CrossEntropyDeviceResult)));
  cu::cross_entropy_forward_backward(logits_d, targets_d, dlogits_d, N, V, 1.0, result_d,
                                     dev.raw(cu::cross_entropy_workspace_bytes(N)));
  const auto result = DeviceScratch::download(result_d, 1)[0];
  EXPECT_EQ(result.count, 0);
  EXPECT_EQ(result.loss_sum, 0.0);
  for (float e : DeviceScratch::download(dlogits_d, size_t(N * V))) EXPECT_EQ(e, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// AdamW

// The rule of Optimizer::adamw_update (train/optimizer.cpp), on host.
void adamw_reference(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m,
                     std::vector<float>& v, const cu::AdamWStep& s) {
  const float c1 = 1.0f - float(std::pow(double(s.beta1), double(s.step)));
  const float c2 = 1.0f - float(std::pow(double(s.beta2), double(s.step)));
  const float wd = s.decay ? s.lr * s.weight_decay : 0.0f;
  for (size_t i = 0; i < p.size(); ++i) {
    m[i] = s.beta1 * m[i] + (1 - s.beta1) * g[i];
    v[i] = s.beta2 * v[i] + (1 - s.beta2) * g[i] * g[i];
    const float mh = m[i] / c1, vh = v[i] / c2;
    p[i] -= s.lr * mh / (std::sqrt(vh) + s.eps) + wd * p[i];
  }
}

TEST(CudaOpsAdamW, MatchesCpuRuleOverSteps) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  for (bool bf16_grad : {false, true}) {
    for (bool decay : {true, false}) {
      std::vector<float> p = random_normal(size_t(n), 60), m(size_t(n), 0.0f), v(size_t(n), 0.0f);
      DeviceScratch dev(size_t(n) * 4 * 8 + (1 << 16));
      float* p_d = dev.upload(p);
      float* m_d = dev.upload(m);
      float* v_d = dev.upload(v);
      float* g_d = dev.zeros<float>(size_t(n));
      uint16_t* g16_d = dev.zeros<uint16_t>(size_t(n));
      uint16_t* p16_d = dev.zeros<uint16_t>(size_t(n));
      cu::AdamWStep s;
      s.lr = 1e-2f;
      s.decay = decay;
      for (int64_t step = 1; step <= 3; ++step) {
        s.step = step;
        std::vector<float> g = random_normal(size_t(n), 70 + uint64_t(step), 0.1f);
        if (bf16_grad) {
          g = round_bf16(g);
          cu::copy_to_device(g16_d, to_bf16(g).data(), size_t(n) * 2);
          cu::adamw_update(p_d, g16_d, m_d, v_d, p16_d, n, s);
        } else {
          cu::copy_to_device(g_d, g.data(), size_t(n) * 4);
          cu::adamw_update(p_d, g_d, m_d, v_d, p16_d, n, s);
        }
        adamw_reference(p, g, m, v, s);
      }
      const auto p_gpu = DeviceScratch::download(p_d, size_t(n));
      EXPECT_LE(rel_rms(p_gpu, p), 1e-6);
      EXPECT_LE(rel_rms(DeviceScratch::download(m_d, size_t(n)), m), 1e-6);
      EXPECT_LE(rel_rms(DeviceScratch::download(v_d, size_t(n)), v), 1e-6);
      // The bf16 copy is exactly the rounding of the fp32 master weights.
      const auto p16 = DeviceScratch::download(p16_d, size_t(n));
      int64_t mismatches = 0;
      for (int64_t i = 0; i < n; ++i) mismatches += p16[size_t(i)] != cu::float_to_bf16(p_gpu[size_t(i)]);
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// One launch over arena ranges (the GPU optimizer step) against adamw_update per range on the
// pre-scaled gradients: the same bits, and elements between the ranges untouched; the fp32
// mirrors receive exactly the updated master values of their elements inside the ranges.
TEST(CudaOpsAdamW, RangesMatchPerRangeUpdatesBitForBit) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  // Unaligned starts and ends, a gap of 4, a merged-looking pair with different decay flags, and
  // a range longer than one 16K tile.
  const std::vector<cu::AdamWRange> ranges = {{3, 40000, true}, {40000, 70001, false},
                                              {70005, 100000, true}};
  // Mirrors (given out of order): across the first range's start, across the boundary of two
  // ranges, over the gap into the third range, inside a 16K tile at an odd offset, past the end.
  const std::vector<cu::AdamWMirror> mirrors = {
      {39990, 40020, 50}, {0, 50, 0}, {69998, 70010, 80}, {20001, 20007, 92}, {99990, 100003, 98}};
  const int64_t mirror_floats = 111;
  const cu::AdamWRangePlan plan(ranges, mirrors);
  EXPECT_EQ(plan.elements(), 39997 + 30001 + 29995);
  std::vector<float> p = random_normal(size_t(n), 61), m(size_t(n), 0.0f), v(size_t(n), 0.0f);
  DeviceScratch dev(size_t(n) * 4 * 12 + (1 << 16));
  float* p_fused = dev.upload(p);
  float* m_fused = dev.upload(m);
  float* v_fused = dev.upload(v);
  uint16_t* p16_fused = dev.zeros<uint16_t>(size_t(n));
  float* p_each = dev.upload(p);
  float* m_each = dev.upload(m);
  float* v_each = dev.upload(v);
  uint16_t* p16_each = dev.zeros<uint16_t>(size_t(n));
  float* g_d = dev.zeros<float>(size_t(n));
  const float kUntouched = -7.0f;
  float* mirror_d = dev.upload(std::vector<float>(size_t(mirror_floats), kUntouched));
  std::vector<float> p_host = p, m_host = m, v_host = v;
  cu::AdamWStep s;
  s.lr = 1e-2f;
  for (int64_t step = 1; step <= 3; ++step) {
    s.step = step;
    const float grad_scale = step == 2 ? 0.37f : 1.0f;
    std::vector<float> g = random_normal(size_t(n), 80 + uint64_t(step), 0.1f);
    cu::copy_to_device(g_d, g.data(), size_t(n) * 4);
    cu::adamw_update_ranges(plan, p_fused, g_d, m_fused, v_fused, p16_fused, mirror_d, s,
                            grad_scale);
    std::vector<float> scaled = g;
    for (float& x : scaled) x *= grad_scale;
    cu::copy_to_device(g_d, scaled.data(), size_t(n) * 4);
    for (const cu::AdamWRange& r : ranges) {
      cu::AdamWStep sr = s;
      sr.decay = r.decay;
      cu::adamw_update(p_each + r.begin, g_d + r.begin, m_each + r.begin, v_each + r.begin,
                       p16_each + r.begin, r.end - r.begin, sr);
      std::vector<float> pr(p_host.begin() + r.begin, p_host.begin() + r.end);
      std::vector<float> gr(scaled.begin() + r.begin, scaled.begin() + r.end);
      std::vector<float> mr(m_host.begin() + r.begin, m_host.begin() + r.end);
      std::vector<float> vr(v_host.begin() + r.begin, v_host.begin() + r.end);
      adamw_reference(pr, gr, mr, vr, sr);
      std::copy(pr.begin(), pr.end(), p_host.begin() + r.begin);
      std::copy(mr.begin(), mr.end(), m_host.begin() + r.begin);
      std::copy(vr.begin(), vr.end(), v_host.begin() + r.begin);
    }
  }
  const auto p_gpu = DeviceScratch::download(p_fused, size_t(n));
  EXPECT_EQ(p_gpu, DeviceScratch::download(p_each, size_t(n)));
  EXPECT_EQ(DeviceScratch::download(m_fused, size_t(n)), DeviceScratch::download(m_each, size_t(n)));
  EXPECT_EQ(DeviceScratch::download(v_fused, size_t(n)), DeviceScratch::download(v_each, size_t(n)));
  EXPECT_EQ(DeviceScratch::download(p16_fused, size_t(n)),
            DeviceScratch::download(p16_each, size_t(n)));
  EXPECT_LE(rel_rms(p_gpu, p_host), 1e-6);
  // Between the ranges nothing moved (p keeps its start values, the bf16 copy stays zero).
  const auto p16 = DeviceScratch::download(p16_fused, size_t(n));
  for (int64_t i : {0, 1, 2, 70001, 70002, 70003, 70004, 100000, 100001, 100002}) {
    EXPECT_EQ(p_gpu[size_t(i)], p[size_t(i)]) << i;
    EXPECT_EQ(p16[size_t(i)], 0) << i;
  }
  const auto mirror = DeviceScratch::download(mirror_d, size_t(mirror_floats));
  auto in_ranges = [&](int64_t i) {
    for (const cu::AdamWRange& r : ranges)
      if (i >= r.begin && i < r.end) return true;
    return false;
  };
  int64_t checked = 0;
  for (const cu::AdamWMirror& mr : mirrors)
    for (int64_t i = mr.begin; i < mr.end; ++i) {
      const float expect = in_ranges(i) ? p_gpu[size_t(i)] : kUntouched;
      EXPECT_EQ(mirror[size_t(mr.packed + i - mr.begin)], expect) << "element " << i;
      checked += in_ranges(i);
    }
  EXPECT_EQ(checked, 47 + 30 + 8 + 6 + 10);
}

TEST(CudaOpsAdamW, RejectsStepZero) {
  DM_SKIP_WITHOUT_GPU();
  cu::AdamWStep s;
  s.step = 0;
  EXPECT_THROW(cu::adamw_update(nullptr, static_cast<const float*>(nullptr), nullptr, nullptr,
                                nullptr, 4, s),
               dm::Error);
}

// One launch over many ranges (the gradient arena's step start): exactly the ranges' elements
// become zero, at unaligned bounds, across 64K tiles, with empty ranges and a one-element one.
TEST(CudaOpsZeroRanges, ZeroesExactlyTheRanges) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t n = 300007;
  const std::vector<cu::ZeroRange> ranges = {{0, 1},       {3, 3},           {5, 70},
                                             {71, 200001}, {200002, 200003}, {250001, 300006}};
  const cu::ZeroRangesPlan plan(ranges);
  EXPECT_EQ(plan.elements(), 1 + 65 + 199930 + 1 + 50005);
  EXPECT_EQ(plan.tiles(), 1 + 1 + 4 + 1 + 1);  // 199930 elements take four 64K tiles
  std::vector<float> x = random_normal(size_t(n), 91);
  for (float& v : x) v = std::fabs(v) + 1.0f;  // never 0 before
  DeviceScratch dev(size_t(n) * 4 + (1 << 16));
  float* x_d = dev.upload(x);
  cu::zero_ranges(plan, x_d + 1);  // an array that starts 4 bytes past a 16-byte boundary
  const auto got = DeviceScratch::download(x_d, size_t(n));
  std::vector<float> want = x;
  for (const cu::ZeroRange& r : ranges)
    for (int64_t i = r.begin; i < r.end; ++i) want[size_t(i + 1)] = 0.0f;
  EXPECT_EQ(got, want);
}

}  // namespace
#else
TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
