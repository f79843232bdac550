// `deltamoe env`: prints what the engine will use (threads, BLAS kernels) — a quick environment check.
#include <cstdio>

#include "command.h"
#include "core/gemm.h"

static dm::cli::Registrar reg("env", "Print the compute environment (threads, BLAS kernels)", [](CLI::App* app) {
  app->callback([] {
    std::printf("threads: %d\nBLAS kernels: OpenBLAS %s\n", dm::num_threads(), dm::blas_core_name());
  });
});
