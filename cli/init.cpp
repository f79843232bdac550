// `deltamoe init`: a randomly initialised model (SPEC init rules) written as a checkpoint folder.
#include <cstdio>

#include "command.h"
#include "io/config.h"
#include "model/weights.h"

namespace {
dm::cli::Registrar reg("init", "Write a randomly initialised model (config.json + model.safetensors)",
                       [](CLI::App* app) {
  static std::string config, out;
  static uint64_t seed = 0;
  app->add_option("--config", config, "Model config (K3, kimi_linear or deepseek_v3 schema)")->required();
  app->add_option("--out", out, "Output directory")->required();
  app->add_option("--seed", seed, "Random seed")->default_val(0);
  app->callback([] {
    const dm::ModelConfig cfg = dm::load_config(config);
    auto w = dm::weights_allocate(cfg);
    dm::weights_init(*w, seed);
    dm::weights_save(*w, out);
    std::printf("wrote %s: %.2fM parameters\n", out.c_str(), double(w->numel()) / 1e6);
  });
});
}  // namespace
