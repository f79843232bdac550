// The vector paths of the GPU layer element kernels (several elements per thread in one 8- or
// 16-byte load), each against what it replaced:
//   KDA gated RMSNorm, forward and backward (kda_layer_ops.h, kda_layer_backward_ops.h): the
//     vec4 kernels (D = 128, 256, every tensor aligned) and the one-element kernels (D = 64, or
//     tensors one element off alignment) against the CPU double reference (ops/cpu/norm_gated.h)
//     on the same bf16 inputs: bf16 outputs relative RMS ≤ 1e-2, dw (fp32, accumulated onto a
//     nonzero start) ≤ 1e-5;
//   MLA key/value assembly, its transpose and the output gate's three kernels (mla_layer_ops.h):
//     the grouped kernels (aligned tensors) against the one-element kernels (the same inputs one
//     element off alignment), bit for bit: both compute each element with the same fp32 ops.
//   KDA decay gate, forward and backward: the four-channel kernels against the CPU and, for the
//     parameter gradients, bit for bit against the one-channel kernels;
// The short conv's wide kernels are covered by test_cuda_short_conv.cpp (channel counts that
// take either width). Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_test_util.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cpu/norm_gated.h"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/mla_layer_ops.h"
#include "test_util.h"

namespace dm {
namespace {

using test::DeviceScratch;

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// `host` uploaded `offset` elements past an aligned allocation (offset 1: every vector path off).
template <typename T>
T* upload_at(DeviceScratch& dev, const std::vector<T>& host, size_t offset) {
  std::vector<T> padded(offset, T(0));
  padded.insert(padded.end(), host.begin(), host.end());
  return dev.upload(padded) + offset;
}
template <typename T>
T* zeros_at(DeviceScratch& dev, size_t n, size_t offset) {
  return dev.zeros<T>(n + offset) + offset;
}

void run_gated_norm_case(int64_t rows, int64_t D, size_t offset) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " D=" + std::to_string(D) +
               " offset=" + std::to_string(offset));
  const size_t n = size_t(rows * D);
  const float eps = 1e-5f;
  const std::vector<float> x = test::round_bf16(test::random_normal(n, 31 + uint64_t(D)));
  const std::vector<float> gate = test::round_bf16(test::random_normal(n, 32, 2.0f));
  const std::vector<float> w = test::random_normal(size_t(D), 33, 0.5f);
  const std::vector<float> dy = test::random_normal(n, 34);
  const std::vector<float> dw0 = test::random_normal(size_t(D), 35);

  const std::vector<double> xd = to_double(x), gd = to_double(gate), wd = to_double(w),
                            dyd = to_double(dy);
  std::vector<double> y_ref(n), dx_ref(n, 0.0), dgate_ref(n, 0.0), dw_ref = to_double(dw0);
  rmsnorm_gated_forward<double>(xd.data(), wd.data(), gd.data(), y_ref.data(), rows, D, eps);
  rmsnorm_gated_backward<double>(xd.data(), wd.data(), gd.data(), dyd.data(), dx_ref.data(),
                                 dw_ref.data(), dgate_ref.data(), rows, D, eps);

  DeviceScratch dev(n * 16 + size_t(D) * 8 +
                    cuda::kda_rmsnorm_gated_backward_partial_floats(rows, D) * 4 + 65536);
  const uint16_t* x_d = upload_at(dev, test::to_bf16(x), offset);
  const uint16_t* gate_d = upload_at(dev, test::to_bf16(gate), offset);
  const float* w_d = dev.upload(w);
  const float* dy_d = upload_at(dev, dy, offset);
  float* dw_d = dev.upload(dw0);
  uint16_t* y_d = zeros_at<uint16_t>(dev, n, offset);
  uint16_t* dx_d = zeros_at<uint16_t>(dev, n, offset);
  uint16_t* dgate_d = zeros_at<uint16_t>(dev, n, offset);
  float* partial = dev.zeros<float>(cuda::kda_rmsnorm_gated_backward_partial_floats(rows, D));
  cuda::kda_rmsnorm_gated_forward(x_d, w_d, gate_d, y_d, rows, D, eps);
  cuda::kda_rmsnorm_gated_backward(x_d, w_d, gate_d, dy_d, dx_d, dgate_d, dw_d, partial, rows, D,
                                   eps);

