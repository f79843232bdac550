// `deltamoe threads`: prints what the engine will use (threads, BLAS) — a quick environment check.
#include <cstdio>

#include "command.h"
#include "core/gemm.h"

static dm::cli::Registrar reg("env", "Print the compute environment (threads)", [](CLI::App* app) {
  app->callback([] { std::printf("threads: %d\n", dm::num_threads()); });
});
