// Kernels of random_fill.h: one grid-stride loop per fill, each element hashed independently
// from (seed, counter + i), so the launch shape never changes the values.
#include <algorithm>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/random_fill.h"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;
// Grid cap: the loops stride, so a 48B-element fill is ~45k elements per thread at this size.
constexpr int64_t kMaxBlocks = int64_t(1) << 20;

// splitmix64's finaliser: a bijection of 64-bit words with full avalanche.
__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 24-bit uniforms from the hash's high bits: exactly representable in fp32.
constexpr float kTwoPow24Inv = 1.0f / 16777216.0f;

struct NormalGen {
  float stddev;
  __device__ __forceinline__ float operator()(uint64_t h) const {
    const float u1 = float((h >> 40) + 1) * kTwoPow24Inv;        // (0, 1]: log finite
    const float u2 = float((h >> 16) & 0xFFFFFFull) * kTwoPow24Inv;  // [0, 1)
    return stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
};

struct UniformGen {
  float amplitude;
  __device__ __forceinline__ float operator()(uint64_t h) const {
    const float u = float(h >> 40) * kTwoPow24Inv;
    return amplitude * (2.0f * u - 1.0f);
  }
};

__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

template <typename T, typename Gen>
__global__ void random_fill_kernel(T* dst, int64_t n, Gen gen, uint64_t key, uint64_t counter) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store(dst + i, gen(mix64(key ^ (counter + uint64_t(i)))));
}

template <typename T, typename Gen>
void launch(T* dst, int64_t n, Gen gen, uint64_t seed, uint64_t counter, CUstream_st* stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  // The seed is hashed once so that seeds s and s+1 give unrelated streams (counter + i is
  // XOR-ed into the key before the per-element hash).
  random_fill_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(dst, n, gen, mix64(seed), counter);
}

}  // namespace

void random_normal_bf16(uint16_t* dst, int64_t n, float stddev, uint64_t seed, uint64_t counter,
                        CUstream_st* stream) {
  launch(reinterpret_cast<__nv_bfloat16*>(dst), n, NormalGen{stddev}, seed, counter, stream);
}

void random_uniform_bf16(uint16_t* dst, int64_t n, float amplitude, uint64_t seed,
                         uint64_t counter, CUstream_st* stream) {
  launch(reinterpret_cast<__nv_bfloat16*>(dst), n, UniformGen{amplitude}, seed, counter, stream);
}

void random_uniform_f32(float* dst, int64_t n, float amplitude, uint64_t seed, uint64_t counter,
                        CUstream_st* stream) {
  launch(dst, n, UniformGen{amplitude}, seed, counter, stream);
}

}  // namespace dm::cuda