  const auto y = test::from_bf16(DeviceScratch::download(y_d, n));
  const auto dx = test::from_bf16(DeviceScratch::download(dx_d, n));
  const auto dgate = test::from_bf16(DeviceScratch::download(dgate_d, n));
  const auto dw = DeviceScratch::download(dw_d, size_t(D));
  ASSERT_TRUE(test::all_finite(y) && test::all_finite(dx) && test::all_finite(dgate) &&
              test::all_finite(dw));
  EXPECT_LE(test::rel_rms(to_double(y).data(), y_ref.data(), n), 1e-2);
  EXPECT_LE(test::rel_rms(to_double(dx).data(), dx_ref.data(), n), 1e-2);
  EXPECT_LE(test::rel_rms(to_double(dgate).data(), dgate_ref.data(), n), 1e-2);
  EXPECT_LE(test::rel_rms(to_double(dw).data(), dw_ref.data(), size_t(D)), 1e-5);
}

// The KDA decay gate, forward and backward, bf16 f: the four-channel kernels (K % 4 == 0, every
// tensor aligned) and the one-channel kernels (the same at offset 1, and K = 30) against the CPU
// (ops/cpu/kda_prep.h, float, the same bf16 inputs): g and df relative RMS ≤ 1e-2 (bf16),
// dA_log and ddt_bias (fp32, accumulated onto a nonzero start) ≤ 1e-5; and the four-channel
// backward's parameter gradients equal the one-channel kernel's bit for bit (same row order).
void run_gate_case(int64_t N, int64_t H, int64_t K, bool safe, size_t offset,
                   std::vector<float>* dparams_out = nullptr) {
  SCOPED_TRACE("N=" + std::to_string(N) + " H=" + std::to_string(H) + " K=" + std::to_string(K) +
               (safe ? " safe" : " softplus") + " offset=" + std::to_string(offset));
  const size_t n = size_t(N * H * K), hk = size_t(H * K);
  const float lower_bound = -5.0f;
  const KdaGateKind kind = safe ? KdaGateKind::Safe : KdaGateKind::Softplus;
  const std::vector<float> f = test::round_bf16(test::random_normal(n, 41, 6.0f));
  const std::vector<float> A_log = test::random_normal(size_t(H), 42, 0.5f);
  const std::vector<float> dt_bias = test::random_normal(hk, 43);
  const std::vector<float> dg = test::random_normal(n, 44);
  const std::vector<float> dA0 = test::random_normal(size_t(H), 45),
                           db0 = test::random_normal(hk, 46);
  std::vector<float> g_ref(n), df_ref(n, 0.0f), dA_ref = dA0, db_ref = db0;
  kda_gate_forward<float>(f.data(), A_log.data(), dt_bias.data(), g_ref.data(), N, H, K, kind,
                          lower_bound);
  kda_gate_backward<float>(f.data(), A_log.data(), dt_bias.data(), dg.data(), df_ref.data(),
                           dA_ref.data(), db_ref.data(), N, H, K, kind, lower_bound);

  DeviceScratch dev(n * 12 + hk * 16 + cuda::kda_gate_backward_partial_floats(N, H, K) * 4 + 65536);
  const uint16_t* f_d = upload_at(dev, test::to_bf16(f), offset);
  const float* A_d = dev.upload(A_log);
  const float* b_d = upload_at(dev, dt_bias, offset);
  const float* dg_d = upload_at(dev, dg, offset);
  float* dA_d = dev.upload(dA0);
  float* db_d = dev.upload(db0);
  uint16_t* g_d = zeros_at<uint16_t>(dev, n, offset);
  uint16_t* df_d = zeros_at<uint16_t>(dev, n, offset);
  float* partial = dev.zeros<float>(cuda::kda_gate_backward_partial_floats(N, H, K));
  cuda::kda_gate_forward(f_d, A_d, b_d, g_d, N, H, K, safe, lower_bound);
  cuda::kda_gate_backward(f_d, A_d, b_d, dg_d, df_d, dA_d, db_d, partial, N, H, K, safe,
                          lower_bound);
  const auto g = test::from_bf16(DeviceScratch::download(g_d, n));
  const auto df = test::from_bf16(DeviceScratch::download(df_d, n));
  const auto dA = DeviceScratch::download(dA_d, size_t(H));
  const auto db = DeviceScratch::download(db_d, hk);
  ASSERT_TRUE(test::all_finite(g) && test::all_finite(df) && test::all_finite(dA) &&
              test::all_finite(db));
  EXPECT_LE(test::rel_rms(g.data(), g_ref.data(), n), 1e-2);
  EXPECT_LE(test::rel_rms(df.data(), df_ref.data(), n), 1e-2);
  EXPECT_LE(test::rel_rms(dA.data(), dA_ref.data(), size_t(H)), 1e-5);
  EXPECT_LE(test::rel_rms(db.data(), db_ref.data(), hk), 1e-5);
  if (dparams_out) {
    *dparams_out = dA;
    dparams_out->insert(dparams_out->end(), db.begin(), db.end());
  }
}

