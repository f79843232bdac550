// Causal attention as cuDNN backend graphs (attention_cudnn.h).
//
// Layout: our q [B,T,H,D] rows are cuDNN's [B,H,T,D] tensors with strides {T·H·D, D, H·D, 1}
// (no copy). The graphs follow the operation sequence cuDNN's fused attention engines
// recognise (the one the cuDNN frontend's SDPA node emits; written here against the backend
// API, in our own code):
//   forward   S = Q·Kᵀ → ·scale → where(row ≥ col, S, −inf) → m = rowmax → e = exp(S − m)
//             → l = rowsum(e) → lse = m + log l (out) → P = e / l → O = P·V (out)
//   backward  Δ = rowsum(dO ⊙ O) (fp32 scratch);  P = exp(where(row ≥ col, S·scale − lse, −inf));
//             dV = Pᵀ·dO;  dS = P ⊙ (dO·Vᵀ − Δ) · scale;  dK = dSᵀ·Q;
//             dQ = dS·K into an fp32 scratch accumulator, then copied (identity) to bf16 dQ.
// Every T×T tensor is virtual: the fused kernel never writes one.
#include "ops/cuda/attention_cudnn.h"

#include <cstring>

#include "core/error.h"
#include "ops/cpu/attention.h"

#if DELTAMOE_HAVE_CUDNN
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "ops/cuda/cudnn_graph.h"
#endif

namespace dm::cuda {

#if DELTAMOE_HAVE_CUDNN
namespace {

using cudnn::GraphBuilder;
using cudnn::TensorSpec;

struct PlanKey {
  bool backward;
  int device;
  int64_t B, T, H, Dqk, Dv;
  float scale;
  auto tie() const { return std::tie(backward, device, B, T, H, Dqk, Dv, scale); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

// Unique ids of the graph's real (non-virtual) tensors, in variant-pack order.
struct Ports {
  int64_t q = -1, k = -1, v = -1, o = -1, lse = -1, dout = -1, dq = -1, dk = -1, dv = -1;
  int64_t scale = -1, neg_inf = -1, one = -1, row_sum = -1, dq_accum = -1;
};

struct CachedPlan {
  std::unique_ptr<GraphBuilder> graph;  // keeps the tensor / op descriptors alive
  std::unique_ptr<GraphBuilder::Plan> plan;
  Ports ports;
  size_t scratch_bytes = 0;  // fp32 scratch after cuDNN's workspace (Δ, dQ accumulator, lse)
  std::string why;           // non-empty: no engine takes this problem (cached too)
};

struct State {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;
  std::map<PlanKey, CachedPlan> plans;
  std::map<PlanKey, int> requests;  // calls per shape without a plan yet (build_after)
  void* buffer = nullptr;
  size_t buffer_bytes = 0;
};

State& state() {
  static State* s = new State();  // never destroyed: handles outlive static destructors
  return *s;
}

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// cuDNN's view of one of our [B,T,H,D] bf16 buffers as [B,H,T,D], or transposed [B,H,D,T].
TensorSpec bshd(const AttnShape& s, int64_t D, bool transposed = false) {
  const int64_t batch = s.T * s.H * D, head = D, row = s.H * D;
  if (transposed) return TensorSpec{{s.B, s.H, D, s.T}, {batch, head, 1, row}, CUDNN_DATA_BFLOAT16};
  return TensorSpec{{s.B, s.H, s.T, D}, {batch, head, row, 1}, CUDNN_DATA_BFLOAT16};
}

TensorSpec row_stats(const AttnShape& s) {
  return TensorSpec{{s.B, s.H, s.T, 1}, {s.H * s.T, s.T, 1, 1}, CUDNN_DATA_FLOAT};
}

std::vector<int64_t> score_dims(const AttnShape& s) { return {s.B, s.H, s.T, s.T}; }
std::vector<int64_t> score_strides(const AttnShape& s) {
  return {s.H * s.T * s.T, s.T * s.T, s.T, 1};
}

// where(row ≥ col, x, −inf) over the [B,H,T,T] scores x (top-left aligned causal mask).
int64_t causal_mask(GraphBuilder& g, const AttnShape& s, int64_t x, int64_t neg_inf) {
  const auto dims = score_dims(s), strides = score_strides(s);
  const int64_t row = g.intermediate(dims, strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, -1, -1, CUDNN_DATA_FLOAT, 2);
  const int64_t col = g.intermediate(dims, strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, -1, -1, CUDNN_DATA_FLOAT, 3);
  const int64_t keep = g.intermediate(dims, strides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, -1, CUDNN_DATA_BOOLEAN);
  const int64_t masked = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, masked, neg_inf, keep);
  return masked;
}

void forward_graph(GraphBuilder& g, Ports& p, const AttnShape& s) {
  const auto dims = score_dims(s), strides = score_strides(s);
  const TensorSpec stats = row_stats(s);
  p.q = g.tensor(bshd(s, s.Dqk));
  p.k = g.tensor(bshd(s, s.Dqk, /*transposed=*/true));
  p.v = g.tensor(bshd(s, s.Dv));
  p.scale = g.scalar();
  p.neg_inf = g.scalar();
  const int64_t scores = g.intermediate(dims, strides);
  g.matmul(p.q, p.k, scores);
  const int64_t scaled = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, p.scale);
  const int64_t masked = causal_mask(g, s, scaled, p.neg_inf);
  const int64_t row_max = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  const int64_t shifted = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_SUB, masked, shifted, row_max);
  const int64_t e = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, e);
  const int64_t row_sum = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  const int64_t log_sum = g.intermediate(stats.dims, stats.strides);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, log_sum);
  p.lse = g.tensor(stats);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, p.lse, log_sum);
  // The engines take P·V with both operands in the I/O type: P is rounded to bf16 (as ours).
  const int64_t probs = g.intermediate(dims, strides, CUDNN_DATA_BFLOAT16);
  g.pointwise(CUDNN_POINTWISE_DIV, e, probs, row_sum);
  p.o = g.tensor(bshd(s, s.Dv));
  g.matmul(probs, p.v, p.o);
}

