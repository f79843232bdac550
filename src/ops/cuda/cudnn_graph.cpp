// cuDNN backend API wrapper (cudnn_graph.h). Compiled only with cuDNN (DELTAMOE_HAVE_CUDNN).
#if DELTAMOE_HAVE_CUDNN
#include "ops/cuda/cudnn_graph.h"

#include <algorithm>

#include "core/error.h"

namespace dm::cuda::cudnn {

void check(cudnnStatus_t status, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  throw Error(str_cat("cuDNN: ", what, ": ", cudnnGetErrorString(status),
                      last[0] ? " (" : "", last, last[0] ? ")" : ""));
}

int64_t library_version_number() { return int64_t(cudnnGetVersion()); }

std::string library_version() {
  const int64_t v = library_version_number();  // major·10000 + minor·100 + patch (cuDNN 9)
  return str_cat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

Descriptor::Descriptor(cudnnBackendDescriptorType_t type) {
  check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
}

Descriptor::~Descriptor() {
  if (d_) cudnnBackendDestroyDescriptor(d_);
}

void Descriptor::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                     int64_t count, const void* values) {
  check(cudnnBackendSetAttribute(d_, name, type, count, values), "cudnnBackendSetAttribute");
}

void Descriptor::set_descriptor(cudnnBackendAttributeName_t name, const Descriptor& value) {
  cudnnBackendDescriptor_t raw = value.get();
  set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
}

void Descriptor::finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }

int64_t GraphBuilder::tensor(const TensorSpec& s) {
  DM_CHECK(!s.dims.empty() && s.dims.size() == s.strides.size(), "cudnn tensor: ",
           s.dims.size(), " dims but ", s.strides.size(), " strides");
  const int64_t uid = kFirstUid + int64_t(specs_.size());
  auto d = std::make_unique<Descriptor>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t alignment = 16;
  d->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &s.type);
  d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, int64_t(s.dims.size()), s.dims.data());
  d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, int64_t(s.strides.size()),
         s.strides.data());
  d->set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  d->set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  const bool is_virtual = s.is_virtual, by_value = s.by_value;
  d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
  if (by_value) d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
  if (s.ragged_offset >= 0)
    d->set_descriptor(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, desc(s.ragged_offset));
  d->finalize("tensor descriptor");
  specs_.push_back(s);
  tensors_.push_back(std::move(d));
  return uid;
}

int64_t GraphBuilder::intermediate(std::vector<int64_t> dims, std::vector<int64_t> strides,
                                   cudnnDataType_t type) {
  return tensor(TensorSpec{std::move(dims), std::move(strides), type, true, false});
}

int64_t GraphBuilder::scalar(cudnnDataType_t type) {
  return tensor(TensorSpec{{1, 1, 1, 1}, {1, 1, 1, 1}, type, false, true});
}

void GraphBuilder::matmul(int64_t a, int64_t b, int64_t c, int64_t m_override,
                          int64_t n_override, int64_t k_override) {
  auto m = std::make_unique<Descriptor>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  m->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  m->finalize("matmul descriptor");
  auto op = std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_ADESC, desc(a));
  op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_BDESC, desc(b));
  op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_CDESC, desc(c));
  op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_DESC, *m);
  if (m_override >= 0)
    op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, desc(m_override));
  if (n_override >= 0)
    op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, desc(n_override));
  if (k_override >= 0)
    op->set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, desc(k_override));
  op->finalize("matmul operation");
  op_parts_.push_back(std::move(m));
  ops_.push_back(std::move(op));
}

void GraphBuilder::pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b,
                             int64_t t, cudnnDataType_t math, int64_t axis) {
  auto p = std::make_unique<Descriptor>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  p->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  p->set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
  if (mode == CUDNN_POINTWISE_GEN_INDEX)
    p->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
  p->finalize("pointwise descriptor");
  auto op = std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  op->set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *p);
  op->set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, desc(x));
  if (b >= 0) op->set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, desc(b));
  if (t >= 0) op->set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, desc(t));
  op->set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, desc(y));
  const float one = 1.0f;
  op->set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
  op->set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
  op->finalize("pointwise operation");
  op_parts_.push_back(std::move(p));
  ops_.push_back(std::move(op));
}

