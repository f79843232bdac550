// Kernel timeline of any CUDA program, from the GPU's own timestamps (CUPTI activity records),
// loaded by the CUDA driver as an injection library, so the program itself is not changed:
//
//   DM_KERNEL_TRACE=trace.csv CUDA_INJECTION64_PATH=build/bin/libdm_kernel_trace.so PROGRAM ...
//   scripts/kernel-trace.py trace.csv --step-start prepare_rows_kernel
//
// One CSV row per kernel execution, graph nodes included: start and end (ns), stream, graph node,
// grid, block, name (demangled, arguments cut). Why: Nsight Compute runs each kernel alone with
// cold caches, and Nsight Systems is not on the device image; inside a graphed decode step with
// programmatic dependent launch the kernels overlap, and what a kernel costs the step is how far
// it moves the stream's last end (kernel-trace.py's "exposed" column), which only a timeline
// shows.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;
std::FILE* g_out = nullptr;
std::mutex g_mutex;

void check(CUptiResult status, const char* what) {
  if (status == CUPTI_SUCCESS) return;
  const char* message = nullptr;
  cuptiGetResultString(status, &message);
  std::fprintf(stderr, "kernel_trace: %s: %s\n", what, message ? message : "unknown error");
}

// "void ns::kernel<1, 2>(const float*, int)" -> "ns::kernel<1, 2>"
std::string short_name(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  if (name.rfind("void ", 0) == 0) name = name.substr(5);
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = name.find(anonymous)) != std::string::npos;) name.erase(at, anonymous.size());
  int depth = 0;  // cut at the argument list: the first '(' outside template brackets
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0 && i > 0) {
      name.resize(i);
      break;
    }
  }
  for (char& c : name)
    if (c == ',') c = ';';  // the CSV's separator
  return name;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* record = nullptr;
  while (g_out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
        record->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    std::fprintf(g_out, "%llu,%llu,%u,%llu,%dx%dx%d,%dx%dx%d,%s\n",
                 static_cast<unsigned long long>(k->start), static_cast<unsigned long long>(k->end),
                 k->streamId, static_cast<unsigned long long>(k->graphNodeId), k->gridX, k->gridY,
                 k->gridZ, k->blockX, k->blockY, k->blockZ, short_name(k->name).c_str());
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection() {
  const char* path = std::getenv("DM_KERNEL_TRACE");
  g_out = std::fopen(path && *path ? path : "kernel_trace.csv", "w");
  if (!g_out) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path ? path : "kernel_trace.csv");
    return 0;
  }
  std::fprintf(g_out, "start_ns,end_ns,stream,graph_node,grid,block,name\n");
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
  std::atexit(finish);
  return 1;
}
