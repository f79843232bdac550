// CPU training throughput: random init, random tokens, forward + backward + AdamW step; median
// tokens/s over --steps steps after 2 warm-up steps, peak RSS and arena sizes. Mirrors
// `bench/peers/deltamoe_torch.py train-bench` so the two print comparable numbers.
//   bench_train --config configs/demo.json --batch 4 --seq 256 --steps 10 [--no-recompute]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "io/config.h"
#include "model/model.h"
#include "train/optimizer.h"

int main(int argc, char** argv) {
  dm::blas_ensure_fast_kernels(argc, argv);
  std::string config = "configs/demo.json";
  int64_t B = 4, T = 256;
  int steps = 10;
  bool recompute = true;
  for (int i = 1; i < argc; ++i) {
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (!std::strcmp(argv[i], "--config")) config = next();
    else if (!std::strcmp(argv[i], "--batch")) B = std::atoll(next());
    else if (!std::strcmp(argv[i], "--seq")) T = std::atoll(next());
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--no-recompute")) recompute = false;
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  try {
    const dm::ModelConfig cfg = dm::load_config(config);
    auto w = dm::weights_allocate<float>(cfg);
    dm::weights_init(*w, 1);
    const double params = double(w->numel());
    dm::Model model(std::move(w));
    auto grad = dm::weights_allocate<float>(cfg);
    dm::Optimizer opt(cfg, dm::OptimizerConfig{});
    std::mt19937 rng(7);
    std::vector<int64_t> tokens(size_t(B * T)), targets(size_t(B * T));
    dm::TrainOptions to;
    to.recompute = recompute;
    std::vector<double> tps;
    for (int s = 0; s < steps + 2; ++s) {
      for (auto& t : tokens) t = int64_t(rng() % uint32_t(cfg.vocab_size));
      for (size_t i = 0; i < targets.size(); ++i) targets[i] = i + 1 < targets.size() ? tokens[i + 1] : -1;
      const auto t0 = std::chrono::steady_clock::now();
      dm::grad_zero(*grad);
      model.forward_backward(tokens.data(), targets.data(), nullptr, B, T, *grad, 1.0 / double(B * T), to);
      opt.step(model.weights(), *grad, 1e-3f);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s >= 2) tps.push_back(double(B * T) / dt);
    }
    std::sort(tps.begin(), tps.end());
    struct rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    std::printf("{\"engine\":\"deltamoe\",\"threads\":%d,\"blas\":\"%s\",\"batch\":%lld,\"seq\":%lld,"
                "\"recompute\":%s,\"tokens_per_s\":%.1f,\"peak_rss_mb\":%.1f,\"activation_peak_mb\":%.1f,"
                "\"params\":%.0f}\n",
                dm::num_threads(), dm::blas_core_name(), (long long)B, (long long)T,
                recompute ? "true" : "false", tps[tps.size() / 2], double(ru.ru_maxrss) / 1e3,
                double(model.activation_peak()) / 1e6, params);
  } catch (const dm::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
