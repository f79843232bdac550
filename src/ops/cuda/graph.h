// What replaying a fixed sequence of launches needs (the decode step, model/cuda/decode_gpu.h):
// a stream of one's own, page-locked host buffers for the per-replay uploads and downloads, and a
// captured, instantiated CUDA graph. Plain C++ (no CUDA headers); implemented in graph.cu.
//
// Capture rules the captured code must follow (else capture_end reports failure): every launch
// and copy on the capturing stream; nothing synchronises (no cudaMemcpy / cudaMemset without
// Async, no stream or device synchronisation); nothing on the legacy default stream; no device
// allocation. Every pointer a captured launch receives is baked into the graph, so buffers must
// sit at the same addresses on every replay; data that changes between replays (token ids, slot
// indices, lengths) must be READ from device memory by the kernels, and uploaded before the
// replay (cudaMemcpyAsync from a PinnedBuffer on the same stream).
#pragma once
#include <cstddef>
#include <string>

struct CUstream_st;
struct CUgraphExec_st;

namespace dm::cuda {

// A stream created with cudaStreamNonBlocking: stream capture needs a stream other than the
// legacy default one, and a non-blocking stream keeps other threads' legacy-stream work from
// joining (and invalidating) a capture. Work on it is NOT ordered with the legacy default stream:
// synchronise one before using the other.
class OwnedStream {
 public:
  OwnedStream();
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  CUstream_st* get() const { return stream_; }

 private:
  CUstream_st* stream_ = nullptr;
};

// Page-locked host memory (cudaMallocHost): async copies to and from it are truly asynchronous,
// so the caller must not touch it until the stream has passed the copy.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// One captured graph, instantiated once and launched any number of times.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  // Starts a thread-local capture on `stream` (cudaStreamCaptureModeThreadLocal): what this
  // thread queues there until capture_end goes into the graph instead of running.
  static void capture_begin(CUstream_st* stream);
  // Ends the capture and instantiates. False when the capture was invalidated (an operation not
  // allowed while capturing) or instantiation failed: nothing of the captured work ran, `why`
  // says what failed, the CUDA error is cleared and the object stays empty.
  bool capture_end(CUstream_st* stream, std::string* why);
  // Ends a capture an exception interrupted, discarding it (no-op when `stream` is not
  // capturing); clears the CUDA error.
  static void capture_abort(CUstream_st* stream);
  bool ready() const { return exec_ != nullptr; }
  void launch(CUstream_st* stream) const;

 private:
  CUgraphExec_st* exec_ = nullptr;
};

}  // namespace dm::cuda
