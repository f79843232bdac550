// The fp32 twins of the GPU layer kernels (the fp32 GPU mode: every activation fp32, nothing
// rounded) against the CPU float ops the float engine runs, on the same random inputs:
//   KDA (kda_layer_ops.h): short conv + SiLU vs ops/cpu/kda_prep.h short_conv_silu_forward, the
//     decay gate (softplus and safe) vs kda_gate_forward, β's sigmoid vs kda_sigmoid, the gated
//     per-head RMSNorm vs ops/cpu/norm_gated.h rmsnorm_gated_forward;
//   MLA (mla_layer_ops.h): the latent RMSNorm on strided rows vs ops/cpu/rmsnorm.h, the query
//     RoPE and the key/value assembly vs ops/cpu/attention.h rope_apply_interleaved (what
//     model/mla.cpp does), the output gate vs core/fastmath.h sigmoid;
//   residual stream (residual_ops.h): the fp32 embedding gather (exact), rmsnorm_to_f32 and the
//     fused add_rmsnorm_to_f32 vs rmsnorm_forward, on the float4 kernels and the scalar ones.
// Bound: relative RMS error ≤ 1e-5 and every output finite (a bf16-rounded output would sit near
// 2e-3). Packed documents (doc_start) wherever the op takes one. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fastmath.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cpu/norm_gated.h"
#include "ops/cpu/rmsnorm.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/mla_layer_ops.h"
#include "ops/cuda/residual_ops.h"
#include "test_util.h"

namespace dm {
namespace {

using test::DeviceScratch;

constexpr double kF32Bound = 1e-5;

// Every element of got finite and RMS(got − want) / RMS(want) ≤ 1e-5.
void expect_matches(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_TRUE(test::all_finite(got)) << what;
  const double err = test::rel_rms(got.data(), want.data(), want.size());
  EXPECT_LE(err, kF32Bound) << what;
}

// Norm weights around 1 (so a dropped weight shows), as the layers' norms are initialised.
std::vector<float> norm_weights(int64_t D, uint64_t seed) {
  std::vector<float> w = test::random_normal(size_t(D), seed, 0.3f);
  for (float& e : w) e += 1.0f;
  return w;
}

// ---- KDA ------------------------------------------------------------------------------------

void run_short_conv_case(int64_t B, int64_t T, int64_t C, int Kc, bool packed) {
  const std::string what =
      str_cat("short conv B=", B, " T=", T, " C=", C, " Kc=", Kc, packed ? " packed" : "");
  const int64_t N = B * T;
  const std::vector<float> x = test::random_normal(size_t(N * C), 101 + uint64_t(Kc));
  const std::vector<float> w = test::random_normal(size_t(C * Kc), 103 + uint64_t(Kc), 0.5f);
  // Row 0: starts inside the first conv window and on the kernel's 16-token run edges; row 1: in
  // the middle and at the last token.
  const std::vector<int32_t> doc_start =
      packed ? test::packed_documents(B, T, {{1, 2, 16, 17}, {int32_t(T / 2), int32_t(T - 1)}})
             : std::vector<int32_t>{};
  std::vector<float> y_ref(size_t(N * C));
  short_conv_silu_forward<float>(x.data(), w.data(), nullptr, y_ref.data(), B, T, C, Kc,
                                 packed ? doc_start.data() : nullptr);

  DeviceScratch dev(size_t(N * C) * 8 + size_t(C * Kc) * 4 + size_t(N) * 4 + 4096);
  const float* x_d = dev.upload(x);
  const float* w_d = dev.upload(w);
  const int32_t* doc_d = packed ? dev.upload(doc_start) : nullptr;
  float* y_d = dev.zeros<float>(size_t(N * C));
  cuda::kda_short_conv_silu_forward(x_d, w_d, y_d, B, T, C, Kc, doc_d);
  expect_matches(DeviceScratch::download(y_d, size_t(N * C)), y_ref, what);
  EXPECT_EQ(DeviceScratch::download(x_d, size_t(N * C)), x) << what << ": x changed";
}

TEST(CudaF32Ops, ShortConvMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {1, 3, 16, 17, 47})
    for (int64_t C : {5, 70}) run_short_conv_case(2, T, C, 4, false);
  for (int Kc = 1; Kc <= 8; ++Kc) run_short_conv_case(2, 37, 40, Kc, false);
}

TEST(CudaF32Ops, ShortConvPackedDocumentsMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int Kc : {1, 3, 4, 8}) run_short_conv_case(2, 70, 36, Kc, true);
}