TEST(CudaLayerOpsVectors, KdaGateMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const bool safe : {false, true}) {
    std::vector<float> vec4, scalar;
    run_gate_case(300, 4, 128, safe, 0, &vec4);
    run_gate_case(300, 4, 128, safe, 1, &scalar);
    EXPECT_EQ(vec4, scalar) << "four-channel and one-channel parameter gradients differ";
    run_gate_case(37, 3, 30, safe, 0);    // K % 4 ≠ 0: one channel a thread
    run_gate_case(5000, 2, 64, safe, 0);  // several rows a thread
  }
}

TEST(CudaLayerOpsVectors, GatedNormMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const int64_t rows : {int64_t(1), int64_t(37), int64_t(300)}) {
    run_gated_norm_case(rows, 128, 0);  // vec4, one chunk a lane
    run_gated_norm_case(rows, 256, 0);  // vec4, two chunks
    run_gated_norm_case(rows, 128, 1);  // one element a lane: misaligned
    run_gated_norm_case(rows, 64, 0);   // one element a lane: D not a multiple of 128
  }
}

// dgate as a column block of wider token rows (the layer's joint input-gradient operand: H heads
// of D a token, rows dgate_ld apart): the same bits as the contiguous dgate, the other columns
// untouched. D = 128 takes the vec4 kernel (ld a multiple of 4), D = 64 the one-element one.
TEST(CudaLayerOpsVectors, GatedNormDgateColumnBlock) {
  DM_SKIP_WITHOUT_GPU();
  for (const auto& [D, extra] : {std::pair<int64_t, int64_t>{128, 8}, {64, 3}}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const int64_t tokens = 37, H = 3, rows = tokens * H, width = H * D, ld = width + extra;
    const size_t n = size_t(rows * D);
    const std::vector<float> x = test::round_bf16(test::random_normal(n, 51));
    const std::vector<float> gate = test::round_bf16(test::random_normal(n, 52, 2.0f));
    const std::vector<float> w = test::random_normal(size_t(D), 53, 0.5f);
    const std::vector<float> dy = test::random_normal(n, 54);
    DeviceScratch dev(n * 24 + size_t(tokens * ld) * 2 +
                      cuda::kda_rmsnorm_gated_backward_partial_floats(rows, D) * 4 + 65536);
    const uint16_t* x_d = dev.upload(test::to_bf16(x));
    const uint16_t* gate_d = dev.upload(test::to_bf16(gate));
    const float* w_d = dev.upload(w);
    const float* dy_d = dev.upload(dy);
    float* dw_d = dev.zeros<float>(size_t(D));
    uint16_t* dx_d = dev.zeros<uint16_t>(n);
    uint16_t* dgate_flat = dev.zeros<uint16_t>(n);
    uint16_t* dgate_block = dev.zeros<uint16_t>(size_t(tokens * ld));
    float* partial = dev.zeros<float>(cuda::kda_rmsnorm_gated_backward_partial_floats(rows, D));
    cuda::kda_rmsnorm_gated_backward(x_d, w_d, gate_d, dy_d, dx_d, dgate_flat, dw_d, partial, rows,
                                     D, 1e-5f);
    cuda::kda_rmsnorm_gated_backward(x_d, w_d, gate_d, dy_d, dx_d, dgate_block, dw_d, partial, rows,
                                     D, 1e-5f, nullptr, width, ld);
    const auto flat = DeviceScratch::download(dgate_flat, n);
    const auto block = DeviceScratch::download(dgate_block, size_t(tokens * ld));
    int64_t mismatches = 0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < ld; ++j)
        mismatches += block[size_t(t * ld + j)] != (j < width ? flat[size_t(t * width + j)] : 0);
    EXPECT_EQ(mismatches, 0);
  }
  const std::string bad = test::error_message([] {
    cuda::kda_rmsnorm_gated_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                     nullptr, 6, 128, 1e-5f, nullptr, 200, 256);
  });
  EXPECT_NE(bad.find("cuda kda_rmsnorm_gated_backward: bad dgate rows (width=200"),
            std::string::npos)
      << bad;
}

