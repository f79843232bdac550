#include "ops/cuda/device.h"

#include <cstring>

#include "ops/cuda/cuda_common.cuh"

namespace dm::cuda {

int device_multiprocessors() {
  int device = 0, count = 0;
  DM_CUDA_CHECK(cudaGetDevice(&device));
  DM_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

bool device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return n > 0;
}

std::string device_description() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return str_cat("no CUDA device (", cudaGetErrorString(e), ")");
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  DM_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  return str_cat(p.name, " (sm_", p.major, p.minor, ", ",
                 double(p.totalGlobalMem) / double(1ull << 30), " GiB)");
}

void check_last_error(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error(str_cat(what, ": ", cudaGetErrorString(e)));
}

void synchronize() { DM_CUDA_CHECK(cudaDeviceSynchronize()); }

void copy_to_device(void* dst, const void* src, size_t bytes) {
  DM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  DM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy_device_to_device(void* dst, const void* src, size_t bytes) {
  DM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
void copy_async(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  DM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}
bool host_register(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return false;
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  cudaGetLastError();  // clear the error: the memory simply stays pageable
  return false;
}
void host_unregister(void* p) { cudaHostUnregister(p); }
void fill_zero(void* dst, size_t bytes) { DM_CUDA_CHECK(cudaMemset(dst, 0, bytes)); }
void fill_zero_async(void* dst, size_t bytes, CUstream_st* stream) {
  DM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream));
}
void copy_device_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  DM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}
void copy_rows_device_to_device_async(void* dst, size_t dst_pitch, const void* src,
                                      size_t src_pitch, size_t row_bytes, size_t rows,
                                      CUstream_st* stream) {
  DM_CHECK(row_bytes <= dst_pitch && row_bytes <= src_pitch,
           "copy_rows_device_to_device_async: rows of ", row_bytes, " bytes, pitches ", dst_pitch,
           " / ", src_pitch);
  if (rows == 0 || row_bytes == 0) return;
  DM_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                  cudaMemcpyDeviceToDevice, stream));
}
void copy_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  DM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}
void copy_to_host_async(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  DM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
}
void stream_synchronize(CUstream_st* stream) { DM_CUDA_CHECK(cudaStreamSynchronize(stream)); }

uint16_t float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float bf16_to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

DeviceArena::DeviceArena(size_t capacity_bytes) : capacity_(capacity_bytes) {
  if (capacity_ > 0) DM_CUDA_CHECK(cudaMalloc(&base_, capacity_));
}

DeviceArena::~DeviceArena() {
  if (base_ && owned_) cudaFree(base_);
}

void* DeviceArena::alloc_bytes(size_t bytes) {
  const size_t start = (used_ + 255) & ~size_t(255);
  DM_CHECK(start + bytes <= capacity_, "DeviceArena: out of space (", start + bytes, " > ",
           capacity_, " bytes)");
  used_ = start + bytes;
  return base_ + start;
}

}  // namespace dm::cuda
