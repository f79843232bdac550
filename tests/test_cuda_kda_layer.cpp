// KDA layer and dense FFN forward on the GPU (model/cuda/layers.h kda_layer_forward_gpu,
// dense_ffn_forward_gpu) against the CPU layers (model/kda.h kda_layer_forward, chunked;
// model/moe.h dense_ffn_forward; float) on the same bf16-rounded weights and inputs.
// KDA: configs/test.json (safe gate, full-rank output gate) and edited copies covering the
// softplus gate and the low-rank output gate, plus wider heads with a shorter conv; B = 2 with
// T = 100 (a partial chunk) and T = 300 (state carried over chunks); packed documents whose
// starts fall inside the conv window and on chunk edges; a sequence fed in pieces through a
// continuing carry. FFN: SiTU (test.json) and SwiGLU.
// Each case also checks that the *_bytes scratch suffices and is released. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "cuda_kda_layer_test_util.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "model/cuda/layers.h"
#include "model/kda.h"
#include "model/moe.h"
#include "model/weights.h"
#include "ops/cuda/device.h"
#include "test_util.h"

namespace dm {
namespace {

using test::kda_layer::KdaCase;
using test::kda_layer::kSafeFull;
using test::kda_layer::kSoftplusLow;
using test::kda_layer::kTestInitStd;
using test::kda_layer::kWide;

ModelConfig base_config() { return load_config(test::source_dir() + "/configs/test.json"); }

int first_layer(const ModelConfig& cfg, MixerKind kind) {
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.mixers[size_t(l)] == kind) return l;
  return -1;
}
int first_dense_layer(const ModelConfig& cfg) {
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.ffns[size_t(l)] == FfnKind::Dense) return l;
  return -1;
}

// Initialised weights, the KDA norm weights perturbed around 1 (else o_norm = 1 hides a wrong
// index), then every parameter rounded through bf16 so the CPU and the GPU see the same values.
std::unique_ptr<ModelWeights> rounded_weights(const ModelConfig& cfg, uint64_t seed) {
  auto w = weights_allocate<float>(cfg);
  weights_init(*w, seed);
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> normal(0.0f, 0.2f);
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.mixers[size_t(l)] == MixerKind::KDA)
      for (int64_t i = 0; i < cfg.kda.head_dim; ++i)
        w->layers[size_t(l)].kda.o_norm[i] = 1.0f + normal(rng);
  test::round_weights_to_bf16(*w);
  return w;
}

void run_kda_case(const KdaCase& c, int64_t B, int64_t T, bool packed) {
  ModelConfig cfg = base_config();
  c.edit(cfg);
  cfg.init_std = kTestInitStd;
  validate_config(cfg, c.name);
  const int layer = first_layer(cfg, MixerKind::KDA);
  ASSERT_GE(layer, 0);
  const auto w = rounded_weights(cfg, 17);
  const KdaWeights& kw = w->layers[size_t(layer)].kda;
  const int64_t N = B * T, d = cfg.hidden;

  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * d), 23));
  // Row 0: starts at 1 and 3 (inside the first conv window), 64 and 65 (a chunk edge and just
  // past it); row 1: one document start in the middle and one at the last token.
  const std::vector<int32_t> doc_start =
      packed ? test::packed_documents(B, T, {{1, 3, 64, 65}, {int32_t(T / 2), int32_t(T - 1)}})
             : std::vector<int32_t>{};
  const int32_t* doc_host = packed ? doc_start.data() : nullptr;

  // CPU reference: the chunked layer in float on the rounded values.
  std::vector<float> y_cpu(size_t(N * d));
  Arena ws(kda_layer_workspace_bytes(cfg, B, T));
  kda_layer_forward<float>(cfg, kw, x.data(), y_cpu.data(), B, T, ws, KdaRunOptions{64},
                           doc_host);

  // GPU with exactly the scratch the layer asks for.
  cuda::DeviceWeights dw(*w);
  cuda::GpuRun run(cuda::kda_layer_forward_gpu_bytes(cfg, B, T));
  test::DeviceScratch io(size_t(N * d) * (sizeof(uint16_t) + sizeof(float)) +
                         size_t(N) * sizeof(int32_t) + 4096);
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  const int32_t* doc_dev = packed ? io.upload(doc_start) : nullptr;
  float* y_dev = io.zeros<float>(size_t(N * d));
  cuda::kda_layer_forward_gpu(run, dw, kw, x_dev, y_dev, B, T, doc_dev);
  const std::vector<float> y_gpu = test::DeviceScratch::download(y_dev, size_t(N * d));
  EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released";

  ASSERT_TRUE(test::all_finite(y_gpu));
  const double err = test::rel_rms(y_gpu.data(), y_cpu.data(), y_gpu.size());
  std::printf("[CudaKdaLayer] %-16s B=%lld T=%-3lld docs=%d  rel RMS err %.3e\n", c.name,
              (long long)B, (long long)T, int(packed), err);
  EXPECT_LE(err, 1e-2) << c.name << " B=" << B << " T=" << T << " packed=" << packed;
}