// key_view_type: the data type of the virtual K view (reshape of Kᵀ) that dQ = dS·K reads; the
// cuDNN frontend leaves it fp32 (its virtual default), bf16 is the fallback variant.
void backward_graph(GraphBuilder& g, Ports& p, const AttnShape& s, cudnnDataType_t key_view_type) {
  const auto dims = score_dims(s), strides = score_strides(s);
  const std::vector<int64_t> transposed_strides = {s.H * s.T * s.T, s.T * s.T, 1, s.T};
  const TensorSpec stats = row_stats(s);
  p.q = g.tensor(bshd(s, s.Dqk));
  p.k = g.tensor(bshd(s, s.Dqk, /*transposed=*/true));
  p.v = g.tensor(bshd(s, s.Dv, /*transposed=*/true));
  p.o = g.tensor(bshd(s, s.Dv));
  p.dout = g.tensor(bshd(s, s.Dv));
  p.lse = g.tensor(stats);
  p.scale = g.scalar();
  p.neg_inf = g.scalar();
  p.one = g.scalar();

  // Δ = rowsum(dO ⊙ O), kept in fp32 scratch.
  const int64_t dout_o = g.intermediate({s.B, s.H, s.T, s.Dv},
                                        {s.H * s.T * s.Dv, s.T * s.Dv, s.H * s.Dv, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, p.dout, dout_o, p.o);
  const int64_t delta = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dout_o, delta);
  p.row_sum = g.tensor(stats);
  g.pointwise(CUDNN_POINTWISE_MUL, delta, p.row_sum, p.one);

  // P = exp(mask(S·scale − lse)).
  const int64_t scores = g.intermediate(dims, strides);
  g.matmul(p.q, p.k, scores);
  const int64_t scaled = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, p.scale);
  const int64_t centred = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, centred, p.lse);
  const int64_t masked = causal_mask(g, s, centred, p.neg_inf);
  const int64_t probs = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, probs);

  // dV = Pᵀ·dO.
  const int64_t probs_t = g.intermediate(dims, transposed_strides, CUDNN_DATA_BFLOAT16);
  g.reshape(probs, probs_t);
  p.dv = g.tensor(bshd(s, s.Dv));
  g.matmul(probs_t, p.dout, p.dv);

  // dS = P ⊙ (dO·Vᵀ − Δ) · scale.
  const int64_t dprobs = g.intermediate(dims, strides);
  g.matmul(p.dout, p.v, dprobs);
  const int64_t dprobs_centred = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_SUB, dprobs, dprobs_centred, p.row_sum);
  const int64_t dscores_unscaled = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dprobs_centred, dscores_unscaled, probs);
  const int64_t dscores = g.intermediate(dims, strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dscores_unscaled, dscores, p.scale);

  // dK = dSᵀ·Q.
  const int64_t dscores_t = g.intermediate(dims, transposed_strides, CUDNN_DATA_BFLOAT16);
  g.reshape(dscores, dscores_t);
  p.dk = g.tensor(bshd(s, s.Dqk));
  g.matmul(dscores_t, p.q, p.dk);

  // dQ = dS·K through an fp32 accumulator.
  const TensorSpec kt = bshd(s, s.Dqk, true);
  const int64_t key_view = g.intermediate({s.B, s.H, s.T, s.Dqk},
                                          {kt.strides[0], kt.strides[1], kt.strides[3],
                                           kt.strides[2]},
                                          key_view_type);
  g.reshape(p.k, key_view);
  p.dq_accum = g.tensor(TensorSpec{{s.B, s.H, s.T, s.Dqk},
                                   {s.H * s.T * s.Dqk, s.T * s.Dqk, s.Dqk, 1},
                                   CUDNN_DATA_FLOAT});
  g.matmul(dscores, key_view, p.dq_accum);
  p.dq = g.tensor(bshd(s, s.Dqk));
  g.pointwise(CUDNN_POINTWISE_IDENTITY, p.dq_accum, p.dq);
}

