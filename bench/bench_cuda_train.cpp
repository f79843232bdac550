// GPU training throughput (train/train_engine.h "cuda" engine): random init, random tokens,
// forward + backward (per-layer recompute) + clip + AdamW per step; median tokens/s over --steps
// steps after 2 warm-up steps, MFU, device memory. Mirrors
// `bench/peers/deltamoe_torch.py train-bench --device cuda --dtype bfloat16`.
//   bench_cuda_train --config configs/gpu_1b.json --batch 1 --seq 4096 --steps 5 [--recompute off]
// --recompute off: the KDA layers keep their forward internals instead of recomputing them.
// MFU counts the model FLOPs of the step (no recompute; model/plan.h train_flops_per_token:
// 6 · active parameters per token for the matrices, plus the MLA layers' causal attention), over
// the H200's dense bf16 peak of 989 TFLOP/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include "core/error.h"
#include "io/config.h"
#include "model/model.h"
#include "model/params.h"
#include "model/plan.h"
#include "ops/cuda/device.h"
#include "train/train_engine.h"

int main(int argc, char** argv) {
  std::string config = "configs/gpu_1b.json";
  int64_t B = 1, T = 4096;
  int steps = 5;
  double peak_tflops = 989.0;
  bool recompute = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) B = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seq")) T = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--peak-tflops")) peak_tflops = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--recompute")) recompute = std::strcmp(argv[i + 1], "off") != 0;
  }
  try {
    if (!dm::cuda::device_available()) {
      std::printf("no GPU: %s\n", dm::cuda::device_description().c_str());
      return 0;
    }
    const dm::ModelConfig c = dm::load_config(config);
    auto w = dm::weights_allocate<float>(c);
    dm::weights_init(*w, 1);
    const dm::ParamCount pc = dm::count_params(c);
    dm::Model model(std::move(w));
    auto engine = dm::make_train_engine("cuda", model, dm::OptimizerConfig{});
    std::mt19937_64 rng(3);
    const int64_t N = B * T;
    std::vector<int64_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
    for (auto& t : tokens) t = int64_t(rng() % uint64_t(c.vocab_size));
    for (int64_t i = 0; i < N; ++i) targets[size_t(i)] = (i + 1) % T ? tokens[size_t(i + 1)] : -1;
    dm::TrainOptions options;
    options.recompute = recompute;
    std::vector<double> times, fb_times;
    double loss = 0;
    for (int s = 0; s < steps + 2; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      engine->zero_grads();
      const dm::TrainStepResult r = engine->forward_backward(
          tokens.data(), targets.data(), nullptr, B, T, 1.0 / double(N - B), options, nullptr);
      const double t_fb = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double gn = engine->grad_norm();  // synchronises
      if (gn > 1.0) engine->scale_grads(float(1.0 / gn));
      engine->optimizer_step(1e-4f);
      dm::cuda::synchronize();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s >= 2) {
        times.push_back(dt);
        fb_times.push_back(t_fb);
      }
      loss = r.loss_sum / double(r.count);
    }
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2];
    std::sort(fb_times.begin(), fb_times.end());
    const double t_fb = fb_times[fb_times.size() / 2];
    const double flops = dm::train_flops_per_token(c, pc.active, T) * double(N);
    const double tflops = flops / t / 1e12;
    std::printf("%s on %s: %s parameters, %s active; B=%lld T=%lld; recompute %s\n",
                config.c_str(), dm::cuda::device_description().c_str(),
                dm::format_param_count(pc.total).c_str(), dm::format_param_count(pc.active).c_str(),
                (long long)B, (long long)T, recompute ? "on" : "off (KDA internals kept)");
    std::printf("forward+backward %.1f ms, optimizer (norm, clip, AdamW) %.1f ms\n", t_fb * 1e3,
                (t - t_fb) * 1e3);
    std::printf("train step (fwd+bwd+AdamW, bf16 compute, fp32 master): %.1f ms, %.0f tokens/s, "
                "%.1f model TFLOP/s, MFU %.1f%% of %.0f; loss %.3f; device memory: activations "
                "peak %.2f GB, optimizer %.2f GB\n",
                t * 1e3, double(N) / t, tflops, 100.0 * tflops / peak_tflops, peak_tflops, loss,
                engine->activation_peak() / 1e9, engine->optimizer_bytes() / 1e9);
    std::printf("{\"impl\": \"deltamoe\", \"tokens_per_s\": %.1f, \"step_ms\": %.2f, \"mfu\": %.4f, "
                "\"recompute\": %s}\n",
                double(N) / t, t * 1e3, tflops / peak_tflops, recompute ? "true" : "false");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
#else
int main() {
  std::printf("built without the CUDA backend\n");
  return 0;
}
#endif
