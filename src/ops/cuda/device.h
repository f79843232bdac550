// CUDA device basics for the GPU backend, as plain C++ (no CUDA headers) so the engine, the CLI
// and the tests include it without nvcc. Implemented in device.cu.
//
// Memory follows the engine's rule: one device allocation per category (weights, grads,
// optimizer state, activations, caches), carved into views by a DeviceArena; nothing is
// allocated inside the hot loop.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dm::cuda {

// True when a CUDA driver and at least one GPU answer (false on CI machines without a GPU;
// never throws).
bool device_available();
// "NVIDIA H200 (sm_90, 139.8 GiB)" or a reason why there is none.
std::string device_description();
// Multiprocessors of the current device (launch shapes, decode plans).
int device_multiprocessors();

// Throws dm::Error naming `what` and the CUDA error string when the last launch or call failed.
void check_last_error(const char* what);
void synchronize();

void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void copy_device_to_device(void* dst, const void* src, size_t bytes);
void fill_zero(void* dst, size_t bytes);
// Stream-ordered twins (stream = cudaStream_t, nullptr = default stream); nothing waits.
void fill_zero_async(void* dst, size_t bytes, CUstream_st* stream);
void copy_device_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream);
void copy_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream);
// rows × row_bytes from src (rows src_pitch bytes apart) to dst (dst_pitch apart), both on the
// device: e.g. a [d, a] matrix into the first a columns of a [d, a + b] one (cudaMemcpy2DAsync).
void copy_rows_device_to_device_async(void* dst, size_t dst_pitch, const void* src,
                                      size_t src_pitch, size_t row_bytes, size_t rows,
                                      CUstream_st* stream);
void copy_to_host_async(void* dst, const void* src, size_t bytes, CUstream_st* stream);
// Either direction (host or device pointers, the driver tells them apart); with pageable host
// memory the call returns once the copy is done, like cudaMemcpyAsync itself.
void copy_async(void* dst, const void* src, size_t bytes, CUstream_st* stream);
void stream_synchronize(CUstream_st* stream);
// Page-locks existing host memory for the device's copies (cudaHostRegister); false when the
// driver refuses (e.g. the locked-memory limit): the memory then stays pageable and copies still
// work, only slower. host_unregister undoes a successful host_register.
bool host_register(void* p, size_t bytes);
void host_unregister(void* p);

// bf16 <-> fp32 on the host (round to nearest even), for uploading weights and checking results.
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t x);

// One cudaMalloc, handed out in 256-byte-aligned views; reset() reuses it.
class DeviceArena {
 public:
  explicit DeviceArena(size_t capacity_bytes);
  // A view over device memory someone else owns (a slice of a larger arena): carves, never frees.
  DeviceArena(void* base, size_t capacity_bytes)
      : base_(static_cast<char*>(base)), capacity_(capacity_bytes), owned_(false) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* alloc_bytes(size_t bytes);
  template <class T>
  T* alloc(size_t count) {
    return static_cast<T*>(alloc_bytes(count * sizeof(T)));
  }
  void reset() { used_ = 0; }
  // Back to an earlier used() mark (DeviceArenaScope): everything carved since is dead.
  void rewind(size_t mark) { used_ = mark < used_ ? mark : used_; }
  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
  bool owned_ = true;
};

// Scratch carved inside a scope is released at its end (layers use the run's scratch arena).
class DeviceArenaScope {
 public:
  explicit DeviceArenaScope(DeviceArena& a) : arena_(a), mark_(a.used()) {}
  ~DeviceArenaScope() { arena_.rewind(mark_); }
  DeviceArenaScope(const DeviceArenaScope&) = delete;
  DeviceArenaScope& operator=(const DeviceArenaScope&) = delete;

 private:
  DeviceArena& arena_;
  size_t mark_;
};

}  // namespace dm::cuda