// Besides the shared cases (cuda_kda_layer_test_util.h): the other gate / output-gate pairings.
const KdaCase kSafeLow{"SafeLowRank", [](ModelConfig& cfg) {
                         cfg.kda.full_rank_output_gate = false;
                         cfg.kda.gate_lower_bound = -2.5f;
                       }};
const KdaCase kSoftplusFull{"SoftplusFullRank",
                            [](ModelConfig& cfg) { cfg.kda.gate = KdaGateKind::Softplus; }};

TEST(CudaKdaLayer, SafeGateFullRankOutputGate) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSafeFull, 2, 100, false);
}

TEST(CudaKdaLayer, SafeGateLowRankOutputGate) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSafeLow, 2, 100, false);
}

TEST(CudaKdaLayer, SoftplusGateFullRankOutputGate) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSoftplusFull, 2, 100, false);
}

TEST(CudaKdaLayer, SoftplusGateLowRankOutputGate) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSoftplusLow, 2, 100, false);
}

TEST(CudaKdaLayer, LongerSequencesCarryStateAcrossChunks) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSafeFull, 2, 300, false);
  run_kda_case(kSoftplusLow, 2, 300, false);
}

TEST(CudaKdaLayer, WideHeadsShortConv) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kWide, 2, 100, false);
}

TEST(CudaKdaLayer, PackedDocuments) {
  DM_SKIP_WITHOUT_GPU();
  run_kda_case(kSafeFull, 2, 100, true);
  run_kda_case(kSoftplusLow, 2, 100, true);
  run_kda_case(kWide, 2, 300, true);
}

// A sequence fed in pieces through a continuing carry (KdaCarry::continues: the state is the
// operator's initial state, the tails the convs' left context) equals one call over the whole
// sequence and the CPU layer. Pieces: 70 + 80 (a partial chunk first), 2 + 1 + 147 (pieces
// shorter than the conv's context of Kc − 1 = 3 rows) and 64 + 64 + 22 (whole chunks).
// Written 2026-11-30 without a GPU to run it on.
TEST(CudaKdaLayer, CarryContinuesAcrossCalls) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig cfg = base_config();
  cfg.init_std = kTestInitStd;
  const int layer = first_layer(cfg, MixerKind::KDA);
  ASSERT_GE(layer, 0);
  const auto w = rounded_weights(cfg, 17);
  const KdaWeights& kw = w->layers[size_t(layer)].kda;
  const int64_t T = 150, d = cfg.hidden, H = cfg.kda.num_heads, K = cfg.kda.head_dim;
  const int64_t HK = H * K, ctx = cfg.kda.conv_kernel - 1;
  ASSERT_EQ(ctx, 3);
  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(T * d), 41));
  std::vector<float> y_cpu(size_t(T * d));
  Arena ws(kda_layer_workspace_bytes(cfg, 1, T));
  kda_layer_forward<float>(cfg, kw, x.data(), y_cpu.data(), 1, T, ws, KdaRunOptions{64});

  cuda::DeviceWeights dw(*w);
  cuda::GpuRun run(cuda::kda_layer_forward_gpu_bytes(cfg, 1, T));
  const size_t state_n = size_t(H * K * K), tail_n = size_t(ctx * HK);
  test::DeviceScratch io(size_t(T * d) * (2 + 4 * 2) + 2 * (state_n * 4 + 3 * tail_n * 2) +
                         64 * 1024);
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  auto carry_buffers = [&]() {
    cuda::KdaCarry carry;
    carry.state = io.zeros<float>(state_n);
    for (auto& tail : carry.tail) tail = io.zeros<uint16_t>(tail_n);
    return carry;
  };
  auto download_carry = [&](const cuda::KdaCarry& carry) {
    std::vector<float> all = test::DeviceScratch::download(carry.state, state_n);
    for (const uint16_t* tail : carry.tail)
      for (uint16_t bits : test::DeviceScratch::download(tail, tail_n))
        all.push_back(cuda::bf16_to_float(bits));
    return all;
  };

  // One call over all T tokens.
  float* y_whole_dev = io.zeros<float>(size_t(T * d));
  const cuda::KdaCarry whole = carry_buffers();
  cuda::kda_layer_forward_gpu(run, dw, kw, x_dev, y_whole_dev, 1, T, nullptr, &whole);
  const std::vector<float> y_whole = test::DeviceScratch::download(y_whole_dev, size_t(T * d));
  const std::vector<float> carry_whole = download_carry(whole);
  ASSERT_TRUE(test::all_finite(y_whole));
  EXPECT_LE(test::rel_rms(y_whole.data(), y_cpu.data(), y_cpu.size()), 1e-2);

  float* y_dev = io.zeros<float>(size_t(T * d));
  const cuda::KdaCarry pieces_carry = carry_buffers();
  for (const std::vector<int64_t>& pieces :
       {std::vector<int64_t>{70, 80}, std::vector<int64_t>{2, 1, 147},
        std::vector<int64_t>{64, 64, 22}}) {
    SCOPED_TRACE(str_cat("pieces ", pieces[0], " + ", pieces[1], pieces.size() > 2 ? " + …" : ""));
    cuda::KdaCarry carry = pieces_carry;
    int64_t at = 0;
    for (int64_t n : pieces) {
      carry.continues = at > 0;
      cuda::kda_layer_forward_gpu(run, dw, kw, x_dev + at * d, y_dev + at * d, 1, n, nullptr,
                                  &carry);
      EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released";
      at += n;
    }
    ASSERT_EQ(at, T);
    const std::vector<float> y = test::DeviceScratch::download(y_dev, size_t(T * d));
    ASSERT_TRUE(test::all_finite(y));
    const double err_cpu = test::rel_rms(y.data(), y_cpu.data(), y_cpu.size());
    const double err_whole = test::rel_rms(y.data(), y_whole.data(), y_whole.size());
    const std::vector<float> carried = download_carry(carry);
    const double err_carry = test::rel_rms(carried.data(), carry_whole.data(), carry_whole.size());
    std::printf("[CudaKdaLayer] pieces: rel RMS vs CPU %.3e, vs one call %.3e, carry %.3e\n",
                err_cpu, err_whole, err_carry);
    EXPECT_LE(err_cpu, 1e-2);
    EXPECT_LE(err_whole, 1e-2);
    EXPECT_LE(err_carry, 1e-2);
  }
}