// The MLA element kernels on aligned tensors and on the same data one element off: bit for bit.
struct MlaOutputs {
  std::vector<uint16_t> k, v, d_kv, d_kv_a, gated, gated_into, dg, d_o;
};

struct MlaCase {
  int64_t B, T, H, nope, rope, dv, kvl;
  bool use_rope, packed;
};

MlaOutputs run_mla_ops(const MlaCase& c, size_t offset) {
  const int64_t N = c.B * c.T, dq = c.nope + c.rope, kv_width = c.nope + c.dv;
  const int64_t a_width = c.kvl + c.rope, half = c.rope / 2;
  const size_t kv_n = size_t(N * c.H * kv_width), k_n = size_t(N * c.H * dq),
               v_n = size_t(N * c.H * c.dv), a_n = size_t(N * a_width);
  const std::vector<uint16_t> kv = test::to_bf16(test::random_normal(kv_n, 41));
  const std::vector<float> kv_a = test::random_normal(a_n, 42);
  const std::vector<float> cos = test::random_normal(size_t(c.T * half), 43);
  const std::vector<float> sin = test::random_normal(size_t(c.T * half), 44);
  std::vector<int32_t> doc_start;
  if (c.packed) doc_start = test::packed_documents(c.B, c.T, {{3}, {1, int32_t(c.T / 2)}});
  const std::vector<uint16_t> dk = test::to_bf16(test::random_normal(k_n, 45));
  const std::vector<uint16_t> dv = test::to_bf16(test::random_normal(v_n, 46));
  const std::vector<uint16_t> g = test::to_bf16(test::random_normal(v_n, 47, 3.0f));
  const std::vector<float> d_out = test::random_normal(v_n, 48);

  DeviceScratch dev((kv_n + k_n * 3 + v_n * 12 + a_n * 3) * 4 + 65536);
  const uint16_t* kv_d = upload_at(dev, kv, offset);
  const float* kv_a_d = dev.upload(kv_a);
  const float* cos_d = c.use_rope ? dev.upload(cos) : nullptr;
  const float* sin_d = c.use_rope ? dev.upload(sin) : nullptr;
  const int32_t* doc_d = c.packed ? dev.upload(doc_start) : nullptr;
  uint16_t* k_d = zeros_at<uint16_t>(dev, k_n, offset);
  uint16_t* v_d = zeros_at<uint16_t>(dev, v_n, offset);
  cuda::mla_assemble_kv(kv_d, kv_a_d, c.B, c.T, c.H, c.nope, c.rope, c.dv, c.kvl, cos_d, sin_d,
                        doc_d, k_d, v_d);

  const uint16_t* dk_d = upload_at(dev, dk, offset);
  const uint16_t* dv_d = upload_at(dev, dv, offset);
  uint16_t* d_kv_d = zeros_at<uint16_t>(dev, kv_n, offset);
  uint16_t* d_kv_a_d = dev.zeros<uint16_t>(a_n);
  cuda::mla_split_kv_grad(dk_d, dv_d, c.B, c.T, c.H, c.nope, c.rope, c.dv, c.kvl, cos_d, sin_d,
                          doc_d, d_kv_d, d_kv_a_d);

  uint16_t* o_d = upload_at(dev, dv, offset);  // any bf16 data of the gate's size
  const uint16_t* g_d = upload_at(dev, g, offset);
  const float* d_out_d = upload_at(dev, d_out, offset);
  uint16_t* into_d = zeros_at<uint16_t>(dev, v_n, offset);
  uint16_t* dg_d = zeros_at<uint16_t>(dev, v_n, offset);
  uint16_t* d_o_d = zeros_at<uint16_t>(dev, v_n, offset);
  cuda::mla_gate_multiply_into(o_d, g_d, into_d, int64_t(v_n));
  cuda::mla_gate_backward(d_out_d, o_d, g_d, dg_d, d_o_d, int64_t(v_n));
  cuda::mla_gate_multiply(o_d, g_d, int64_t(v_n));  // in place, last

  MlaOutputs out;
  out.k = DeviceScratch::download(k_d, k_n);
  out.v = DeviceScratch::download(v_d, v_n);
  out.d_kv = DeviceScratch::download(d_kv_d, kv_n);
  out.d_kv_a = DeviceScratch::download(d_kv_a_d, a_n);
  out.gated = DeviceScratch::download(o_d, v_n);
  out.gated_into = DeviceScratch::download(into_d, v_n);
  out.dg = DeviceScratch::download(dg_d, v_n);
  out.d_o = DeviceScratch::download(d_o_d, v_n);
  return out;
}

