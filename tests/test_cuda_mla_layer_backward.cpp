// Gated MLA layer backward on the GPU (model/cuda/layers.h mla_layer_backward_gpu) against the CPU
// float path (model/mla.h mla_layer_forward with MlaSaved, then mla_layer_backward) on the same
// bf16-rounded weights, inputs and upstream gradient dy. Checks, per case:
//   - dxn and every MLA parameter gradient the config uses: finite, rel RMS error ≤ 1e-2;
//   - dxn is WRITTEN (its buffer starts as NaN), gradients of everything outside the layer stay 0;
//   - a second call accumulates: the gradients double (dxn stays the same);
//   - mla_layer_backward_gpu_bytes is enough scratch and the scratch is released;
//   - with the forward's activations kept (training without recompute) the output and the
//     gradients match the recomputing path and the CPU.
// Cases: configs/test.json (q LoRA, NoPE shared key slot, output gate) and edited copies (no
// q LoRA with RoPE and the gate; RoPE + YaRN without the gate; no q LoRA, NoPE, no gate),
// B = 2, T = 200 (several 64-row attention tiles), with and without packed documents.
// Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
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

// The MLA parameters a gradient can land in (null members are skipped: the config lacks them).
struct MlaTensor {
  const char* name;
  float* MlaWeights::*member;
};
constexpr MlaTensor kMlaTensors[] = {
    {"q_a", &MlaWeights::q_a},   {"q_a_norm", &MlaWeights::q_a_norm},
    {"q_b", &MlaWeights::q_b},   {"q_proj", &MlaWeights::q_proj},
    {"kv_a", &MlaWeights::kv_a}, {"kv_a_norm", &MlaWeights::kv_a_norm},
    {"kv_b", &MlaWeights::kv_b}, {"gate", &MlaWeights::gate},
    {"o_proj", &MlaWeights::o_proj}};

// Element count of the parameter whose view starts at p (0 when p is not a parameter start).
int64_t param_numel(const ModelWeights& w, const float* p) {
  for (const auto& e : w.params)
    if (e.data == p) return e.numel();
  return 0;
}

std::vector<float> view(const ModelWeights& grad, const ModelWeights& w, const float* p) {
  const float* g = static_cast<const float*>(grad.arena_base()) + w.offset_of(p);
  return std::vector<float>(g, g + param_numel(w, p));
}

