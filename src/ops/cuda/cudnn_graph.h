// A thin C++ layer over the cuDNN 9 backend ("graph") API: tensors, matmul / pointwise /
// reduction / reshape operations, an operation graph, the heuristics' engine configs and an
// execution plan. The backend API is C with one descriptor per object and one call per attribute;
// this wraps exactly that and nothing more (no shape inference: every tensor states its dims and
// strides), so a graph reads as the list of operations it is. Used by attention_cudnn.cpp.
//
// Only compiled when CMake found cuDNN (DELTAMOE_HAVE_CUDNN); includes cudnn.h, so only .cpp
// files of the CUDA backend include this header.
#pragma once
#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dm::cuda::cudnn {

// Owns one backend descriptor.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type);
  ~Descriptor();
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values);
  void set_descriptor(cudnnBackendAttributeName_t name, const Descriptor& value);
  void finalize(const char* what);

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// Throws dm::Error with the call, the status and cuDNN's last error message.
void check(cudnnStatus_t status, const char* what);
// "9.19.0" from the loaded library (cudnnGetVersion), not the headers.
std::string library_version();
int64_t library_version_number();

struct TensorSpec {
  std::vector<int64_t> dims, strides;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  bool is_virtual = false;
  bool by_value = false;  // a host scalar passed in the variant pack (dims all 1)
  // Ragged (packed) batch: uid of an int32 [batch + 1, 1, 1, 1] tensor of the element offsets at
  // which the batch entries start (-1: dense, the batch stride applies).
  int64_t ragged_offset = -1;
};

// Builds one operation graph. Tensors get unique ids in creation order (returned by tensor());
// operations are kept in the order added, which must be a topological order.
class GraphBuilder {
 public:
  int64_t tensor(const TensorSpec& spec);
  // Shorthands: a virtual fp32 intermediate, and a by-value fp32 / int32 scalar.
  int64_t intermediate(std::vector<int64_t> dims, std::vector<int64_t> strides,
                       cudnnDataType_t type = CUDNN_DATA_FLOAT);
  int64_t scalar(cudnnDataType_t type = CUDNN_DATA_FLOAT);

  // c = a·b over the trailing two dims; m/n/k_override: uids of int32 [batch, 1, 1, 1] tensors of
  // per-entry extents (variable-length batches; -1: none).
  void matmul(int64_t a, int64_t b, int64_t c, int64_t m_override = -1, int64_t n_override = -1,
              int64_t k_override = -1);
  // x → y (one input), x, b → y (two) or x, b, t → y (three: BINARY_SELECT picks x where t else b).
  void pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b = -1, int64_t t = -1,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1);
  void reduction(cudnnReduceTensorOp_t op, int64_t x, int64_t y);
  void reshape(int64_t x, int64_t y);

  const TensorSpec& spec(int64_t uid) const { return specs_.at(size_t(uid - kFirstUid)); }
  size_t num_tensors() const { return specs_.size(); }
  static constexpr int64_t kFirstUid = 1;

  // The graph, finalized against `handle`; the heuristics' engine configs (mode A, then the
  // fallback list) are tried in order and the first that finalizes becomes the plan.
  // Returns nullptr with `why` filled when no engine takes the graph.
  struct Plan;
  std::unique_ptr<Plan> build(cudnnHandle_t handle, std::string* why) const;

 private:
  const Descriptor& desc(int64_t uid) const { return *tensors_.at(size_t(uid - kFirstUid)); }
  std::vector<TensorSpec> specs_;
  std::vector<std::unique_ptr<Descriptor>> tensors_;
  std::vector<std::unique_ptr<Descriptor>> ops_;
  std::vector<std::unique_ptr<Descriptor>> op_parts_;  // matmul / pointwise / reduction settings
};

struct GraphBuilder::Plan {
  std::unique_ptr<Descriptor> plan;
  int64_t workspace_bytes = 0;
  std::string engine;  // "engine 7 (heuristics A #0)", for logs
  // Runs the plan: uids[i] ↔ pointers[i] (device pointers, or host pointers to by-value scalars).
  void execute(cudnnHandle_t handle, const std::vector<int64_t>& uids,
               const std::vector<void*>& pointers, void* workspace) const;
};

}  // namespace dm::cuda::cudnn