void GraphBuilder::reduction(cudnnReduceTensorOp_t reduce, int64_t x, int64_t y) {
  auto r = std::make_unique<Descriptor>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  r->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce);
  r->finalize("reduction descriptor");
  auto op = std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  op->set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *r);
  op->set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, desc(x));
  op->set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, desc(y));
  op->finalize("reduction operation");
  op_parts_.push_back(std::move(r));
  ops_.push_back(std::move(op));
}

void GraphBuilder::reshape(int64_t x, int64_t y) {
  auto op = std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  op->set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, desc(x));
  op->set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, desc(y));
  op->finalize("reshape operation");
  ops_.push_back(std::move(op));
}

namespace {

// The engine configs one heuristics mode proposes for `graph` (possibly none).
std::vector<std::unique_ptr<Descriptor>> engine_configs(const Descriptor& graph,
                                                        cudnnBackendHeurMode_t mode) {
  std::vector<std::unique_ptr<Descriptor>> configs;
  Descriptor heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_descriptor(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) return configs;
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr) !=
          CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()) !=
      CUDNN_STATUS_SUCCESS)
    got = 0;
  configs.resize(size_t(std::max<int64_t>(0, std::min(got, count))));
  return configs;
}

int64_t engine_index(const Descriptor& config) {
  Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t n = 0, index = -1;
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw) ==
      CUDNN_STATUS_SUCCESS)
    cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                             &n, &index);
  return index;
}

}  // namespace

std::unique_ptr<GraphBuilder::Plan> GraphBuilder::build(cudnnHandle_t handle,
                                                         std::string* why) const {
  Descriptor graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const auto& op : ops_) ops.push_back(op->get());
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops.size()),
            ops.data());
  const cudnnStatus_t graph_status = cudnnBackendFinalize(graph.get());
  if (graph_status != CUDNN_STATUS_SUCCESS) {
    char last[1024] = {0};
    cudnnGetLastErrorString(last, sizeof(last));
    if (why) *why = str_cat("operation graph: ", cudnnGetErrorString(graph_status), " ", last);
    return nullptr;
  }
  std::string tried;
  for (auto [mode, name] : {std::pair{CUDNN_HEUR_MODE_A, "A"},
                            std::pair{CUDNN_HEUR_MODE_FALLBACK, "fallback"}}) {
    const auto configs = engine_configs(graph, mode);
    tried += str_cat(tried.empty() ? "" : ", ", configs.size(), " from heuristics ", name);
    for (size_t i = 0; i < configs.size(); ++i) {
      auto plan = std::make_unique<Plan>();
      plan->plan = std::make_unique<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      plan->plan->set_descriptor(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *configs[i]);
      if (cudnnBackendFinalize(plan->plan->get()) != CUDNN_STATUS_SUCCESS) continue;
      int64_t n = 0;
      check(cudnnBackendGetAttribute(plan->plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &n, &plan->workspace_bytes),
            "plan workspace size");
      plan->engine = str_cat("engine ", engine_index(*configs[i]), " (heuristics ", name, " #", i,
                             ")");
      return plan;
    }
  }
  if (why) {
    char last[1024] = {0};
    cudnnGetLastErrorString(last, sizeof(last));
    *why = str_cat("no engine finalized (", tried, ") ", last);
  }
  return nullptr;
}

void GraphBuilder::Plan::execute(cudnnHandle_t handle, const std::vector<int64_t>& uids,
                                 const std::vector<void*>& pointers, void* workspace) const {
  DM_CHECK(uids.size() == pointers.size(), "cudnn execute: ", uids.size(), " uids, ",
           pointers.size(), " pointers");
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(pointers.size()),
           pointers.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  check(cudnnBackendExecute(handle, plan->get(), pack.get()), "cudnnBackendExecute");
}

}  // namespace dm::cuda::cudnn
#endif  // DELTAMOE_HAVE_CUDNN
