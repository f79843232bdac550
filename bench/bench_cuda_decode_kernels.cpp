// GPU benchmark of a decode step's weight-streaming kernels one at a time, at the
// Kimi-Linear-48B shape (d 2304, 32 KDA heads of 128, MLA q 32 × 192 + latent 576, 256 experts
// of 1024 with a shared one, k 8, vocabulary 163840): each row is the median of --reps CUDA-event
// timings of one launch, the bytes it must read, and the bandwidth against the measured
// device-to-device copy. Weights rotate through enough copies that each launch reads them from
// HBM, not from L2; the routed experts are drawn anew for every timed launch.
//   bench_cuda_decode_kernels [--rows 1] [--reps 50]
// Why: bench_cuda_decode --skip gives what a part costs inside the overlapped step; this gives
// how close each kernel alone comes to the bandwidth, so the two together say whether a part
// loses its time in its kernels or between them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include "core/error.h"
#include "cuda_bench_util.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe_decode.h"
#include "ops/cuda/pdl.h"

namespace {

using dm::bench::fill_random_bf16;
using dm::bench::median_ms;
namespace cuda = dm::cuda;

constexpr double kL2Bytes = 60e6;  // H200 L2 (50 MB) with margin: weights rotate past it

struct Product {  // one GEMV output of a launch: N rows of K
  int64_t N;
};

int run(int argc, char** argv) {
  int64_t rows = 1;
  int reps = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows"))
      rows = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps"))
      reps = std::atoi(argv[i + 1]);
    else
      throw dm::Error(dm::str_cat("bench_cuda_decode_kernels: unknown option ", argv[i]));
  }
  DM_CHECK(rows >= 1 && rows <= cuda::kGemvMaxRows, "--rows: 1 to ", cuda::kGemvMaxRows);
  cuda::set_pdl_enabled(false);  // one kernel at a time on the default stream: nothing to overlap
  const int64_t d = 2304, HK = 32 * 128, V = 163840, E = 256, F = 1024, k = 8;
  cuda::DeviceArena arena(size_t(12) << 30);
  auto bf16 = [&](size_t n, uint32_t seed) {
    uint16_t* p = arena.alloc<uint16_t>(n);
    fill_random_bf16(p, n, seed, 0.02f);
    return p;
  };
  const uint16_t* x = bf16(size_t(rows * 8192), 1);  // inputs up to K = 8192
  float* y = arena.alloc<float>(size_t(rows * V));

  // Copy bandwidth: 1 GiB device to device, read + write counted.
  const size_t copy_bytes = size_t(1) << 30;
  uint16_t* copy_a = arena.alloc<uint16_t>(copy_bytes / 2);
  uint16_t* copy_b = arena.alloc<uint16_t>(copy_bytes / 2);
  const double copy_ms =
      median_ms([&] { cuda::copy_device_to_device(copy_b, copy_a, copy_bytes); }, 5, 1);
  const double copy_gbs = 2.0 * double(copy_bytes) / (copy_ms * 1e-3) / 1e9;
  std::printf("device-to-device copy: %.0f GB/s (read + write); %lld row%s\n", copy_gbs,
              (long long)rows, rows == 1 ? "" : "s");
  std::printf(
      "| kernel | shape | µs | MB read | GB/s | of copy |\n|---|---|---:|---:|---:|---:|\n");
  auto report = [&](const char* name, const std::string& shape, double ms, double bytes) {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("| %s | %s | %.1f | %.1f | %.0f | %.0f%% |\n", name, shape.c_str(), ms * 1e3,
                bytes / 1e6, gbs, 100.0 * gbs / copy_gbs);
  };

