// Host-side helpers of the MLA / GEMM / MoE CUDA tests (test_cuda_attention.cpp,
// test_cuda_gemm_moe.cpp): random bf16 tensors with their exact float values, device
// upload/download through a DeviceArena, NaN poisoning and finiteness checks. (The KDA / element
// op tests have their own cuda_test_util.h.) Only meaningful when DELTAMOE_HAVE_CUDA.
#pragma once
#if DELTAMOE_HAVE_CUDA
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "ops/cuda/device.h"

namespace dm::test::mla {

// A bf16 tensor on the host: the bit patterns to upload and the exact values they stand for
// (the CPU references compute on these, so only the GPU arithmetic differs).
struct Bf16Host {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};

inline Bf16Host random_bf16(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  Bf16Host out;
  out.bits.resize(n);
  out.values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out.bits[i] = cuda::float_to_bf16(normal(rng));
    out.values[i] = cuda::bf16_to_float(out.bits[i]);
  }
  return out;
}

inline Bf16Host bf16_from_floats(const std::vector<float>& x) {
  Bf16Host out;
  out.bits.resize(x.size());
  out.values.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out.bits[i] = cuda::float_to_bf16(x[i]);
    out.values[i] = cuda::bf16_to_float(out.bits[i]);
  }
  return out;
}

inline std::vector<float> bf16_bits_to_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = cuda::bf16_to_float(bits[i]);
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& x) {
  return std::vector<double>(x.begin(), x.end());
}

template <class T>
T* upload(cuda::DeviceArena& arena, const std::vector<T>& host) {
  T* device = arena.alloc<T>(host.empty() ? 1 : host.size());
  if (!host.empty()) cuda::copy_to_device(device, host.data(), host.size() * sizeof(T));
  return device;
}

template <class T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> host(n);
  if (n) cuda::copy_to_host(host.data(), device, n * sizeof(T));
  return host;
}

// Device buffer of n elements filled with the byte 0xFF: NaN as fp32 and as bf16, −1 as int32,
// so an element a kernel forgets to write shows up in the comparison.
template <class T>
T* alloc_poisoned(cuda::DeviceArena& arena, size_t n) {
  T* device = arena.alloc<T>(n ? n : 1);
  const std::vector<unsigned char> poison(n * sizeof(T), 0xFF);
  if (n) cuda::copy_to_device(device, poison.data(), poison.size());
  return device;
}

template <class T>
T* alloc_zeroed(cuda::DeviceArena& arena, size_t n) {
  T* device = arena.alloc<T>(n ? n : 1);
  if (n) cuda::fill_zero(device, n * sizeof(T));
  return device;
}

inline bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

// RMS(a − b) / RMS(b) with a in float and b in double.
inline double rel_rms_vs(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace dm::test::mla
#endif