cudnnHandle_t handle_for(State& st, int device, std::string* why) {
  auto it = st.handles.find(device);
  if (it != st.handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t status = cudnnCreate(&h);
  if (status != CUDNN_STATUS_SUCCESS) {
    if (why) *why = str_cat("cudnnCreate: ", cudnnGetErrorString(status));
    return nullptr;
  }
  st.handles[device] = h;
  return h;
}

bool stream_capturing(CUstream_st* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status) != cudaSuccess)
    return true;  // be conservative: no allocation or plan building
  return status != cudaStreamCaptureStatusNone;
}

bool debug_log() {
  static const bool on = [] {
    const char* e = std::getenv("DM_CUDNN_DEBUG");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}

// The cached plan for the problem, building it on first use (not while capturing).
CachedPlan* plan_for(State& st, cudnnHandle_t handle, const PlanKey& key, const AttnShape& s,
                     bool capturing, int build_after, std::string* why) {
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    if (capturing) {
      if (why) *why = "no cached cuDNN plan and the stream is being captured";
      return nullptr;
    }
    const int seen = ++st.requests[key];
    if (seen < build_after) {
      if (why) *why = str_cat("shape requested ", seen, " time(s); its plan is built at ", build_after);
      return nullptr;
    }
    if (st.plans.size() >= size_t(kAttentionCudnnMaxPlans)) {
      if (why) *why = str_cat("the cuDNN plan cache is full (", kAttentionCudnnMaxPlans, " shapes)");
      return nullptr;
    }
    st.requests.erase(key);
    CachedPlan entry;
    const std::vector<cudnnDataType_t> variants =
        key.backward ? std::vector<cudnnDataType_t>{CUDNN_DATA_FLOAT, CUDNN_DATA_BFLOAT16}
                     : std::vector<cudnnDataType_t>{CUDNN_DATA_FLOAT};
    std::string reasons;
    for (cudnnDataType_t variant : variants) {
      auto graph = std::make_unique<GraphBuilder>();
      Ports ports;
      std::string reason;
      try {
        if (key.backward)
          backward_graph(*graph, ports, s, variant);
        else
          forward_graph(*graph, ports, s);
        entry.plan = graph->build(handle, &reason);
      } catch (const Error& e) {
        reason = e.what();
      }
      if (entry.plan) {
        entry.graph = std::move(graph);
        entry.ports = ports;
        break;
      }
      reasons += str_cat(reasons.empty() ? "" : "; ", reason);
    }
    if (!entry.plan) entry.why = reasons;
    const size_t rows = size_t(s.B * s.H * s.T) * sizeof(float);
    entry.scratch_bytes = key.backward
                              ? align256(rows) + align256(size_t(s.B * s.H * s.T * s.Dqk) * 4)
                              : align256(rows);  // forward: lse when the caller passes none
    if (debug_log())
      std::fprintf(stderr, "[deltamoe cudnn] %s B=%lld T=%lld H=%lld Dqk=%lld Dv=%lld: %s\n",
                   key.backward ? "backward" : "forward", (long long)s.B, (long long)s.T,
                   (long long)s.H, (long long)s.Dqk, (long long)s.Dv,
                   entry.plan ? str_cat(entry.plan->engine, ", workspace ",
                                        entry.plan->workspace_bytes, " B").c_str()
                              : entry.why.c_str());
    it = st.plans.emplace(key, std::move(entry)).first;
  }
  if (!it->second.plan) {
    if (why) *why = it->second.why;
    return nullptr;
  }
  return &it->second;
}

