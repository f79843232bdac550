// fp32 GPU kernels of the fp32 GPU mode (docs/gpu.md) against independent CPU results:
// GemmContext::gemm_f32 (every transpose, padded leading dims, beta ≠ 0, K = 0) against a
// double-precision host product (relative RMS ≤ 1e-6, which TF32 multiplies would miss by ~3
// orders of magnitude) and its algorithm cache kept apart from gemm_bf16's; the fp32 attention
// (the Simple kernel on fp32 operands) against the CPU float attention, output and lse, with and
// without packed documents; the fp32 row permutation and the fp32 experts against the CPU float
// moe_experts_forward (SwiGLU and SiTU). fp32 results: relative RMS ≤ 1e-5. Outputs start as NaN
// so an element a kernel forgets to write fails. Without a GPU every test skips.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/threading.h"
#include "cuda_mla_test_util.h"
#include "cuda_test_util.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "test_util.h"

namespace dm {
namespace {

using test::random_normal;
using test::mla::alloc_poisoned;
using test::mla::download;
using test::mla::upload;

// RMS(gpu − ref) / RMS(ref), the reference in double.
double rel_rms_f64(const std::vector<float>& gpu, const std::vector<double>& ref) {
  const std::vector<double> g(gpu.begin(), gpu.end());
  return test::rel_rms(g.data(), ref.data(), g.size());
}

double rel_rms_f32(const std::vector<float>& gpu, const std::vector<float>& ref) {
  return test::rel_rms(gpu.data(), ref.data(), gpu.size());
}

// ---- GEMM ------------------------------------------------------------------------------------

// C [M, ldc] row-major = alpha·op(A)·op(B) + beta·C0 in double (columns n ≥ N keep C0). beta = 0
// ignores C0 (which may hold NaN there, as cuBLAS must).
std::vector<double> gemm_reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                                   const std::vector<float>& A, int64_t lda,
                                   const std::vector<float>& B, int64_t ldb, double beta,
                                   const std::vector<float>& C0, int64_t ldc) {
  std::vector<double> C(C0.begin(), C0.end());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0.0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double a = ta ? A[size_t(kk * lda + m)] : A[size_t(m * lda + kk)];
        const double b = tb ? B[size_t(n * ldb + kk)] : B[size_t(kk * ldb + n)];
        sum += a * b;
      }
      const size_t i = size_t(m * ldc + n);
      C[i] = alpha * sum + (beta == 0.0 ? 0.0 : beta * double(C0[i]));
    }
  return C;
}

TEST(CudaF32Kernels, GemmMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  cuda::GemmContext context;
  struct Shape {
    int64_t M, N, K;
  };
  uint64_t seed = 1;
  for (Shape shape : {Shape{1, 1, 1}, Shape{17, 33, 65}, Shape{64, 128, 256}, Shape{63, 200, 129},
                      Shape{300, 7, 512}}) {
    for (int transposes = 0; transposes < 4; ++transposes) {
      for (float beta : {0.0f, 0.5f}) {
        const bool ta = transposes & 1, tb = transposes & 2;
        const int64_t M = shape.M, N = shape.N, K = shape.K;
        SCOPED_TRACE(str_cat("M=", M, " N=", N, " K=", K, " ta=", ta, " tb=", tb, " beta=", beta));
        // Padded leading dimensions (+3): lda ≠ the logical width, and rows start off 16 bytes.
        const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 3, ldc = N + 3;
        const std::vector<float> A = random_normal(size_t((ta ? K : M) * lda), seed++);
        const std::vector<float> B = random_normal(size_t((tb ? N : K) * ldb), seed++);
        std::vector<float> C0 = random_normal(size_t(M * ldc), seed++);
        // beta = 0 must not read C: garbage (NaN) in the product's region.
        if (beta == 0.0f)
          for (int64_t m = 0; m < M; ++m)
            std::fill_n(C0.begin() + m * ldc, N, std::numeric_limits<float>::quiet_NaN());
        cuda::DeviceArena arena(size_t(16) << 20);
        const float* A_dev = upload(arena, A);
        const float* B_dev = upload(arena, B);
        float* C_dev = upload(arena, C0);
        context.gemm_f32(ta, tb, M, N, K, 1.25f, A_dev, lda, B_dev, ldb, beta, C_dev, ldc);
        cuda::synchronize();
        const std::vector<float> C = download(C_dev, C0.size());
        const std::vector<double> ref =
            gemm_reference(ta, tb, M, N, K, 1.25, A, lda, B, ldb, beta, C0, ldc);
        ASSERT_TRUE(test::all_finite(C));
        EXPECT_LE(rel_rms_f64(C, ref), 1e-6);
      }
    }
  }
}

