// Small element-wise kernels the GPU MoE layer (model/cuda/moe_gpu.cpp) needs between the ops of
// ops/cuda/moe.h: the latent RMSNorm runs in fp32 on the combined expert output u [N, ℓ], and the
// latent up-projection GEMM takes bf16 operands, so u is rounded to bf16 in between.
// Plain C++ header (no CUDA includes, nvcc compiles moe_layer_ops.cu as C++17); every pointer is
// a DEVICE pointer, bf16 is its uint16_t bit pattern.
#pragma once
#include <cstdint>

struct CUstream_st;  // cudaStream_t's pointee

namespace dm::cuda {

// y[i] = bf16(x[i]) (round to nearest even, like the host float_to_bf16) for i < n.
// x fp32 [n], y bf16 [n]; must not alias. n = 0 is a no-op.
void convert_f32_to_bf16(const float* x, uint16_t* y, int64_t n, CUstream_st* stream = nullptr);
// The same over x [rows, width] (contiguous) into a column block of y: row r at y + r·ld_y
// (ld_y ≥ width), the columns past width untouched.
void convert_f32_to_bf16_rows(const float* x, uint16_t* y, int64_t rows, int64_t width,
                              int64_t ld_y, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
