// `deltamoe params --config FILE [--json]`: parameter counts (total, active per token) of a model
// config, by component.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <memory>
#include <string>

#include "command.h"
#include "io/config.h"
#include "model/params.h"

namespace {

void print_params_table(const dm::ParamCount& pc) {
  std::printf("%-20s %12s %12s\n", "component", "total", "active");
  for (size_t i = 0; i < pc.breakdown_total.size(); ++i)
    std::printf("%-20s %12s %12s\n", pc.breakdown_total[i].first.c_str(),
                dm::format_param_count(pc.breakdown_total[i].second).c_str(),
                dm::format_param_count(pc.breakdown_active[i].second).c_str());
  std::printf("%-20s %12s %12s\n", "TOTAL", dm::format_param_count(pc.total).c_str(),
              dm::format_param_count(pc.active).c_str());
  std::printf("total %lld parameters, active %lld per token\n", static_cast<long long>(pc.total),
              static_cast<long long>(pc.active));
}

void print_params_json(const dm::ParamCount& pc) {
  nlohmann::ordered_json out;
  out["total"] = pc.total;
  out["active"] = pc.active;
  nlohmann::ordered_json breakdown = nlohmann::ordered_json::object();
  for (size_t i = 0; i < pc.breakdown_total.size(); ++i)
    breakdown[pc.breakdown_total[i].first] = {{"total", pc.breakdown_total[i].second},
                                              {"active", pc.breakdown_active[i].second}};
  out["breakdown"] = breakdown;
  std::printf("%s\n", out.dump(2).c_str());
}

struct ParamsOptions {
  std::string config;
  bool json = false;
};

dm::cli::Registrar reg("params", "Count model parameters (total and active per token)", [](CLI::App* app) {
  auto opt = std::make_shared<ParamsOptions>();
  app->add_option("--config", opt->config, "config.json (or a checkpoint directory)")->required();
  app->add_flag("--json", opt->json, "print JSON instead of a table");
  app->callback([opt] {
    const dm::ModelConfig cfg = dm::load_config(opt->config);
    const dm::ParamCount pc = dm::count_params(cfg);
    if (opt->json) print_params_json(pc);
    else print_params_table(pc);
  });
});

}  // namespace