// Both gate kinds; f wide enough (σ = 8) that the softplus takes its linear branch (z > 20) on
// some elements. Out of place, then in place (g aliases f).
TEST(CudaF32Ops, KdaGateMatchesCpuBothKinds) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t N = 37, H = 3, K = 40, n = N * H * K;
  const std::vector<float> f = test::random_normal(size_t(n), 201, 8.0f);
  const std::vector<float> A_log = test::random_normal(size_t(H), 202, 0.5f);
  const std::vector<float> dt_bias = test::random_normal(size_t(H * K), 203);
  for (const KdaGateKind kind : {KdaGateKind::Softplus, KdaGateKind::Safe}) {
    const bool safe = kind == KdaGateKind::Safe;
    const float lower_bound = -5.0f;
    const std::string what = safe ? "safe gate" : "softplus gate";
    std::vector<float> g_ref(f.size());
    kda_gate_forward<float>(f.data(), A_log.data(), dt_bias.data(), g_ref.data(), N, H, K, kind,
                            lower_bound);

    DeviceScratch dev(size_t(n) * 12 + size_t(H * K + H) * 4 + 4096);
    float* f_d = dev.upload(f);
    const float* a_d = dev.upload(A_log);
    const float* b_d = dev.upload(dt_bias);
    float* g_d = dev.zeros<float>(size_t(n));
    cuda::kda_gate_forward(f_d, a_d, b_d, g_d, N, H, K, safe, lower_bound);
    expect_matches(DeviceScratch::download(g_d, size_t(n)), g_ref, what);
    cuda::kda_gate_forward(f_d, a_d, b_d, f_d, N, H, K, safe, lower_bound);
    expect_matches(DeviceScratch::download(f_d, size_t(n)), g_ref, what + " in place");
  }
}

// Includes the saturated ends (σ(−100) = 0 below the −87 cutoff, σ(100) = 1).
TEST(CudaF32Ops, BetaSigmoidMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  std::vector<float> z = test::random_normal(1001, 301, 4.0f);
  z[0] = -100.0f;
  z[1] = 100.0f;
  z[2] = -86.5f;
  z[3] = 0.0f;
  std::vector<float> beta_ref(z.size());
  for (size_t i = 0; i < z.size(); ++i) beta_ref[i] = kda_sigmoid(z[i]);

  DeviceScratch dev(z.size() * 8 + 4096);
  const float* z_d = dev.upload(z);
  float* beta_d = dev.zeros<float>(z.size());
  cuda::kda_beta_sigmoid_forward(z_d, beta_d, int64_t(z.size()));
  expect_matches(DeviceScratch::download(beta_d, z.size()), beta_ref, "beta sigmoid");
}