void run_case(const LayerCase& c, int64_t B, int64_t T, bool packed) {
  ModelConfig cfg = base_config();
  c.edit(cfg);
  cfg.init_std = kTestInitStd;
  validate_config(cfg, c.name);
  const int layer = mla_layer_index(cfg);
  ASSERT_GE(layer, 0);
  const auto w = rounded_weights(cfg, 11);
  const MlaWeights& mw = w->layers[size_t(layer)].mla;
  const int64_t N = B * T, d = cfg.hidden;
  const std::string tag = std::string(c.name) + (packed ? "/docs" : "");

  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * d), 5));
  // dy rounded like the GPU rounds it for its GEMMs, so only the GPU arithmetic differs.
  const std::vector<float> dy = test::round_bf16(test::random_normal(size_t(N * d), 7));
  const std::vector<int32_t> doc_start = packed ? two_documents(B, T) : std::vector<int32_t>{};
  const int32_t* doc_host = packed ? doc_start.data() : nullptr;

  // CPU reference in float: forward with saved activations, then backward into zeroed grads.
  Arena ws(std::max(mla_layer_workspace_bytes(cfg, B, T),
                    mla_layer_backward_workspace_bytes(cfg, B, T)));
  Arena saved_arena(mla_layer_saved_bytes(cfg, B, T));
  MlaSaved<float> saved;
  std::vector<float> y_cpu(size_t(N * d)), dx_cpu(size_t(N * d), 0.0f);
  mla_layer_forward<float>(cfg, mw, x.data(), y_cpu.data(), B, T, ws, doc_host, &saved,
                           &saved_arena);
  auto grad_cpu = weights_allocate<float>(cfg);
  mla_layer_backward<float>(cfg, mw, grad_cpu->layers[size_t(layer)].mla, x.data(), saved,
                            dy.data(), dx_cpu.data(), B, T, ws, doc_host);

  // GPU with exactly the scratch the layer asks for; dxn starts as NaN (it must be written).
  cuda::DeviceWeights dw(*w);
  cuda::DeviceGrads grads(*w);
  cuda::GpuRun run(cuda::mla_layer_backward_gpu_bytes(cfg, B, T));
  test::DeviceScratch io(size_t(N * d) * (sizeof(uint16_t) + 2 * sizeof(float)) + size_t(N) * 4 +
                         4 * 256);
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  const float* dy_dev = io.upload(dy);
  const int32_t* doc_dev = packed ? io.upload(doc_start) : nullptr;
  float* dxn_dev =
      io.upload(std::vector<float>(size_t(N * d), std::numeric_limits<float>::quiet_NaN()));

  cuda::mla_layer_backward_gpu(run, dw, grads, mw, x_dev, dy_dev, dxn_dev, B, T, doc_dev);
  const std::vector<float> dxn1 = test::DeviceScratch::download(dxn_dev, size_t(N * d));
  EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released";
  auto grad1 = weights_allocate<float>(cfg);
  grads.download(*grad1);

  auto report = [&](const char* tensor, const std::vector<float>& gpu,
                    const std::vector<float>& cpu) {
    ASSERT_EQ(gpu.size(), cpu.size()) << tensor;
    ASSERT_FALSE(gpu.empty()) << tag << " " << tensor;
    EXPECT_TRUE(test::all_finite(gpu)) << tag << " " << tensor << " has non-finite values";
    const double err = test::rel_rms(gpu.data(), cpu.data(), gpu.size());
    std::printf("[CudaMlaLayerBackward] %-16s %-10s rel RMS err %.3e\n", tag.c_str(), tensor, err);
    EXPECT_LE(err, 1e-2) << tag << " " << tensor;
  };
  report("dxn", dxn1, dx_cpu);
  int checked = 0;
  for (const MlaTensor& t : kMlaTensors) {
    const float* p = mw.*t.member;
    if (!p) continue;
    report(t.name, view(*grad1, *w, p), view(*grad_cpu, *w, p));
    ++checked;
  }
  EXPECT_EQ(checked, cfg.mla.q_lora_rank > 0 ? 8 - !cfg.mla.output_gate
                                             : 6 - !cfg.mla.output_gate)
      << tag << ": unexpected set of MLA parameters";

  // Nothing outside the layer's parameters receives gradient.
  {
    double outside = 0;
    for (const auto& e : w->params) {
      bool mine = false;
      for (const MlaTensor& t : kMlaTensors) mine = mine || (mw.*t.member == e.data);
      if (mine) continue;
      for (float g : view(*grad1, *w, e.data)) outside += std::fabs(double(g));
    }
    EXPECT_EQ(outside, 0.0) << tag << ": gradient written outside the MLA layer";
  }

  // A second call accumulates into the grads (they double) and rewrites dxn.
  cuda::mla_layer_backward_gpu(run, dw, grads, mw, x_dev, dy_dev, dxn_dev, B, T, doc_dev);
  const std::vector<float> dxn2 = test::DeviceScratch::download(dxn_dev, size_t(N * d));
  EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released (second call)";
  auto grad2 = weights_allocate<float>(cfg);
  grads.download(*grad2);
  EXPECT_LE(test::rel_rms(dxn2.data(), dxn1.data(), dxn1.size()), 1e-6)
      << tag << ": dxn must be written, not accumulated";
  for (const MlaTensor& t : kMlaTensors) {
    const float* p = mw.*t.member;
    if (!p) continue;
    std::vector<float> twice = view(*grad1, *w, p);
    for (float& g : twice) g *= 2.0f;
    const std::vector<float> second = view(*grad2, *w, p);
    EXPECT_LE(test::rel_rms(second.data(), twice.data(), twice.size()), 1e-5)
        << tag << " " << t.name << ": a second call must add the same gradient again";
  }

  // Kept (training without recompute): the forward leaves its activations and the lse in the
  // kept memory and the backward recomputes nothing. The output and the gradients must match
  // the recomputing path (the attention may run cuDNN's kernel in one and ours in the other:
  // rounding apart) and the CPU.
  {
    cuda::DeviceGrads kept_grads(*w);
    cuda::DeviceArena kept(cuda::mla_layer_kept_gpu_bytes(cfg, B, T));
    void* kept_memory = kept.alloc_bytes(kept.capacity());
    test::DeviceScratch ys(2 * size_t(N * d) * sizeof(float) + 512);
    const std::vector<float> nan(size_t(N * d), std::numeric_limits<float>::quiet_NaN());
    float* y_plain = ys.upload(nan);
    float* y_kept = ys.upload(nan);
    cuda::mla_layer_forward_gpu(run, dw, mw, x_dev, y_plain, B, T, doc_dev);
    cuda::mla_layer_forward_gpu(run, dw, mw, x_dev, y_kept, B, T, doc_dev, kept_memory);
    const std::vector<float> yp = test::DeviceScratch::download(y_plain, size_t(N * d));
    const std::vector<float> yk = test::DeviceScratch::download(y_kept, size_t(N * d));
    ASSERT_TRUE(test::all_finite(yk)) << tag << ": kept forward output";
    EXPECT_LE(test::rel_rms(yk.data(), yp.data(), yp.size()), 5e-3) << tag << ": kept forward";
    EXPECT_LE(test::rel_rms(yk.data(), y_cpu.data(), y_cpu.size()), 1e-2) << tag;
    cuda::mla_layer_backward_gpu(run, dw, kept_grads, mw, x_dev, dy_dev, dxn_dev, B, T, doc_dev,
                                 kept_memory);
    EXPECT_EQ(run.scratch.used(), 0u) << "scratch not released (kept)";
    const std::vector<float> dxn_kept = test::DeviceScratch::download(dxn_dev, size_t(N * d));
    auto grad_kept = weights_allocate<float>(cfg);
    kept_grads.download(*grad_kept);
    const std::string kept_tag = tag + " kept";
    report("dxn (kept)", dxn_kept, dx_cpu);
    EXPECT_LE(test::rel_rms(dxn_kept.data(), dxn1.data(), dxn1.size()), 5e-3) << kept_tag;
    for (const MlaTensor& t : kMlaTensors) {
      const float* p = mw.*t.member;
      if (!p) continue;
      const std::vector<float> g = view(*grad_kept, *w, p);
      report(t.name, g, view(*grad_cpu, *w, p));
      const std::vector<float> g1 = view(*grad1, *w, p);
      EXPECT_LE(test::rel_rms(g.data(), g1.data(), g1.size()), 5e-3) << kept_tag << " " << t.name;
    }
  }
}