  // GEMV launches (one launch per row of the table, several products sharing x).
  auto gemv = [&](const char* name, int64_t K, std::vector<Product> products) {
    double bytes = 0;
    for (const Product& p : products) bytes += double(p.N * K * 2);
    const int copies = std::max(2, int(3 * kL2Bytes / bytes) + 1);
    std::vector<std::vector<cuda::GemvOutput>> sets(static_cast<size_t>(copies));
    uint32_t seed = 100;
    for (auto& set : sets)
      for (const Product& p : products)
        set.push_back(cuda::GemvOutput{bf16(size_t(p.N * K), seed++), K, p.N, y,
                                       cuda::GemmOutType::F32, p.N});
    int next = 0;
    const double ms = median_ms(
        [&] {
          const auto& set = sets[size_t(next++ % copies)];
          cuda::launch_gemv_bf16_many(rows, K, x, K, set.data(), int(set.size()), nullptr);
        },
        reps);
    std::string shape;
    for (const Product& p : products) shape += dm::str_cat(shape.empty() ? "" : " + ", p.N);
    report(name, dm::str_cat("[", shape, "] × ", K), ms, bytes);
  };
  gemv("KDA projections (q, k, v, f↓, β, g↓)", d, {{HK}, {HK}, {HK}, {128}, {32}, {128}});
  gemv("KDA / MLA W_o", HK, {{d}});
  gemv("MLA projections (q, kv_a)", d, {{32 * 192}, {576}});
  gemv("MoE router", d, {{E}});
  gemv("LM head", d, {{V}});

  // Routed experts + the shared one: the gathered pair kernels (moe_decode.h).
  {
    const cuda::ExpertWeightsBf16 ew{bf16(size_t(E * F * d), 7),
                                     bf16(size_t(E * F * d), 8),
                                     bf16(size_t(E * d * F), 9),
                                     E,
                                     d,
                                     F};
    const cuda::SharedExpertBf16 shared{bf16(size_t(F * d), 10), bf16(size_t(F * d), 11),
                                        bf16(size_t(d * F), 12)};
    const bool fold = cuda::moe_decode_folds_shared(rows, int(k), ew, F);
    void* ws = arena.alloc<char>(cuda::moe_decode_workspace_bytes(rows, int(k), ew, fold));
    const int draws = 64;
    std::vector<int32_t> idx_host(size_t(draws * rows * k));
    std::mt19937 rng(5);
    for (int64_t t = 0; t < draws * rows; ++t) {  // k distinct experts per token
      std::vector<int32_t> pool(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) pool[size_t(e)] = int32_t(e);
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int64_t s = 0; s < k; ++s) idx_host[size_t(t * k + s)] = pool[size_t(s)];
    }
    int32_t* idx = arena.alloc<int32_t>(idx_host.size());
    cuda::copy_to_device(idx, idx_host.data(), idx_host.size() * 4);
    std::vector<float> w_host(size_t(rows * k), 1.0f / float(k));
    float* w = arena.alloc<float>(w_host.size());
    cuda::copy_to_device(w, w_host.data(), w_host.size() * 4);
    int next = 0;
    const double ms = median_ms(
        [&] {
          const int32_t* draw = idx + size_t(next++ % draws) * size_t(rows * k);
          cuda::moe_decode_experts_forward(x, draw, w, rows, int(k), ew, cuda::GluKernelParams{}, y,
                                           cuda::GemmOutType::F32, ws, nullptr,
                                           fold ? &shared : nullptr);
        },
        reps);
    // Distinct experts hit (expected, uniform draws) × 3 matrices, plus the shared expert.
    const double hit = double(E) * (1.0 - std::pow(1.0 - double(k) / double(E), double(rows)));
    const double bytes = (hit + (fold ? 1.0 : 0.0)) * 3.0 * double(F * d * 2);
    report(fold ? "MoE experts (gathered, shared folded)" : "MoE experts (gathered)",
           dm::str_cat(rows, " × ", k, " of ", E, ", F ", F), ms, bytes);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dm::bench::run_on_gpu(argc, argv, run); }
#else
int main() {
  std::printf("bench_cuda_decode_kernels: built without the CUDA backend\n");
  return 0;
}
#endif