// Rows of one head: D below a warp, one warp's worth, several elements per lane, ragged. Out of
// place, then in place (y aliases x).
TEST(CudaF32Ops, RmsnormGatedMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  struct Shape {
    int64_t rows, D;
  };
  for (const Shape s : {Shape{1, 1}, Shape{7, 32}, Shape{50, 64}, Shape{13, 100}, Shape{9, 300}}) {
    const std::string what = str_cat("gated norm rows=", s.rows, " D=", s.D);
    const size_t n = size_t(s.rows * s.D);
    const std::vector<float> x = test::random_normal(n, 401 + uint64_t(s.D));
    const std::vector<float> gate = test::random_normal(n, 402, 2.0f);
    const std::vector<float> w = norm_weights(s.D, 403);
    const float eps = 1e-5f;
    std::vector<float> y_ref(n);
    rmsnorm_gated_forward<float>(x.data(), w.data(), gate.data(), y_ref.data(), s.rows, s.D, eps);

    DeviceScratch dev(n * 12 + size_t(s.D) * 4 + 4096);
    float* x_d = dev.upload(x);
    const float* gate_d = dev.upload(gate);
    const float* w_d = dev.upload(w);
    float* y_d = dev.zeros<float>(n);
    cuda::kda_rmsnorm_gated_forward(x_d, w_d, gate_d, y_d, s.rows, s.D, eps);
    expect_matches(DeviceScratch::download(y_d, n), y_ref, what);
    cuda::kda_rmsnorm_gated_forward(x_d, w_d, gate_d, x_d, s.rows, s.D, eps);
    expect_matches(DeviceScratch::download(x_d, n), y_ref, what + " in place");
  }
}

// ---- MLA ------------------------------------------------------------------------------------

// The latent norm reads the first D columns of rows of leading dim ldx (kv_a's c slice when
// ldx > D); the CPU reference norms a contiguous copy of those columns.
TEST(CudaF32Ops, MlaRmsnormRowsMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  struct Shape {
    int64_t N, D, ldx;
  };
  for (const Shape s :
       {Shape{1, 7, 9}, Shape{5, 64, 64}, Shape{17, 512, 576}, Shape{3, 1000, 1007}}) {
    const std::string what = str_cat("mla rmsnorm rows N=", s.N, " D=", s.D, " ldx=", s.ldx);
    const std::vector<float> x = test::random_normal(size_t(s.N * s.ldx), 501 + uint64_t(s.D));
    const std::vector<float> w = norm_weights(s.D, 502);
    const double eps = 1e-6;
    std::vector<float> rows(size_t(s.N * s.D)), y_ref(size_t(s.N * s.D));
    for (int64_t n = 0; n < s.N; ++n)
      for (int64_t i = 0; i < s.D; ++i) rows[size_t(n * s.D + i)] = x[size_t(n * s.ldx + i)];
    rmsnorm_forward<float>(rows.data(), w.data(), y_ref.data(), s.N, s.D, eps);

    DeviceScratch dev(size_t(s.N * (s.ldx + s.D)) * 4 + size_t(s.D) * 4 + 4096);
    const float* x_d = dev.upload(x);
    const float* w_d = dev.upload(w);
    float* y_d = dev.zeros<float>(size_t(s.N * s.D));
    cuda::mla_rmsnorm_rows(x_d, s.ldx, w_d, y_d, s.N, s.D, eps);
    expect_matches(DeviceScratch::download(y_d, size_t(s.N * s.D)), y_ref, what);
  }
}

// RoPE tables and positions as model/mla.cpp builds them: rope_build_tables over T positions,
// pos = t − doc_start (rope_positions_from_doc_start).
struct RopeSetup {
  std::vector<float> cos, sin;     // [T, rope/2]
  std::vector<int64_t> positions;  // [B·T]
  std::vector<int32_t> doc_start;  // [B·T], empty when not packed
};

RopeSetup rope_setup(int64_t B, int64_t T, int64_t rope, bool yarn, bool packed) {
  RopeSetup r;
  if (packed) r.doc_start = test::packed_documents(B, T, {{5, 17}, {int32_t(T / 2)}});
  r.positions.resize(size_t(B * T));
  rope_positions_from_doc_start(packed ? r.doc_start.data() : nullptr, B, T, r.positions.data());
  if (rope == 0) return r;
  RopeParams p;
  p.dim = int(rope);
  p.theta = 10000.0;
  if (yarn) {  // amplitude ≠ 1 and interpolated pairs (original context 16 < T)
    p.yarn = true;
    p.factor = 4.0;
    p.original_max_position = 16;
    p.mscale = 1.0;
    p.mscale_all_dim = 0.5;
  }
  r.cos.resize(size_t(T * rope / 2));
  r.sin.resize(size_t(T * rope / 2));
  rope_build_tables<float>(p, T, r.cos.data(), r.sin.data());
  return r;
}