// gemm_f32 after a gemm_bf16 of the same shape, leading dims, alignment and output type: the
// operand type is part of the cache key, so fp32 gets an algorithm of its own rather than one
// cuBLASLt chose for bf16 operands; further calls hit it. K = 0 scales C.
TEST(CudaF32Kernels, GemmHasItsOwnCachedAlgorithmAndHandlesEmptyK) {
  DM_SKIP_WITHOUT_GPU();
  cuda::GemmContext context;
  const int64_t M = 96, N = 160, K = 64;
  const std::vector<float> A = random_normal(size_t(M * K), 31);
  const std::vector<float> B = random_normal(size_t(N * K), 32);
  cuda::DeviceArena arena(size_t(8) << 20);
  const uint16_t* A16 = upload(arena, test::to_bf16(A));
  const uint16_t* B16 = upload(arena, test::to_bf16(B));
  const float* A_dev = upload(arena, A);
  const float* B_dev = upload(arena, B);
  float* C_dev = alloc_poisoned<float>(arena, size_t(M * N));
  context.gemm_bf16(false, true, M, N, K, 1.0f, A16, K, B16, K, 0.0f, C_dev, cuda::GemmOutType::F32,
                    N);
  const int after_bf16 = context.cached_algorithms();
  for (int i = 0; i < 3; ++i)
    context.gemm_f32(false, true, M, N, K, 1.0f, A_dev, K, B_dev, K, 0.0f, C_dev, N);
  EXPECT_EQ(context.cached_algorithms(), after_bf16 + 1);  // one new key, then steady state
  cuda::synchronize();
  const std::vector<double> ref = gemm_reference(false, true, M, N, K, 1.0, A, K, B, K, 0.0,
                                                 std::vector<float>(size_t(M * N)), N);
  EXPECT_LE(rel_rms_f64(download(C_dev, size_t(M * N)), ref), 1e-6);

  // K = 0: C ← beta·C; beta = 0 writes zeros over garbage.
  const std::vector<float> twos(size_t(M * N), 2.0f);
  cuda::copy_to_device(C_dev, twos.data(), twos.size() * sizeof(float));
  context.gemm_f32(false, true, M, N, 0, 1.0f, A_dev, K, B_dev, K, 0.5f, C_dev, N);
  cuda::synchronize();
  const std::vector<float> halved = download(C_dev, size_t(M * N));
  EXPECT_TRUE(std::all_of(halved.begin(), halved.end(), [](float c) { return c == 1.0f; }));
  float* garbage = alloc_poisoned<float>(arena, size_t(M * N));
  context.gemm_f32(false, true, M, N, 0, 1.0f, A_dev, K, B_dev, K, 0.0f, garbage, N);
  cuda::synchronize();
  const std::vector<float> zeros = download(garbage, size_t(M * N));
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](float c) { return c == 0.0f; }));
  EXPECT_THROW(context.gemm_f32(false, false, 4, 8, 4, 1.0f, A_dev, 4, B_dev, 8, 0.0f, C_dev, 7),
               Error);  // ldc < N
}

// ---- attention ---------------------------------------------------------------------------------

struct AttentionF32Case {
  int64_t B, T, H, Dqk, Dv;
  bool docs;
};

