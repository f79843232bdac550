// `deltamoe plot DIR`: renders DIR/metrics.jsonl (loss, balance, LR, grad norm, recall) to SVG.
#include <cstdio>

#include "command.h"
#include "train/plot.h"

namespace {
dm::cli::Registrar reg("plot", "Render a training run's metrics.jsonl to an SVG plot", [](CLI::App* app) {
  static std::string dir, out;
  app->add_option("dir", dir, "Training output directory (with metrics.jsonl)")->required();
  app->add_option("--out", out, "Output SVG (default DIR/metrics.svg)");
  app->callback([] {
    const std::string svg = out.empty() ? dir + "/metrics.svg" : out;
    auto series = dm::plot_read_metrics(dir + "/metrics.jsonl",
                                        {"loss", "maxvio", "maxvio_window", "lr", "grad_norm",
                                         "recall_acc", "tokens_per_s"});
    series[0].name = "loss (nats/token)";
    series[1].log_y = true;
    series[2].name = "maxvio over token windows";
    series[2].log_y = true;
    const int panels = dm::plot_write_svg(series, "deltamoe training: " + dir, svg);
    std::printf("wrote %s (%d panels)\n", svg.c_str(), panels);
  });
});
}  // namespace
