// Counter-based random fills on the device: the random initialisation of models too large for
// host memory (DeviceWeights(…, RandomInit), model/cuda/gpu_run.h) and the benchmark-only cache
// fill of GpuDecoder::fill_for_benchmark. Element i of a call gets its value from a hash of
// (seed, counter + i) only, so a range gets the same values however it is split into calls or
// launched, and the same (seed, counter) always gives the same bytes. Not a cryptographic or
// statistically certified generator: a splitmix64 finaliser per element, good enough for
// initialisation and timing. Plain C++ (no CUDA headers); kernels in random_fill.cu. Every
// pointer is a DEVICE pointer; bf16 tensors are their uint16_t bit patterns.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

// dst[i] = bf16(stddev · z_i), z_i ~ N(0, 1) by Box–Muller from two 24-bit uniforms of
// hash(seed, counter + i) (|z| ≤ 5.8: the tail beyond is cut, irrelevant for initialisation).
void random_normal_bf16(uint16_t* dst, int64_t n, float stddev, uint64_t seed, uint64_t counter,
                        CUstream_st* stream = nullptr);
// dst[i] = amplitude · (2u_i − 1), u_i ~ U[0, 1) (24 bits) of hash(seed, counter + i).
void random_uniform_bf16(uint16_t* dst, int64_t n, float amplitude, uint64_t seed,
                         uint64_t counter, CUstream_st* stream = nullptr);
void random_uniform_f32(float* dst, int64_t n, float amplitude, uint64_t seed, uint64_t counter,
                        CUstream_st* stream = nullptr);

}  // namespace dm::cuda