TEST(CudaF32Kernels, AttentionMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  // The full-size MLA head dims (192 = 128 nope + 64 rope, v 128) and the test config's (24, 16).
  for (const AttentionF32Case& c :
       {AttentionF32Case{2, 130, 2, 192, 128, false}, AttentionF32Case{2, 130, 2, 192, 128, true},
        AttentionF32Case{2, 37, 3, 24, 16, false}, AttentionF32Case{2, 37, 3, 24, 16, true}}) {
    SCOPED_TRACE(str_cat("T=", c.T, " H=", c.H, " Dqk=", c.Dqk, " Dv=", c.Dv, " docs=", c.docs));
    const AttnShape shape{c.B, c.T, c.H, c.Dqk, c.Dv};
    const size_t qk = size_t(c.B * c.T * c.H * c.Dqk), vo = size_t(c.B * c.T * c.H * c.Dv),
                 rows = size_t(c.B * c.H * c.T);
    const std::vector<float> q = random_normal(qk, seed++), k = random_normal(qk, seed++),
                             v = random_normal(vo, seed++);
    // Row 0: documents from 1 (token 0 alone), T/3 and a one-token one at T/3; row 1: from T/2,
    // and the last token alone.
    const std::vector<int32_t> doc = test::packed_documents(
        c.B, c.T,
        {{1, int32_t(c.T / 3), int32_t(c.T / 3 + 1)}, {int32_t(c.T / 2), int32_t(c.T - 1)}});
    const int32_t* doc_host = c.docs ? doc.data() : nullptr;
    const double scale = 1.0 / std::sqrt(double(c.Dqk));

    cuda::DeviceArena arena(size_t(32) << 20);
    const float* q_dev = upload(arena, q);
    const float* k_dev = upload(arena, k);
    const float* v_dev = upload(arena, v);
    const int32_t* doc_dev = c.docs ? upload(arena, doc) : nullptr;
    float* o_dev = alloc_poisoned<float>(arena, vo);
    float* lse_dev = alloc_poisoned<float>(arena, rows);
    cuda::attention_causal_forward(q_dev, k_dev, v_dev, o_dev, lse_dev, shape, scale, doc_dev);
    cuda::synchronize();
    const std::vector<float> o = download(o_dev, vo), lse = download(lse_dev, rows);

    std::vector<float> o_cpu(vo), lse_cpu(rows);
    Arena ws(attention_causal_workspace_bytes(shape, 64, sizeof(float)));
    attention_causal_forward<float>(q.data(), k.data(), v.data(), o_cpu.data(), lse_cpu.data(),
                                    shape, scale, ws, 64, doc_host);
    ASSERT_TRUE(test::all_finite(o)) << "NaN/inf (or unwritten) output";
    ASSERT_TRUE(test::all_finite(lse)) << "NaN/inf (or unwritten) lse";
    EXPECT_LE(rel_rms_f32(o, o_cpu), 1e-5);
    EXPECT_LE(rel_rms_f32(lse, lse_cpu), 1e-5);

    // Without lse: the same output.
    float* o2_dev = alloc_poisoned<float>(arena, vo);
    cuda::attention_causal_forward(q_dev, k_dev, v_dev, o2_dev, nullptr, shape, scale, doc_dev);
    cuda::synchronize();
    EXPECT_EQ(download(o2_dev, vo), o);
  }
}

// ---- MoE ---------------------------------------------------------------------------------------

// idx [N, k]: k distinct experts per token from the first `used` of E (the rest get no row, so
// their GEMMs must be skipped), each row ascending like moe_route's.
std::vector<int32_t> random_routing(int64_t N, int k, int used, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> experts(static_cast<size_t>(used)), idx(static_cast<size_t>(N * k));
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::sort(experts.begin(), experts.begin() + k);
    std::copy(experts.begin(), experts.begin() + k, idx.begin() + t * k);
  }
  return idx;
}

// Slot weights in [0.1, 1).
std::vector<float> random_slot_weights(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  std::vector<float> w(n);
  for (float& value : w) value = uniform(rng);
  return w;
}

// The fp32 row moves at widths with (40) and without (37) the 16-byte path, against the CPU
// plan (moe_plan_build's token and slot of each sorted row): permuted rows are exact copies of
// their token's row, and the weighted unpermute of independent rows is
// y[token[r]] += w[token[r], slot[r]]·rows[r] summed in double.
TEST(CudaF32Kernels, PermuteRowsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t N = 150;
  const int k = 3, E = 10;
  const std::vector<int32_t> idx = random_routing(N, k, E, 5);
  Arena host_arena(moe_plan_bytes(N, k, E));
  MoePlan cpu;
  moe_plan_build(idx.data(), N, k, E, &cpu, host_arena);
  for (int64_t D : {40, 37}) {
    SCOPED_TRACE(str_cat("D=", D));
    cuda::DeviceArena arena(size_t(8) << 20);
    std::vector<int64_t> host_offsets(static_cast<size_t>(E) + 1);
    cuda::MoeDispatchPlan plan;
    cuda::moe_dispatch_plan_build(upload(arena, idx), N, k, E, &plan, arena, host_offsets.data());
    const std::vector<float> x = random_normal(size_t(N * D), 6);
    float* sorted = alloc_poisoned<float>(arena, size_t(N * k * D));
    cuda::moe_permute_rows(upload(arena, x), plan, D, sorted);
    const std::vector<float> rows_in = random_normal(size_t(N * k * D), 7);
    const std::vector<float> w = random_slot_weights(size_t(N * k), 8);
    float* y = alloc_poisoned<float>(arena, size_t(N * D));
    cuda::moe_unpermute_rows(upload(arena, rows_in), plan, upload(arena, w), D, y);
    cuda::synchronize();

    const std::vector<float> rows = download(sorted, size_t(N * k * D));
    bool exact = true;
    for (int64_t r = 0; r < N * k; ++r)
      exact = exact && std::equal(rows.begin() + r * D, rows.begin() + (r + 1) * D,
                                  x.begin() + int64_t(cpu.token[r]) * D);
    EXPECT_TRUE(exact) << "sorted rows are not the CPU plan's token rows";
    std::vector<double> y_ref(size_t(N * D), 0.0);
    for (int64_t r = 0; r < N * k; ++r) {
      const int64_t t = cpu.token[r];
      const double weight = w[size_t(t * k + cpu.slot[r])];
      for (int64_t d = 0; d < D; ++d)
        y_ref[size_t(t * D + d)] += weight * double(rows_in[size_t(r * D + d)]);
    }
    EXPECT_LE(rel_rms_f64(download(y, size_t(N * D)), y_ref), 1e-6);
  }
}

