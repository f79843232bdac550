#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/safetensors.h"

namespace dm {

std::vector<PlotSeries> plot_read_metrics(const std::string& path,
                                          const std::vector<std::string>& fields) {
  std::ifstream in(path);
  DM_CHECK(in.good(), path, ": cannot open");
  std::vector<PlotSeries> out(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) out[i].name = fields[i];
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      throw Error(str_cat(path, ":", lineno, ": not a JSON object"));
    }
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number()) continue;
    const double step = j["step"].get<double>();
    for (size_t i = 0; i < fields.size(); ++i) {
      auto it = j.find(fields[i]);
      if (it == j.end() || !it->is_number()) continue;
      const double v = it->get<double>();
      if (!std::isfinite(v)) continue;
      out[i].x.push_back(step);
      out[i].y.push_back(v);
    }
  }
  return out;
}

namespace {
std::string fmt(double v) {
  std::ostringstream os;
  os.precision(3);
  os << v;
  return os.str();
}
}  // namespace

int plot_write_svg(const std::vector<PlotSeries>& series, const std::string& title,
                   const std::string& svg_path) {
  std::vector<const PlotSeries*> panels;
  for (const auto& s : series)
    if (s.x.size() >= 1) panels.push_back(&s);
  const int W = 720, PH = 220, M = 60, top = 40;
  const int H = top + int(panels.size()) * (PH + 30) + 20;
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
      << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << W / 2 << "' y='22' text-anchor='middle' font-size='15'>" << title << "</text>\n";
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotSeries& s = *panels[p];
    const int y0 = top + int(p) * (PH + 30);
    auto tr = [&](double v) { return s.log_y ? std::log10(std::max(v, 1e-12)) : v; };
    double xmin = *std::min_element(s.x.begin(), s.x.end()), xmax = *std::max_element(s.x.begin(), s.x.end());
    double ymin = tr(*std::min_element(s.y.begin(), s.y.end()));
    double ymax = tr(*std::max_element(s.y.begin(), s.y.end()));
    if (xmax == xmin) xmax = xmin + 1;
    if (ymax == ymin) ymax = ymin + 1, ymin -= 1;
    const double pad = 0.05 * (ymax - ymin);
    ymin -= pad;
    ymax += pad;
    auto px = [&](double x) { return M + (x - xmin) / (xmax - xmin) * (W - 2 * M); };
    auto py = [&](double y) { return y0 + PH - (tr(y) - ymin) / (ymax - ymin) * PH; };
    svg << "<rect x='" << M << "' y='" << y0 << "' width='" << W - 2 * M << "' height='" << PH
        << "' fill='none' stroke='#999'/>\n";
    svg << "<text x='" << M << "' y='" << y0 - 6 << "' font-size='13'>" << s.name
        << (s.log_y ? " (log scale)" : "") << "</text>\n";
    for (int t = 0; t <= 4; ++t) {  // y ticks
      const double yv = ymin + (ymax - ymin) * t / 4;
      const double yy = y0 + PH - double(t) / 4 * PH;
      svg << "<line x1='" << M - 4 << "' x2='" << W - M << "' y1='" << yy << "' y2='" << yy
          << "' stroke='#eee'/><text x='" << M - 6 << "' y='" << yy + 4 << "' text-anchor='end'>"
          << fmt(s.log_y ? std::pow(10.0, yv) : yv) << "</text>\n";
      const double xv = xmin + (xmax - xmin) * t / 4;
      svg << "<text x='" << px(xv) << "' y='" << y0 + PH + 14 << "' text-anchor='middle'>"
          << fmt(xv) << "</text>\n";
    }
    svg << "<polyline fill='none' stroke='" << colors[p % 6] << "' stroke-width='1.5' points='";
    for (size_t i = 0; i < s.x.size(); ++i) svg << px(s.x[i]) << "," << py(s.y[i]) << " ";
    svg << "'/>\n";
  }
  svg << "<text x='" << W / 2 << "' y='" << H - 4 << "' text-anchor='middle'>step</text>\n</svg>\n";
  const std::string text = svg.str();
  write_file_atomic(svg_path, text.data(), text.size());
  return int(panels.size());
}

}  // namespace dm