// Device scratch of at least `bytes`, grown (never while capturing) when too small.
void* scratch(State& st, size_t bytes, bool capturing, std::string* why) {
  if (bytes <= st.buffer_bytes) return st.buffer;
  if (capturing) {
    if (why) *why = "cuDNN scratch must grow while the stream is being captured";
    return nullptr;
  }
  // Earlier work (any stream) may still read the old buffer.
  if (st.buffer) {
    if (cudaDeviceSynchronize() != cudaSuccess || cudaFree(st.buffer) != cudaSuccess)
      throw Error("cudnn attention: freeing the old scratch buffer failed");
    st.buffer = nullptr;
    st.buffer_bytes = 0;
  }
  const size_t grown = align256(bytes + bytes / 8);
  if (cudaMalloc(&st.buffer, grown) != cudaSuccess) {
    cudaGetLastError();
    st.buffer = nullptr;
    if (why) *why = str_cat("cudaMalloc of ", grown, " bytes of cuDNN scratch failed");
    return nullptr;
  }
  st.buffer_bytes = grown;
  return st.buffer;
}

struct Session {
  std::unique_lock<std::mutex> lock;
  cudnnHandle_t handle = nullptr;
  CachedPlan* plan = nullptr;
  char* workspace = nullptr;  // cuDNN workspace, then the fp32 scratch
};

bool open_session(Session& ses, bool backward, const AttnShape& s, double scale,
                  CUstream_st* stream, int build_after, std::string* why) {
  State& st = state();
  ses.lock = std::unique_lock<std::mutex>(st.mu);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    if (why) *why = "cudaGetDevice failed";
    return false;
  }
  ses.handle = handle_for(st, device, why);
  if (!ses.handle) return false;
  const bool capturing = stream_capturing(stream);
  const PlanKey key{backward, device, s.B, s.T, s.H, s.Dqk, s.Dv, float(scale)};
  ses.plan = plan_for(st, ses.handle, key, s, capturing, build_after, why);
  if (!ses.plan) return false;
  const size_t ws = align256(size_t(ses.plan->plan->workspace_bytes));
  ses.workspace = static_cast<char*>(scratch(st, ws + ses.plan->scratch_bytes, capturing, why));
  if (!ses.workspace) return false;
  cudnn::check(cudnnSetStream(ses.handle, reinterpret_cast<cudaStream_t>(stream)),
               "cudnnSetStream");
  return true;
}