TEST(CudaF32Ops, MlaRopeQueriesMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t nope, rope;
    bool yarn, packed;
  };
  const int64_t B = 2, T = 40, H = 3, N = B * T;
  for (const Case c : {Case{8, 16, false, false}, Case{8, 16, true, true}, Case{0, 8, false, true},
                       Case{24, 64, true, false}}) {
    const std::string what = str_cat("rope queries nope=", c.nope, " rope=", c.rope,
                                     c.yarn ? " yarn" : "", c.packed ? " packed" : "");
    const int64_t dq = c.nope + c.rope;
    const RopeSetup r = rope_setup(B, T, c.rope, c.yarn, c.packed);
    const std::vector<float> q = test::random_normal(size_t(N * H * dq), 601 + uint64_t(dq));
    // CPU: rows [N·H] of stride dq, every head of token n at position pos[n].
    std::vector<int64_t> head_positions(size_t(N * H));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) head_positions[size_t(n * H + h)] = r.positions[size_t(n)];
    std::vector<float> q_ref = q;
    rope_apply_interleaved<float>(q_ref.data(), N * H, dq, c.nope, int(c.rope),
                                  head_positions.data(), r.cos.data(), r.sin.data());

    DeviceScratch dev(q.size() * 4 + r.cos.size() * 8 + size_t(N) * 4 + 4096);
    float* q_d = dev.upload(q);
    const float* cos_d = dev.upload(r.cos);
    const float* sin_d = dev.upload(r.sin);
    const int32_t* doc_d = c.packed ? dev.upload(r.doc_start) : nullptr;
    cuda::mla_rope_queries(q_d, B, T, H, c.nope, c.rope, cos_d, sin_d, doc_d);
    expect_matches(DeviceScratch::download(q_d, q.size()), q_ref, what);
  }
}

// k[n, h] = [kv[n, h, 0:nope] | R(pos_n)·kr_n], v[n, h] = kv[n, h, nope:], kr_n = kv_a[n, kvl:]
// (model/mla.cpp's expanded keys); RoPE off copies kr unrotated.
TEST(CudaF32Ops, MlaAssembleKvMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t nope, rope;
    bool use_rope, packed;
  };
  const int64_t B = 2, T = 40, H = 3, dv = 12, kvl = 24, N = B * T;
  for (const Case c : {Case{8, 16, true, false}, Case{8, 16, true, true}, Case{8, 16, false, true},
                       Case{0, 16, true, true}, Case{16, 0, false, false}}) {
    const std::string what =
        str_cat("assemble kv nope=", c.nope, " rope=", c.rope,
                c.use_rope ? " rope on" : " rope off", c.packed ? " packed" : "");
    const int64_t dq = c.nope + c.rope, kv_width = c.nope + dv, a_width = kvl + c.rope;
    const RopeSetup r = rope_setup(B, T, c.use_rope ? c.rope : 0, false, c.packed);
    const std::vector<float> kv = test::random_normal(size_t(N * H * kv_width), 701);
    const std::vector<float> kv_a = test::random_normal(size_t(N * a_width), 702);

    std::vector<float> kv_a_rotated = kv_a;
    if (c.use_rope)
      rope_apply_interleaved<float>(kv_a_rotated.data(), N, a_width, kvl, int(c.rope),
                                    r.positions.data(), r.cos.data(), r.sin.data());
    std::vector<float> k_ref(size_t(N * H * dq)), v_ref(size_t(N * H * dv));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = n * H + h;
        for (int64_t j = 0; j < c.nope; ++j)
          k_ref[size_t(row * dq + j)] = kv[size_t(row * kv_width + j)];
        for (int64_t j = 0; j < c.rope; ++j)
          k_ref[size_t(row * dq + c.nope + j)] = kv_a_rotated[size_t(n * a_width + kvl + j)];
        for (int64_t j = 0; j < dv; ++j)
          v_ref[size_t(row * dv + j)] = kv[size_t(row * kv_width + c.nope + j)];
      }

    DeviceScratch dev((kv.size() + kv_a.size() + k_ref.size() + v_ref.size()) * 4 +
                      r.cos.size() * 8 + size_t(N) * 4 + 8192);
    const float* kv_d = dev.upload(kv);
    const float* kv_a_d = dev.upload(kv_a);
    const float* cos_d = c.use_rope ? dev.upload(r.cos) : nullptr;
    const float* sin_d = c.use_rope ? dev.upload(r.sin) : nullptr;
    const int32_t* doc_d = c.packed ? dev.upload(r.doc_start) : nullptr;
    float* k_d = dev.zeros<float>(k_ref.size());
    float* v_d = dev.zeros<float>(v_ref.size());
    cuda::mla_assemble_kv(kv_d, kv_a_d, B, T, H, c.nope, c.rope, dv, kvl, cos_d, sin_d, doc_d, k_d,
                          v_d);
    expect_matches(DeviceScratch::download(k_d, k_ref.size()), k_ref, what + " (k)");
    expect_matches(DeviceScratch::download(v_d, v_ref.size()), v_ref, what + " (v)");
  }
}

