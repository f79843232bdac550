// Timestamps on a stream, as plain C++ (no CUDA headers; implemented in stream_marks.cu):
// `count` timing events, recorded directly or inside a CUDA graph capture (each replay records
// them again), read back as the device time between two of them once the stream has passed the
// later one. For phase profiles of graphed steps, where synchronising around a phase would
// change what is measured (GpuDecoder's DM_DECODE_PROFILE).
#pragma once

struct CUstream_st;

namespace dm::cuda {

class StreamMarks {
 public:
  explicit StreamMarks(int count);
  ~StreamMarks();
  StreamMarks(const StreamMarks&) = delete;
  StreamMarks& operator=(const StreamMarks&) = delete;
  int size() const { return count_; }
  void record(int i, CUstream_st* stream);
  // Milliseconds from mark `from` to mark `to` (both recorded, the stream past `to`).
  float elapsed_ms(int from, int to) const;

 private:
  int count_ = 0;
  void** events_ = nullptr;  // cudaEvent_t
};

}  // namespace dm::cuda