TEST(CudaLayerOpsVectors, MlaGroupedKernelsMatchOneElementKernelsBitForBit) {
  DM_SKIP_WITHOUT_GPU();
  const MlaCase cases[] = {
      {2, 9, 3, 16, 8, 16, 32, true, true},        // RoPE, packed documents
      {1, 33, 2, 32, 16, 24, 64, false, false},    // NoPE: the shared key slice copied
      {1, 5, 16, 128, 64, 128, 512, true, false},  // the gpu_1b head shape
  };
  for (const MlaCase& c : cases) {
    SCOPED_TRACE("H=" + std::to_string(c.H) + " nope=" + std::to_string(c.nope) +
                 " rope=" + std::to_string(c.rope) + " dv=" + std::to_string(c.dv));
    const MlaOutputs grouped = run_mla_ops(c, 0), single = run_mla_ops(c, 1);
    EXPECT_EQ(grouped.k, single.k);
    EXPECT_EQ(grouped.v, single.v);
    EXPECT_EQ(grouped.d_kv, single.d_kv);
    EXPECT_EQ(grouped.d_kv_a, single.d_kv_a);
    EXPECT_EQ(grouped.gated, single.gated);
    EXPECT_EQ(grouped.gated_into, single.gated_into);
    EXPECT_EQ(grouped.dg, single.dg);
    EXPECT_EQ(grouped.d_o, single.d_o);
  }
}

}  // namespace
}  // namespace dm
#else
TEST(CudaLayerOpsVectors, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
