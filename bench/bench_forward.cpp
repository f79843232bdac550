// End-to-end CPU forward throughput: a randomly initialised model of the given config, one
// sequence of T tokens, median of several timed passes after a warm-up.
//   bench_forward --config configs/demo.json --tokens 512,4096 [--batch 1] [--reps 3]
// Prints tokens/s, weights and activation arena sizes, and peak RSS.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "io/config.h"
#include "model/model.h"

int main(int argc, char** argv) {
  dm::blas_ensure_fast_kernels(argc, argv);
  std::string config = "configs/demo.json", tokens = "512,4096";
  int64_t batch = 1;
  int reps = 3, chunk = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tokens")) tokens = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--kda-chunk")) chunk = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  try {
    const dm::ModelConfig cfg = dm::load_config(config);
    auto w = dm::weights_allocate(cfg);
    dm::weights_init(*w, 1);
    const double params = double(w->numel());
    dm::Model model(std::move(w));
    std::printf("config %s: %.2fM params, %d threads, batch %lld, BLAS kernels %s\n",
                config.c_str(), params / 1e6, dm::num_threads(), (long long)batch,
                dm::blas_core_name());
    std::printf("%8s %12s %12s %14s %12s\n", "T", "ms/pass", "tokens/s", "act arena MB", "peak RSS MB");
    std::stringstream ss(tokens);
    std::string item;
    std::mt19937 rng(7);
    while (std::getline(ss, item, ',')) {
      const int64_t T = std::atoll(item.c_str());
      std::vector<int64_t> ids(size_t(batch * T));
      for (auto& t : ids) t = int64_t(rng() % uint32_t(cfg.vocab_size));
      std::vector<float> logits(size_t(batch * T) * cfg.vocab_size);
      dm::ForwardOptions opt;
      opt.kda_chunk = chunk;
      model.forward(ids.data(), batch, T, logits.data(), nullptr, opt);  // warm-up, sizes arenas
      std::vector<double> ms;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        model.forward(ids.data(), batch, T, logits.data(), nullptr, opt);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      struct rusage ru{};
      getrusage(RUSAGE_SELF, &ru);
      std::printf("%8lld %12.1f %12.0f %14.1f %12.1f\n", (long long)T, med,
                  double(batch * T) / (med / 1e3), double(model.activation_bytes(batch, T)) / 1e6,
                  double(ru.ru_maxrss) / 1e3);
    }
  } catch (const dm::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