TEST(CudaF32Ops, MlaGateMultiplyMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(1), int64_t(1000), int64_t(4097)}) {
    const std::vector<float> o = test::random_normal(size_t(n), 801 + uint64_t(n));
    const std::vector<float> g = test::random_normal(size_t(n), 802, 3.0f);
    std::vector<float> o_ref(o.size());
    for (size_t i = 0; i < o.size(); ++i) o_ref[i] = o[i] * sigmoid(g[i]);

    DeviceScratch dev(size_t(n) * 8 + 4096);
    float* o_d = dev.upload(o);
    const float* g_d = dev.upload(g);
    cuda::mla_gate_multiply(o_d, g_d, n);
    expect_matches(DeviceScratch::download(o_d, size_t(n)), o_ref, str_cat("gate n=", n));
  }
}

// ---- Residual stream ------------------------------------------------------------------------

// A copy: out[n] = table[tokens[n]] exactly, for int64 (prefill) and int32 (decode) ids,
// repeated ids included.
TEST(CudaF32Ops, EmbeddingGatherMatchesTable) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t V = 50;
  for (const int64_t D : {int64_t(37), int64_t(300)}) {
    const int64_t N = 23;
    const std::vector<float> table = test::random_normal(size_t(V * D), 901 + uint64_t(D));
    std::mt19937_64 rng(902);
    std::uniform_int_distribution<int64_t> pick(0, V - 1);
    std::vector<int64_t> tokens(static_cast<size_t>(N));
    for (int64_t& t : tokens) t = pick(rng);
    tokens[1] = tokens[0];
    tokens[2] = V - 1;
    const std::vector<int32_t> tokens32(tokens.begin(), tokens.end());
    std::vector<float> want(size_t(N * D));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < D; ++i)
        want[size_t(n * D + i)] = table[size_t(tokens[size_t(n)] * D + i)];

    DeviceScratch dev(size_t(V * D + 2 * N * D) * 4 + size_t(N) * 12 + 4096);
    const float* table_d = dev.upload(table);
    const int64_t* ids64_d = dev.upload(tokens);
    const int32_t* ids32_d = dev.upload(tokens32);
    float* out64_d = dev.zeros<float>(size_t(N * D));
    float* out32_d = dev.zeros<float>(size_t(N * D));
    cuda::embedding_gather(table_d, ids64_d, N, D, out64_d);
    cuda::embedding_gather(table_d, ids32_d, N, D, out32_d);
    const std::vector<float> got64 = DeviceScratch::download(out64_d, size_t(N * D));
    const std::vector<float> got32 = DeviceScratch::download(out32_d, size_t(N * D));
    expect_matches(got64, want, str_cat("gather int64 D=", D));
    expect_matches(got32, want, str_cat("gather int32 D=", D));
    EXPECT_EQ(got64, want) << "int64 ids, D=" << D;
    EXPECT_EQ(got32, want) << "int32 ids, D=" << D;
  }
}

