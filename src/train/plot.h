// Renders training curves from DIR/metrics.jsonl into an SVG image (no plotting dependency:
// polylines on linear axes with ticks). One panel per series: loss, MaxVio, LR, grad norm, and
// recall accuracy when present.
#pragma once
#include <string>
#include <vector>

namespace dm {

struct PlotSeries {
  std::string name;
  std::vector<double> x, y;
  bool log_y = false;
};

// Reads metrics.jsonl (one JSON object per line with "step" and numeric fields).
std::vector<PlotSeries> plot_read_metrics(const std::string& jsonl_path,
                                          const std::vector<std::string>& fields);
// Writes an SVG with one panel per non-empty series; returns the number of panels.
int plot_write_svg(const std::vector<PlotSeries>& series, const std::string& title,
                   const std::string& svg_path);

}  // namespace dm
