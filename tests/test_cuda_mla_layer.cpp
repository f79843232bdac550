// Gated MLA layer forward on the GPU (model/cuda/layers.h mla_layer_forward_gpu) against the CPU
// layer (model/mla.h mla_layer_forward, float) on the same bf16-rounded weights and inputs:
// configs/test.json (q LoRA, NoPE with an unrotated shared rope slice, output gate) and edited
// copies: RoPE + YaRN without the gate (DeepSeek-like), no q LoRA, no nope dims (all-rope
// queries/keys); B = 2, T = 100 and 300; packed documents (doc_start, two per row). Also checks
// that mla_layer_forward_gpu_bytes is enough scratch and that the scratch is released.
// Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "cuda_mla_layer_test_util.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "model/cuda/layers.h"
#include "model/mla.h"
#include "model/weights.h"
#include "ops/cuda/device.h"
#include "test_util.h"

namespace dm {
namespace {

using test::mla_layer::base_config;
using test::mla_layer::kTestInitStd;
using test::mla_layer::LayerCase;
using test::mla_layer::mla_layer_index;
using test::mla_layer::rounded_weights;
using test::mla_layer::two_documents;

void run_case(const LayerCase& c, int64_t B, int64_t T, bool packed) {
  ModelConfig cfg = base_config();
  c.edit(cfg);
  cfg.init_std = kTestInitStd;
  validate_config(cfg, c.name);  // the variant must be a legal config
  const int layer = mla_layer_index(cfg);
  ASSERT_GE(layer, 0);
  const auto w = rounded_weights(cfg, 11);
  const MlaWeights& mw = w->layers[size_t(layer)].mla;
  const int64_t N = B * T, d = cfg.hidden;

  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * d), 5));
  const std::vector<int32_t> doc_start = packed ? two_documents(B, T) : std::vector<int32_t>{};

  // CPU reference in float on the rounded values.
  std::vector<float> y_cpu(size_t(N * d));
  Arena ws(mla_layer_workspace_bytes(cfg, B, T));
  mla_layer_forward<float>(cfg, mw, x.data(), y_cpu.data(), B, T, ws,
                           packed ? doc_start.data() : nullptr);

  // GPU with exactly the scratch the layer asks for.
  cuda::DeviceWeights dw(*w);
  cuda::GpuRun run(cuda::mla_layer_forward_gpu_bytes(cfg, B, T));
  test::DeviceScratch io(size_t(N * d) * (sizeof(uint16_t) + sizeof(float)) + size_t(N) * 4 +
                         4096);
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  const int32_t* doc_dev = packed ? io.upload(doc_start) : nullptr;
  float* y_dev = io.zeros<float>(size_t(N * d));
  cuda::mla_layer_forward_gpu(run, dw, mw, x_dev, y_dev, B, T, doc_dev);
  const std::vector<float> y_gpu = test::DeviceScratch::download(y_dev, size_t(N * d));
  EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released";

  ASSERT_TRUE(test::all_finite(y_gpu));
  const double err = test::rel_rms(y_gpu.data(), y_cpu.data(), y_gpu.size());
  std::printf("[CudaMlaLayer] %-10s B=%lld T=%-3lld docs=%d  rel RMS err %.3e\n", c.name,
              (long long)B, (long long)T, int(packed), err);
  EXPECT_LE(err, 1e-2) << c.name << " B=" << B << " T=" << T << " packed=" << packed;
}

// configs/test.json as is: q LoRA, NoPE (the rope slice of kv_a is shared unrotated), gate.
const LayerCase kK3{"K3", [](ModelConfig&) {}};
// DeepSeek-like: RoPE with YaRN (ramp inside the 4 pairs, amplitude ≠ 1, softmax scale × m²),
// no output gate. original_max_position 64 < T so the interpolated pairs matter.
const LayerCase kRopeYarn{"RopeYarn", [](ModelConfig& cfg) {
                            MlaConfig& m = cfg.mla;
                            m.use_rope = true;
                            m.output_gate = false;
                            m.yarn.enabled = true;
                            m.yarn.factor = 4.0;
                            m.yarn.original_max_position = 64;
                            m.yarn.beta_fast = 32;
                            m.yarn.beta_slow = 1;
                            m.yarn.mscale = 1.0;
                            m.yarn.mscale_all_dim = 0.5;
                          }};
// No q LoRA (q = W_q x), plain RoPE, gate on.
const LayerCase kNoQLora{"NoQLora", [](ModelConfig& cfg) {
                           cfg.mla.q_lora_rank = 0;
                           cfg.mla.use_rope = true;
                         }};
// No nope dims: queries and keys are the rotary slice only (dq = rope = 16).
const LayerCase kNoNope{"NoNope", [](ModelConfig& cfg) {
                          cfg.mla.qk_nope_dim = 0;
                          cfg.mla.qk_rope_dim = 16;
                          cfg.mla.use_rope = true;
                        }};

TEST(CudaMlaLayer, TestConfigMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {100, 300}) run_case(kK3, 2, T, false);
}

TEST(CudaMlaLayer, RopeYarnMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {100, 300}) run_case(kRopeYarn, 2, T, false);
}

TEST(CudaMlaLayer, NoQLoraMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {100, 300}) run_case(kNoQLora, 2, T, false);
}

TEST(CudaMlaLayer, NoNopeDimsMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {100, 300}) run_case(kNoNope, 2, T, false);
}

// Two documents per row: attention stays inside a document and RoPE positions restart (RoPE is
// shift-invariant, so the restart changes scores only at rounding level; the mask is what shows).
TEST(CudaMlaLayer, PackedDocumentsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t T : {100, 300}) {
    run_case(kK3, 2, T, true);
    run_case(kRopeYarn, 2, T, true);
  }
}

}  // namespace
}  // namespace dm
#else
TEST(CudaMlaLayer, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
