// Helpers the GPU benchmarks share (bench_cuda_*.cpp, built only with the CUDA backend): a
// checked CUDA runtime call, the median of CUDA-event timings, and random bf16 device data.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/cuda/device.h"

namespace dm::bench {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(str_cat(what, ": ", cudaGetErrorString(e)));
}

// Median milliseconds of `reps` runs of fn after `warmup` runs, timed with CUDA events on the
// default stream.
inline double median_ms(const std::function<void()>& fn, int reps, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "event");
  cuda_check(cudaEventCreate(&stop), "event");
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    cuda_check(cudaEventRecord(start), "record");
    fn();
    cuda_check(cudaEventRecord(stop), "record");
    cuda_check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Fills n bf16 values on the device with N(0, stddev) samples: one random host block of up to
// 4M values, tiled by device-to-device copies (timing needs non-trivial data, not independent
// samples everywhere).
inline void fill_random_bf16(uint16_t* device, size_t n, uint32_t seed, float stddev = 1.0f) {
  const size_t block = std::min<size_t>(n, size_t(1) << 22);
  std::vector<uint16_t> host(block);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  for (auto& x : host) x = cuda::float_to_bf16(normal(rng));
  cuda::copy_to_device(device, host.data(), block * 2);
  for (size_t done = block; done < n; done += block)
    cuda::copy_device_to_device(device + done, device, std::min(block, n - done) * 2);
}

// A benchmark's main: run(argc, argv) on a machine with a GPU; without one, say so and succeed
// (CI builds and runs nothing on the GPU); an error is printed and exits 1.
inline int run_on_gpu(int argc, char** argv, int (*run)(int, char**)) {
  try {
    if (!cuda::device_available()) {
      std::printf("no GPU: %s\n", cuda::device_description().c_str());
      return 0;
    }
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace dm::bench
