// StreamMarks (stream_marks.h): one timing cudaEvent per mark.
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/stream_marks.h"

namespace dm::cuda {

StreamMarks::StreamMarks(int count) : count_(count) {
  DM_CHECK(count >= 0, "StreamMarks: negative count ", count);
  events_ = new void*[size_t(count)]();
  for (int i = 0; i < count; ++i) {
    cudaEvent_t e = nullptr;
    DM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
    events_[i] = e;
  }
}

StreamMarks::~StreamMarks() {
  for (int i = 0; i < count_; ++i)
    if (events_[i]) cudaEventDestroy(static_cast<cudaEvent_t>(events_[i]));
  delete[] events_;
}

void StreamMarks::record(int i, CUstream_st* stream) {
  DM_CHECK(i >= 0 && i < count_, "StreamMarks: mark ", i, " of ", count_);
  // During stream capture a plain record only orders the graph's nodes (no record node, nothing
  // to time); the external flag makes it a record node, stamped each time the graph replays.
  // Outside capture the flag is refused ("cannot be performed in the present state", CUDA 13.0
  // on the H200), so it is passed only while capturing.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const auto e = static_cast<cudaEvent_t>(events_[i]);
  if (capture == cudaStreamCaptureStatusActive)
    DM_CUDA_CHECK(cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal));
  else
    DM_CUDA_CHECK(cudaEventRecord(e, stream));
}

float StreamMarks::elapsed_ms(int from, int to) const {
  DM_CHECK(from >= 0 && from < count_ && to >= 0 && to < count_, "StreamMarks: marks ", from, ", ",
           to, " of ", count_);
  float ms = 0.0f;
  DM_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[from]),
                                     static_cast<cudaEvent_t>(events_[to])));
  return ms;
}

}  // namespace dm::cuda
