// `deltamoe env`: prints what the engine will use (threads, BLAS kernels, the GPU backend and
// device) — a quick environment check.
#include <cstdio>

#include "command.h"
#include "core/gemm.h"
#if DELTAMOE_HAVE_CUDA
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/device.h"
#endif

static dm::cli::Registrar reg(
    "env", "Print the compute environment (threads, BLAS kernels, GPU)", [](CLI::App* app) {
      app->callback([] {
        std::printf("threads: %d\nBLAS kernels: OpenBLAS %s\n", dm::num_threads(),
                    dm::blas_core_name());
#if DELTAMOE_HAVE_CUDA
        std::printf("CUDA backend: built for sm_90a\n");
        std::printf("GPU: %s\n", dm::cuda::device_description().c_str());
        if (dm::cuda::device_available())
          std::printf("cuDNN fused attention: %s\n",
                      dm::cuda::cudnn_attention_available() ? "available" : "not available");
#else
        std::printf("CUDA backend: not built (--device cuda is unavailable)\n");
#endif
      });
    });