float negative_infinity() {
  // cuDNN before 9.1 wanted the lowest finite float as the masked value.
  return cudnn::library_version_number() < 90100 ? std::numeric_limits<float>::lowest()
                                                 : -std::numeric_limits<float>::infinity();
}

}  // namespace

bool cudnn_attention_available() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return handle_for(st, device, nullptr) != nullptr;
}

std::string cudnn_attention_status() {
  if (!cudnn_attention_available()) return "cuDNN unavailable (no handle on this device)";
  return "cuDNN " + cudnn::library_version();
}

bool cudnn_attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o,
                             float* lse, const AttnShape& s, double scale, CUstream_st* stream,
                             std::string* why, int build_after) {
  Session ses;
  if (!open_session(ses, false, s, scale, stream, build_after, why)) return false;
  const Ports& p = ses.plan->ports;
  float scale_value = float(scale), neg_inf = negative_infinity();
  char* extra = ses.workspace + align256(size_t(ses.plan->plan->workspace_bytes));
  float* stats = lse ? lse : reinterpret_cast<float*>(extra);
  ses.plan->plan->execute(
      ses.handle, {p.q, p.k, p.v, p.o, p.lse, p.scale, p.neg_inf},
      {const_cast<uint16_t*>(q), const_cast<uint16_t*>(k), const_cast<uint16_t*>(v), o, stats,
       &scale_value, &neg_inf},
      ses.workspace);
  return true;
}

bool cudnn_attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const uint16_t* o, const float* lse, const uint16_t* dout,
                              uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                              double scale, CUstream_st* stream, std::string* why,
                              int build_after) {
  Session ses;
  if (!open_session(ses, true, s, scale, stream, build_after, why)) return false;
  const Ports& p = ses.plan->ports;
  float scale_value = float(scale), neg_inf = negative_infinity(), one = 1.0f;
  char* extra = ses.workspace + align256(size_t(ses.plan->plan->workspace_bytes));
  float* row_sum = reinterpret_cast<float*>(extra);
  float* dq_accum =
      reinterpret_cast<float*>(extra + align256(size_t(s.B * s.H * s.T) * sizeof(float)));
  if (cudnn::library_version_number() < 90600)  // later versions zero it themselves
    cudaMemsetAsync(dq_accum, 0, size_t(s.B * s.H * s.T * s.Dqk) * sizeof(float),
                    reinterpret_cast<cudaStream_t>(stream));
  auto in = [](const void* ptr) { return const_cast<void*>(ptr); };
  ses.plan->plan->execute(ses.handle,
                          {p.q, p.k, p.v, p.o, p.dout, p.lse, p.scale, p.neg_inf, p.one,
                           p.row_sum, p.dq_accum, p.dq, p.dk, p.dv},
                          {in(q), in(k), in(v), in(o), in(dout), in(lse), &scale_value, &neg_inf,
                           &one, row_sum, dq_accum, dq, dk, dv},
                          ses.workspace);
  return true;
}

std::string cudnn_attention_engine(bool backward, const AttnShape& s, double scale) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "";
  auto it = st.plans.find(PlanKey{backward, device, s.B, s.T, s.H, s.Dqk, s.Dv, float(scale)});
  return it != st.plans.end() && it->second.plan ? it->second.plan->engine : "";
}

#else  // !DELTAMOE_HAVE_CUDNN

bool cudnn_attention_available() { return false; }
std::string cudnn_attention_status() { return "built without cuDNN"; }

bool cudnn_attention_forward(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, float*,
                             const AttnShape&, double, CUstream_st*, std::string* why, int) {
  if (why) *why = "built without cuDNN";
  return false;
}

bool cudnn_attention_backward(const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*,
                              const float*, const uint16_t*, uint16_t*, uint16_t*, uint16_t*,
                              const AttnShape&, double, CUstream_st*, std::string* why, int) {
  if (why) *why = "built without cuDNN";
  return false;
}

std::string cudnn_attention_engine(bool, const AttnShape&, double) { return ""; }

#endif  // DELTAMOE_HAVE_CUDNN

}  // namespace dm::cuda
