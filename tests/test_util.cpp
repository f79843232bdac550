#include "test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace dm::test {

std::string goldens_dir() {
  const char* e = std::getenv("DM_GOLDENS");
  return e ? e : DM_GOLDENS_DIR;
}
std::string source_dir() { return DM_SOURCE_DIR; }
// DM_CLI overrides the build's path (binaries built elsewhere and carried, scripts/device-check.sh).
std::string cli_path() {
  const char* env = std::getenv("DM_CLI");
  return env != nullptr && *env != '\0' ? env : DM_CLI_PATH;
}
bool goldens_available() {
  return std::filesystem::exists(goldens_dir() + "/kda_op_small.safetensors");
}

template <typename T>
static double rel_rms_impl(const T* a, const T* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}
double rel_rms(const float* a, const float* b, size_t n) { return rel_rms_impl(a, b, n); }
double rel_rms(const double* a, const double* b, size_t n) { return rel_rms_impl(a, b, n); }

std::vector<float> to_f32(const Tensor& t) {
  std::vector<float> v(t.numel());
  convert_to_f32(t.data, t.dtype, v.data(), v.size());
  return v;
}
std::vector<double> to_f64(const Tensor& t) {
  std::vector<double> v(t.numel());
  if (t.dtype == DType::F64) {
    const double* p = t.as<double>();
    v.assign(p, p + v.size());
  } else {
    std::vector<float> f = to_f32(t);
    for (size_t i = 0; i < v.size(); ++i) v[i] = f[i];
  }
  return v;
}

CliResult run_cli(const std::string& args) {
  CliResult r;
  const std::string cmd = cli_path() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  else r.exit_code = -1;
  return r;
}

std::string temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("dm_" + tag + "_XXXXXX")).string();
  char* d = mkdtemp(tmpl.data());
  return d ? std::string(d) : std::string();
}

}  // namespace dm::test
