// Shared helpers for the test suite: golden file access, error metrics, running the CLI.
#pragma once
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "io/safetensors.h"

namespace dm::test {

std::string goldens_dir();   // ../shared/goldens (or $DM_GOLDENS)
std::string source_dir();
std::string cli_path();      // build/bin/deltamoe
bool goldens_available();    // false → tests that need them are skipped with GTEST_SKIP

// RMS(a − b) / RMS(b) over n elements.
double rel_rms(const float* a, const float* b, size_t n);
double rel_rms(const double* a, const double* b, size_t n);
// Copies any float tensor to f32 / f64 vectors.
std::vector<float> to_f32(const Tensor& t);
std::vector<double> to_f64(const Tensor& t);

struct CliResult {
  int exit_code = -1;  // -1: killed by a signal
  std::string output;  // stdout + stderr
};
CliResult run_cli(const std::string& args);

// A fresh temporary directory (removed at process exit is not guaranteed).
std::string temp_dir(const std::string& tag);

// Sets (or, with nullptr, unsets) an environment variable for a scope and unsets it at the
// scope's end, also when a failed ASSERT_* leaves the test early (a bare setenv / unsetenv pair
// would then leak the setting into every later test of the process).
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() { unsetenv(name); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

// What call() throws as dm::Error (its what()), or "no error".
template <typename Call>
std::string error_message(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace dm::test