// configs/test.json as is: q LoRA, NoPE (the rope slice of kv_a is a shared unrotated key), gate.
const LayerCase kK3{"K3", [](ModelConfig&) {}};
// No q LoRA (q = W_q x), plain RoPE, gate on.
const LayerCase kNoQLoraRope{"NoQLoraRope", [](ModelConfig& cfg) {
                               cfg.mla.q_lora_rank = 0;
                               cfg.mla.use_rope = true;
                             }};
// DeepSeek-like: q LoRA, RoPE with YaRN (amplitude ≠ 1, softmax scale × m²), no output gate.
// original_max_position 64 < T so the interpolated pairs matter.
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
// No q LoRA, NoPE, no gate: the smallest chain (dxn first written by W_kva's backward).
const LayerCase kPlain{"NoQLoraNoGate", [](ModelConfig& cfg) {
                         cfg.mla.q_lora_rank = 0;
                         cfg.mla.output_gate = false;
                       }};

TEST(CudaMlaLayerBackward, TestConfigMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_case(kK3, 2, 200, false);
}

TEST(CudaMlaLayerBackward, NoQLoraRopeMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_case(kNoQLoraRope, 2, 200, false);
}

TEST(CudaMlaLayerBackward, RopeYarnNoGateMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_case(kRopeYarn, 2, 200, false);
}

TEST(CudaMlaLayerBackward, NoQLoraNoGateMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_case(kPlain, 2, 200, false);
}

// Two documents per row: attention stays inside a document and RoPE positions restart.
TEST(CudaMlaLayerBackward, PackedDocumentsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  run_case(kK3, 2, 200, true);
  run_case(kNoQLoraRope, 2, 200, true);
  run_case(kRopeYarn, 2, 200, true);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaMlaLayerBackward, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