// ---- Dense FFN -------------------------------------------------------------------------------

void run_ffn_case(const char* name, Activation activation, int64_t N) {
  ModelConfig cfg = base_config();
  cfg.activation = activation;
  cfg.init_std = kTestInitStd;
  validate_config(cfg, name);
  const int layer = first_dense_layer(cfg);
  ASSERT_GE(layer, 0);
  const auto w = rounded_weights(cfg, 29);
  const FfnWeights& fw = w->layers[size_t(layer)].dense;
  const int64_t d = cfg.hidden;

  // Inputs scaled up so SiTU's tanh saturations (β1 = 4, β2 = 25) are reached on some channels.
  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * d), 31, 3.0f));
  std::vector<float> y_cpu(size_t(N * d));
  Arena ws(dense_ffn_workspace_bytes(cfg, N));
  dense_ffn_forward<float>(cfg, fw, x.data(), y_cpu.data(), N, ws);

  cuda::DeviceWeights dw(*w);
  cuda::GpuRun run(cuda::dense_ffn_forward_gpu_bytes(cfg, N));
  test::DeviceScratch io(size_t(N * d) * (sizeof(uint16_t) + sizeof(float)) + 4096);
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  float* y_dev = io.zeros<float>(size_t(N * d));
  cuda::dense_ffn_forward_gpu(run, dw, fw, x_dev, y_dev, N);
  const std::vector<float> y_gpu = test::DeviceScratch::download(y_dev, size_t(N * d));
  EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released";

  ASSERT_TRUE(test::all_finite(y_gpu));
  const double err = test::rel_rms(y_gpu.data(), y_cpu.data(), y_gpu.size());
  std::printf("[CudaDenseFfn] %-6s N=%-4lld  rel RMS err %.3e\n", name, (long long)N, err);
  EXPECT_LE(err, 1e-2) << name << " N=" << N;
}

TEST(CudaDenseFfn, SituMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_ffn_case("SiTU", Activation::SiTU, 200);
  run_ffn_case("SiTU", Activation::SiTU, 37);
}

TEST(CudaDenseFfn, SwigluMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_ffn_case("SwiGLU", Activation::SwiGLU, 200);
  run_ffn_case("SwiGLU", Activation::SwiGLU, 37);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaKdaLayer, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
TEST(CudaDenseFfn, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