struct F32ExpertsCase {
  int64_t N, E, Din, F;
  int k, used;
  uint32_t seed;
};

TEST(CudaF32Kernels, ExpertsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  // Widths multiples of 4 (16-byte row moves) with four empty experts, then odd widths (scalar
  // row moves, rows of every expert off 16-byte alignment for cuBLASLt).
  for (const F32ExpertsCase& c :
       {F32ExpertsCase{200, 16, 64, 48, 4, 12, 11}, F32ExpertsCase{37, 8, 30, 22, 2, 8, 21}}) {
    const std::vector<int32_t> idx = random_routing(c.N, c.k, c.used, c.seed);
    const std::vector<float> x = random_normal(size_t(c.N * c.Din), c.seed + 1);
    const std::vector<float> gate =
        random_normal(size_t(c.E * c.F * c.Din), c.seed + 2, 1.0f / std::sqrt(float(c.Din)));
    const std::vector<float> up =
        random_normal(size_t(c.E * c.F * c.Din), c.seed + 3, 1.0f / std::sqrt(float(c.Din)));
    const std::vector<float> down =
        random_normal(size_t(c.E * c.Din * c.F), c.seed + 4, 1.0f / std::sqrt(float(c.F)));
    const std::vector<float> w = random_slot_weights(size_t(c.N * c.k), c.seed + 5);

    Arena plan_arena(moe_plan_bytes(c.N, c.k, int(c.E)));
    MoePlan cpu_plan;
    moe_plan_build(idx.data(), c.N, c.k, int(c.E), &cpu_plan, plan_arena);
    const ExpertWeights cpu_weights{gate.data(), up.data(), down.data(), c.E, c.Din, c.F};

    for (auto kind : {Activation::SwiGLU, Activation::SiTU}) {
      SCOPED_TRACE(str_cat("N=", c.N, " E=", c.E, " Din=", c.Din, " F=", c.F, " k=", c.k,
                           " situ=", kind == Activation::SiTU));
      GluActivation act;
      act.kind = kind;
      std::vector<float> y_cpu(size_t(c.N * c.Din));
      Arena ws(moe_experts_forward_workspace_bytes(c.N, c.k, cpu_weights, num_threads()));
      moe_experts_forward<float>(x.data(), cpu_plan, w.data(), cpu_weights, act, y_cpu.data(), ws);

      cuda::GemmContext context;
      cuda::DeviceArena arena(size_t(32) << 20);
      std::vector<int64_t> host_offsets(static_cast<size_t>(c.E) + 1);
      cuda::MoeDispatchPlan plan;
      cuda::moe_dispatch_plan_build(upload(arena, idx), c.N, c.k, int(c.E), &plan, arena,
                                    host_offsets.data());
      const cuda::ExpertWeightsF32 ew{
          upload(arena, gate), upload(arena, up), upload(arena, down), c.E, c.Din, c.F};
      void* workspace = arena.alloc_bytes(cuda::moe_experts_forward_workspace_bytes(c.N, c.k, ew));
      const float* x_dev = upload(arena, x);
      const float* w_dev = upload(arena, w);
      float* y = alloc_poisoned<float>(arena, size_t(c.N * c.Din));
      cuda::moe_experts_forward(context, x_dev, plan, w_dev, ew, act, y, workspace);
      cuda::synchronize();
      const std::vector<float> y_gpu = download(y, size_t(c.N * c.Din));
      ASSERT_TRUE(test::all_finite(y_gpu));
      EXPECT_LE(rel_rms_f32(y_gpu, y_cpu), 1e-5);

      // The per-expert GEMMs need the host row counts: a device-only plan is refused.
      cuda::MoeDispatchPlan device_only;
      cuda::moe_dispatch_plan_build(upload(arena, idx), c.N, c.k, int(c.E), &device_only, arena,
                                    nullptr);
      EXPECT_THROW(
          cuda::moe_experts_forward(context, x_dev, device_only, w_dev, ew, act, y, workspace),
          Error);
    }
  }
}

}  // namespace
}  // namespace dm
#else
TEST(CudaF32Kernels, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