struct RowsShape {
  int64_t N, D;
  bool misalign;  // pointers one float past 16 bytes: the scalar kernel even when D % 4 == 0
};
// float4 kernel: D % 4 == 0, D ≤ 4096, aligned; scalar kernel: the rest.
const RowsShape kResidualShapes[] = {{1, 7, false},    {1, 2304, false}, {3, 4096, false},
                                     {5, 4100, false}, {4, 300, false},  {2, 1001, false},
                                     {3, 2304, true}};

TEST(CudaF32Ops, RmsnormToF32MatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const RowsShape& s : kResidualShapes) {
    const std::string what =
        str_cat("rmsnorm_to_f32 N=", s.N, " D=", s.D, s.misalign ? " misaligned" : "");
    const size_t n = size_t(s.N * s.D), off = s.misalign ? 1 : 0;
    const std::vector<float> x = test::random_normal(n, 1001 + uint64_t(s.D), 3.0f);
    const std::vector<float> w = norm_weights(s.D, 1002);
    const float eps = 1e-5f;
    std::vector<float> y_ref(n);
    rmsnorm_forward<float>(x.data(), w.data(), y_ref.data(), s.N, s.D, double(eps));

    std::vector<float> x_pad(off), w_pad(off);
    x_pad.insert(x_pad.end(), x.begin(), x.end());
    w_pad.insert(w_pad.end(), w.begin(), w.end());
    DeviceScratch dev((2 * n + size_t(s.D) + 3) * 4 + 4096);
    const float* x_d = dev.upload(x_pad) + off;
    const float* w_d = dev.upload(w_pad) + off;
    float* y_d = dev.zeros<float>(n + off) + off;
    cuda::rmsnorm_to_f32(x_d, w_d, y_d, s.N, s.D, eps);
    expect_matches(DeviceScratch::download(y_d, n), y_ref, what);
  }
}

// p += out exactly, then y = RMSNorm(p)·w (fused on the float4 path, add then norm otherwise).
TEST(CudaF32Ops, AddRmsnormToF32MatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (const RowsShape& s : kResidualShapes) {
    const std::string what =
        str_cat("add_rmsnorm_to_f32 N=", s.N, " D=", s.D, s.misalign ? " misaligned" : "");
    const size_t n = size_t(s.N * s.D), off = s.misalign ? 1 : 0;
    const std::vector<float> p0 = test::random_normal(n, 1101 + uint64_t(s.D), 2.0f);
    const std::vector<float> out = test::random_normal(n, 1102);
    const std::vector<float> w = norm_weights(s.D, 1103);
    const float eps = 1e-5f;
    std::vector<float> sum(n), y_ref(n);
    for (size_t i = 0; i < n; ++i) sum[i] = p0[i] + out[i];
    rmsnorm_forward<float>(sum.data(), w.data(), y_ref.data(), s.N, s.D, double(eps));

    std::vector<float> p_pad(off), out_pad(off), w_pad(off);
    p_pad.insert(p_pad.end(), p0.begin(), p0.end());
    out_pad.insert(out_pad.end(), out.begin(), out.end());
    w_pad.insert(w_pad.end(), w.begin(), w.end());
    DeviceScratch dev((3 * n + size_t(s.D) + 4) * 4 + 4096);
    float* p_d = dev.upload(p_pad) + off;
    const float* out_d = dev.upload(out_pad) + off;
    const float* w_d = dev.upload(w_pad) + off;
    float* y_d = dev.zeros<float>(n + off) + off;
    cuda::add_rmsnorm_to_f32(p_d, out_d, w_d, y_d, s.N, s.D, eps);
    EXPECT_EQ(DeviceScratch::download(p_d, n), sum) << what << ": p += out";
    expect_matches(DeviceScratch::download(y_d, n), y_ref, what);
  }
}

}  // namespace
}  // namespace dm
#else
TEST(CudaF32Ops, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
