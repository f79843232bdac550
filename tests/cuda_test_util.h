// Helpers shared by the CUDA op tests (test_cuda_ops.cpp, test_cuda_kda.cpp): device buffers
// carved from one arena per test, bf16 round trips, finiteness. Only built with the CUDA backend.
#pragma once
#if DELTAMOE_HAVE_CUDA
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "model/weights.h"
#include "ops/cuda/device.h"

namespace dm::test {

#define DM_SKIP_WITHOUT_GPU()                  \
  if (!::dm::cuda::device_available()) GTEST_SKIP() << ::dm::cuda::device_description()

inline std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> x(n);
  for (float& e : x) e = normal(rng);
  return x;
}

// bf16 bit patterns of x, back to float, and x rounded through bf16 (what a bf16 kernel sees).
inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = cuda::float_to_bf16(x[i]);
  return r;
}
inline std::vector<float> from_bf16(const std::vector<uint16_t>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = cuda::bf16_to_float(x[i]);
  return r;
}
inline std::vector<float> round_bf16(const std::vector<float>& x) { return from_bf16(to_bf16(x)); }

// Every parameter rounded through bf16, so a CPU reference and the GPU (which keeps bf16 weight
// mirrors) see the same model.
inline void round_weights_to_bf16(ModelWeights& w) {
  for (const auto& e : w.params)
    for (int64_t i = 0; i < e.numel(); ++i)
      e.data[i] = cuda::bf16_to_float(cuda::float_to_bf16(e.data[i]));
}

// doc_start [B·T]: row b's documents start at 0 and at each position of starts[b].
inline std::vector<int32_t> packed_documents(int64_t B, int64_t T,
                                             const std::vector<std::vector<int32_t>>& starts) {
  std::vector<int32_t> doc_start(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int32_t current = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t s : starts[size_t(b)])
        if (s == t) current = s;
      doc_start[size_t(b * T + t)] = current;
    }
  }
  return doc_start;
}

template <typename T>
bool all_finite(const std::vector<T>& x) {
  for (T e : x)
    if (!std::isfinite(e)) return false;
  return true;
}

// Device copies of host vectors, carved from one arena (one cudaMalloc per test).
class DeviceScratch {
 public:
  explicit DeviceScratch(size_t bytes) : arena_(bytes) {}
  template <typename T>
  T* upload(const std::vector<T>& host) {
    T* device = arena_.alloc<T>(host.size());
    if (!host.empty()) cuda::copy_to_device(device, host.data(), host.size() * sizeof(T));
    return device;
  }
  template <typename T>
  T* zeros(size_t n) {
    T* device = arena_.alloc<T>(n);
    if (n > 0) cuda::fill_zero(device, n * sizeof(T));
    return device;
  }
  void* raw(size_t bytes) { return arena_.alloc_bytes(bytes); }
  // Synchronises first, so results of asynchronous launches are complete.
  template <typename T>
  static std::vector<T> download(const T* device, size_t n) {
    std::vector<T> host(n);
    cuda::synchronize();
    if (n > 0) cuda::copy_to_host(host.data(), device, n * sizeof(T));
    return host;
  }

 private:
  cuda::DeviceArena arena_;
};

}  // namespace dm::test
#endif
