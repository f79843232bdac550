// Streams, pinned buffers and captured graphs (graph.h).
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/graph.h"

namespace dm::cuda {

OwnedStream::OwnedStream() {
  cudaStream_t s = nullptr;
  DM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

OwnedStream::~OwnedStream() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes_ > 0) DM_CUDA_CHECK(cudaMallocHost(&data_, bytes_));
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

CapturedGraph::~CapturedGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
}

void CapturedGraph::capture_begin(CUstream_st* stream) {
  DM_CHECK(stream != nullptr, "CapturedGraph: capture needs a stream other than the default one");
  DM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
}

bool CapturedGraph::capture_end(CUstream_st* stream, std::string* why) {
  DM_CHECK(exec_ == nullptr, "CapturedGraph: already holds a graph");
  cudaGraph_t graph = nullptr;
  cudaError_t status = cudaStreamEndCapture(stream, &graph);
  if (status != cudaSuccess || graph == nullptr) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    if (why) *why = str_cat("stream capture: ", cudaGetErrorString(status));
    return false;
  }
  cudaGraphExec_t exec = nullptr;
  status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = str_cat("cudaGraphInstantiate: ", cudaGetErrorString(status));
    return false;
  }
  exec_ = exec;
  return true;
}

void CapturedGraph::capture_abort(CUstream_st* stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
      capturing != cudaStreamCaptureStatusNone) {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
  }
  cudaGetLastError();
}

void CapturedGraph::launch(CUstream_st* stream) const {
  DM_CHECK(exec_ != nullptr, "CapturedGraph::launch: nothing captured");
  DM_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

}  // namespace dm::cuda
