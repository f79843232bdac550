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
// Every T×T tensor is virtual: the fused kernel never writes one. Packed documents run the
// same graphs over cuDNN's ragged batch, one entry per document, with a padding mask
// (GraphShape); that path has not yet run on a GPU.
#include "ops/cuda/attention_cudnn.h"

#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "ops/cpu/attention.h"

#if DELTAMOE_HAVE_CUDNN
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/cudnn_graph.h"
#endif

namespace dm::cuda {

#if DELTAMOE_HAVE_CUDNN
namespace {

using cudnn::GraphBuilder;
using cudnn::TensorSpec;

// packed: a ragged batch of documents; B and T are then the bucketed document count and the
// bucketed longest document (GraphShape).
struct PlanKey {
  bool backward;
  int device;
  bool packed;
  int64_t B, T, H, Dqk, Dv;
  float scale;
  auto tie() const { return std::tie(backward, device, packed, B, T, H, Dqk, Dv, scale); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

// Unique ids of the graph's real (non-virtual) tensors, in variant-pack order.
struct Ports {
  int64_t q = -1, k = -1, v = -1, o = -1, lse = -1, dout = -1, dq = -1, dk = -1, dv = -1;
  int64_t scale = -1, neg_inf = -1, one = -1, row_sum = -1, dq_accum = -1;
  // Packed documents: per-entry lengths (as both the query and the key extents), the ragged
  // element offsets of the q/k-wide and v-wide tensors, and the padding mask's −inf.
  int64_t seq_q = -1, seq_kv = -1, offset_qk = -1, offset_v = -1, neg_inf_pad = -1;
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

// The problem as cuDNN's batch: b entries of up to S tokens with H heads. Dense: our B rows of
// T tokens (b = B, S = T). Packed: one entry per document (padding entries of length 0) in
// cuDNN's ragged layout: entry i starts at element offset_qk[i] of q, k, dq, dk (and of the fp32
// dQ accumulator, laid out like dq) and at offset_v[i] of v, o, dout, dv; its length bounds the
// products (GEMM M/N/K overrides) and a padding mask (the one the cuDNN frontend builds for
// variable-length batches) ahead of the causal mask. Either way a token's row of a [*, T, H, D]
// buffer is cuDNN's [b, H, S, D] with strides {S·H·D, D, H·D, 1}: no copies.
struct GraphShape {
  int64_t b, S, H, Dqk, Dv;
  bool packed;
};

// Whether the packed backward keeps its fp32 dQ accumulator token-major (THD, sized by the
// tokens) instead of [b, H, S, Dqk] (sized by the bucketed entries, up to ~4× the tokens). The
// cuDNN frontend takes THD only from cuDNN 9.6 on and only when Dqk and Dv are multiples of 16:
// below that the engines have a known functional issue, which our Dqk = 24 test shape hit (dQ
// wrong at 1.27 relative RMS while dK, dV and the forward were right).
bool thd_dq_accumulator(const GraphShape& g) {
  return g.packed && g.Dqk % 16 == 0 && g.Dv % 16 == 0 &&
         cudnn::library_version_number() >= 90600;
}

// One of our bf16 [*, H, D] token buffers as [b, H, S, D], or transposed [b, H, D, S].
TensorSpec rows(const GraphShape& g, const Ports& p, int64_t D, bool transposed = false) {
  const int64_t entry = g.S * g.H * D, head = D, row = g.H * D;
  TensorSpec t = transposed ? TensorSpec{{g.b, g.H, D, g.S}, {entry, head, 1, row}, CUDNN_DATA_BFLOAT16}
                            : TensorSpec{{g.b, g.H, g.S, D}, {entry, head, row, 1}, CUDNN_DATA_BFLOAT16};
  if (g.packed) t.ragged_offset = p.offset_qk;
  return t;
}
// The v-wide buffers (v, o, dout, dv): their own ragged offsets.
TensorSpec v_rows(const GraphShape& g, const Ports& p, bool transposed = false) {
  TensorSpec t = rows(g, p, g.Dv, transposed);
  if (g.packed) t.ragged_offset = p.offset_v;
  return t;
}

// Softmax statistics [b, H, S, 1] fp32 (dense: our lse [B, H, T] itself; packed: a scratch).
TensorSpec row_stats(const GraphShape& g) {
  return TensorSpec{{g.b, g.H, g.S, 1}, {g.H * g.S, g.S, 1, 1}, CUDNN_DATA_FLOAT};
}

TensorSpec entry_ints(int64_t n) {
  return TensorSpec{{n, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32};
}

// The [b, H, S, S] scores.
struct Scores {
  std::vector<int64_t> dims, strides, transposed_strides;
  explicit Scores(const GraphShape& g)
      : dims{g.b, g.H, g.S, g.S},
        strides{g.H * g.S * g.S, g.S * g.S, g.S, 1},
        transposed_strides{g.H * g.S * g.S, g.S * g.S, 1, g.S} {}
};

// where(row ≥ col, x, −inf) over the scores x (top-left aligned causal mask).
int64_t causal_mask(GraphBuilder& g, const Scores& sc, int64_t x, int64_t neg_inf) {
  const int64_t row = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, -1, -1, CUDNN_DATA_FLOAT, 2);
  const int64_t col = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, -1, -1, CUDNN_DATA_FLOAT, 3);
  const int64_t keep = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, -1, CUDNN_DATA_BOOLEAN);
  const int64_t masked = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, masked, neg_inf, keep);
  return masked;
}

// Packed only: where(row < len ∧ col < len, x, −inf), the rows and keys past an entry's length.
int64_t padding_mask(GraphBuilder& g, const Scores& sc, int64_t x, const Ports& p) {
  const int64_t row = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, -1, -1, CUDNN_DATA_INT32, 2);
  const int64_t col = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, -1, -1, CUDNN_DATA_INT32, 3);
  const int64_t row_in = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, row, row_in, p.seq_q, -1, CUDNN_DATA_BOOLEAN);
  const int64_t col_in = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, col, col_in, p.seq_kv, -1, CUDNN_DATA_BOOLEAN);
  const int64_t inside = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_in, inside, col_in, -1, CUDNN_DATA_BOOLEAN);
  const int64_t masked = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, masked, p.neg_inf_pad, inside);
  return masked;
}

// Packed only: the per-entry tensors (offsets, lengths) every packed graph starts with.
void packed_inputs(GraphBuilder& g, Ports& p, const GraphShape& s) {
  if (!s.packed) return;
  p.offset_qk = g.tensor(entry_ints(s.b + 1));
  p.offset_v = g.tensor(entry_ints(s.b + 1));
  p.seq_q = g.tensor(entry_ints(s.b));
  p.seq_kv = g.tensor(entry_ints(s.b));
}

void forward_graph(GraphBuilder& g, Ports& p, const GraphShape& s) {
  const Scores sc(s);
  const TensorSpec stats = row_stats(s);
  packed_inputs(g, p, s);
  p.q = g.tensor(rows(s, p, s.Dqk));
  p.k = g.tensor(rows(s, p, s.Dqk, /*transposed=*/true));
  p.v = g.tensor(v_rows(s, p));
  p.scale = g.scalar();
  p.neg_inf = g.scalar();
  if (s.packed) p.neg_inf_pad = g.scalar();
  const int64_t scores = g.intermediate(sc.dims, sc.strides);
  g.matmul(p.q, p.k, scores, p.seq_q, p.seq_kv);
  const int64_t scaled = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, p.scale);
  const int64_t visible = s.packed ? padding_mask(g, sc, scaled, p) : scaled;
  const int64_t masked = causal_mask(g, sc, visible, p.neg_inf);
  const int64_t row_max = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  const int64_t shifted = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_SUB, masked, shifted, row_max);
  const int64_t e = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, e);
  const int64_t row_sum = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  const int64_t log_sum = g.intermediate(stats.dims, stats.strides);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, log_sum);
  p.lse = g.tensor(stats);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, p.lse, log_sum);
  // The engines take P·V with both operands in the I/O type: P is rounded to bf16 (as ours).
  const int64_t probs = g.intermediate(sc.dims, sc.strides, CUDNN_DATA_BFLOAT16);
  g.pointwise(CUDNN_POINTWISE_DIV, e, probs, row_sum);
  p.o = g.tensor(v_rows(s, p));
  g.matmul(probs, p.v, p.o, p.seq_q, -1, p.seq_kv);
}

// key_view_type: the data type of the virtual K view (reshape of Kᵀ) that dQ = dS·K reads; the
// cuDNN frontend leaves it fp32 (its virtual default), bf16 is the fallback variant.
void backward_graph(GraphBuilder& g, Ports& p, const GraphShape& s, cudnnDataType_t key_view_type) {
  const Scores sc(s);
  const TensorSpec stats = row_stats(s);
  packed_inputs(g, p, s);
  p.q = g.tensor(rows(s, p, s.Dqk));
  p.k = g.tensor(rows(s, p, s.Dqk, /*transposed=*/true));
  p.v = g.tensor(v_rows(s, p, /*transposed=*/true));
  p.o = g.tensor(v_rows(s, p));
  p.dout = g.tensor(v_rows(s, p));
  p.lse = g.tensor(stats);
  p.scale = g.scalar();
  p.neg_inf = g.scalar();
  p.one = g.scalar();
  if (s.packed) p.neg_inf_pad = g.scalar();

  // Δ = rowsum(dO ⊙ O), kept in fp32 scratch.
  const int64_t dout_o = g.intermediate({s.b, s.H, s.S, s.Dv},
                                        {s.H * s.S * s.Dv, s.S * s.Dv, s.H * s.Dv, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, p.dout, dout_o, p.o);
  const int64_t delta = g.intermediate(stats.dims, stats.strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dout_o, delta);
  p.row_sum = g.tensor(stats);
  g.pointwise(CUDNN_POINTWISE_MUL, delta, p.row_sum, p.one);

  // P = exp(causal(pad(S·scale) − lse)).
  const int64_t scores = g.intermediate(sc.dims, sc.strides);
  g.matmul(p.q, p.k, scores, p.seq_q, p.seq_kv);
  const int64_t scaled = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, p.scale);
  const int64_t visible = s.packed ? padding_mask(g, sc, scaled, p) : scaled;
  const int64_t centred = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_SUB, visible, centred, p.lse);
  const int64_t masked = causal_mask(g, sc, centred, p.neg_inf);
  const int64_t probs = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, probs);

  // dV = Pᵀ·dO.
  const int64_t probs_t = g.intermediate(sc.dims, sc.transposed_strides, CUDNN_DATA_BFLOAT16);
  g.reshape(probs, probs_t);
  p.dv = g.tensor(v_rows(s, p));
  g.matmul(probs_t, p.dout, p.dv, p.seq_kv, -1, p.seq_q);

  // dS = P ⊙ (dO·Vᵀ − Δ) · scale.
  const int64_t dprobs = g.intermediate(sc.dims, sc.strides);
  g.matmul(p.dout, p.v, dprobs, p.seq_q, p.seq_kv);
  const int64_t dprobs_centred = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_SUB, dprobs, dprobs_centred, p.row_sum);
  const int64_t dscores_unscaled = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dprobs_centred, dscores_unscaled, probs);
  const int64_t dscores = g.intermediate(sc.dims, sc.strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dscores_unscaled, dscores, p.scale);

  // dK = dSᵀ·Q.
  const int64_t dscores_t = g.intermediate(sc.dims, sc.transposed_strides, CUDNN_DATA_BFLOAT16);
  g.reshape(dscores, dscores_t);
  p.dk = g.tensor(rows(s, p, s.Dqk));
  g.matmul(dscores_t, p.q, p.dk, p.seq_kv, -1, p.seq_q);

  // dQ = dS·K through an fp32 accumulator: [b, H, S, Dqk] (BHSD, as the cuDNN frontend lays it
  // out) or, for packed documents where the engines handle it, token-major like dq so that it
  // shares dq's ragged offsets (thd_dq_accumulator).
  TensorSpec key_view = rows(s, p, s.Dqk);  // K, un-transposed, virtual
  key_view.type = key_view_type;
  key_view.is_virtual = true;
  if (!s.packed) key_view.ragged_offset = -1;
  const int64_t key = g.tensor(key_view);
  g.reshape(p.k, key);
  TensorSpec accum = thd_dq_accumulator(s) ? rows(s, p, s.Dqk)
                              : TensorSpec{{s.b, s.H, s.S, s.Dqk},
                                           {s.H * s.S * s.Dqk, s.S * s.Dqk, s.Dqk, 1},
                                           CUDNN_DATA_FLOAT};
  accum.type = CUDNN_DATA_FLOAT;
  p.dq_accum = g.tensor(accum);
  g.matmul(dscores, key, p.dq_accum, p.seq_q, -1, p.seq_kv);
  p.dq = g.tensor(rows(s, p, s.Dqk));
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
  static const bool on = [] { return env_flag("DM_CUDNN_DEBUG", false); }();
  return on;
}

// Builds one graph variant into (g, ports); variants differ in the virtual K view's type.
using GraphFn = std::function<void(GraphBuilder&, Ports&, cudnnDataType_t)>;

// The cached plan for the problem, building it on first use (not while capturing).
CachedPlan* plan_for(State& st, cudnnHandle_t handle, const PlanKey& key, const GraphFn& build,
                     size_t scratch_bytes, bool capturing, int build_after, std::string* why) {
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
        build(*graph, ports, variant);
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
    entry.scratch_bytes = scratch_bytes;
    if (debug_log())
      std::fprintf(stderr, "[deltamoe cudnn] %s%s B=%lld T=%lld H=%lld Dqk=%lld Dv=%lld: %s\n",
                   key.backward ? "backward" : "forward", key.packed ? " (packed)" : "",
                   (long long)key.B, (long long)key.T, (long long)key.H, (long long)key.Dqk,
                   (long long)key.Dv,
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

// key.device is filled in here. extra_bytes: scratch after cuDNN's workspace.
bool open_session(Session& ses, PlanKey key, const GraphFn& build, size_t extra_bytes,
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
  key.device = device;
  ses.plan = plan_for(st, ses.handle, key, build, extra_bytes, capturing, build_after, why);
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

int64_t next_pow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// The documents of doc_start as a ragged batch, laid out on the host: bucketed dims (entries a
// power of two, length a power of two ≥ 64 capped at T, so recurring batches share plans) and
// the int32 block [len b | offset_qk b+1 | offset_v b+1 | row b | begin b]. Entries past the
// documents have length 0 and start at the end (offsets stay non-decreasing, like CSR).
struct PackedBatch {
  GraphShape dims{};
  int64_t docs = 0;
  std::vector<int32_t> doc_start, ints;
  int32_t* len() { return ints.data(); }
};

bool packed_batch(const int32_t* doc_start, const AttnShape& s, CUstream_st* stream,
                  PackedBatch& out, std::string* why) {
  const int64_t tokens = s.B * s.T;
  if (tokens * s.H * std::max(s.Dqk, s.Dv) >= int64_t(std::numeric_limits<int32_t>::max())) {
    if (why) *why = "packed documents: element offsets exceed int32";
    return false;
  }
  out.doc_start.resize(size_t(tokens));
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemcpyAsync(out.doc_start.data(), doc_start, size_t(tokens) * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, st) != cudaSuccess ||
      cudaStreamSynchronize(st) != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "packed documents: copying doc_start to the host failed";
    return false;
  }
  std::vector<int32_t> row, begin, len;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t) {
      const int32_t start = out.doc_start[size_t(b * s.T + t)];
      if (t == 0 || start == t) {
        row.push_back(int32_t(b));
        begin.push_back(int32_t(t));
        len.push_back(0);
      }
      ++len.back();
    }
  const int64_t n = int64_t(len.size());
  const int64_t longest = *std::max_element(len.begin(), len.end());
  GraphShape& d = out.dims;
  d.b = next_pow2(n);
  d.S = std::min<int64_t>(s.T, std::max<int64_t>(64, next_pow2(longest)));
  d.H = s.H;
  d.Dqk = s.Dqk;
  d.Dv = s.Dv;
  d.packed = true;
  out.docs = n;
  const int64_t b = d.b;
  out.ints.assign(size_t(5 * b + 2), 0);
  int32_t* lens = out.ints.data();
  int32_t* offset_qk = lens + b;
  int32_t* offset_v = offset_qk + b + 1;
  int32_t* rows = offset_v + b + 1;
  int32_t* begins = rows + b;
  for (int64_t i = 0; i <= b; ++i) {
    const int64_t token = i < n ? int64_t(row[size_t(i)]) * s.T + begin[size_t(i)] : tokens;
    offset_qk[i] = int32_t(token * s.H * s.Dqk);
    offset_v[i] = int32_t(token * s.H * s.Dv);
    if (i < b) {
      lens[i] = i < n ? len[size_t(i)] : 0;
      rows[i] = i < n ? row[size_t(i)] : 0;
      begins[i] = i < n ? begin[size_t(i)] : 0;
    }
  }
  return true;
}

// The int32 block into device scratch (pageable source: the copy is staged before returning).
void upload_ints(int32_t* device, const PackedBatch& batch, cudaStream_t stream) {
  if (cudaMemcpyAsync(device, batch.ints.data(), batch.ints.size() * sizeof(int32_t),
                      cudaMemcpyHostToDevice, stream) != cudaSuccess) {
    cudaGetLastError();
    throw Error("cudnn attention: uploading the packed batch failed");
  }
}

// The batch of this call's documents (one host copy of doc_start), or nullptr with `why`.
const PackedBatch* packed_layout(const int32_t* doc_start, const AttnShape& s,
                                 CUstream_st* stream, std::string* why) {
  if (stream_capturing(stream)) {
    if (why) *why = "packed documents need a host copy of doc_start (stream being captured)";
    return nullptr;
  }
  thread_local PackedBatch batch;
  return packed_batch(doc_start, s, stream, batch, why) ? &batch : nullptr;
}

// Device views of the uploaded int32 block.
struct PackedViews {
  int32_t *len, *offset_qk, *offset_v, *row, *begin;
  PackedViews(int32_t* ints, int64_t b)
      : len(ints), offset_qk(ints + b), offset_v(ints + 2 * b + 1), row(ints + 3 * b + 2),
        begin(ints + 4 * b + 2) {}
};

}  // namespace

bool cudnn_attention_forward_packed(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    uint16_t* o, float* lse, const AttnShape& s, double scale,
                                    const int32_t* doc_start, CUstream_st* stream,
                                    std::string* why, int build_after) {
  const PackedBatch* layout = packed_layout(doc_start, s, stream, why);
  if (!layout) return false;
  const PackedBatch& batch = *layout;
  const GraphShape d = batch.dims;
  const size_t stats_bytes = align256(size_t(d.b * d.H * d.S) * sizeof(float));
  const size_t ints_bytes = align256(batch.ints.size() * sizeof(int32_t));
  const PlanKey key{false, 0, true, d.b, d.S, d.H, d.Dqk, d.Dv, float(scale)};
  const GraphFn build = [&](GraphBuilder& g, Ports& p, cudnnDataType_t) {
    forward_graph(g, p, d);
  };
  Session ses;
  if (!open_session(ses, key, build, stats_bytes + ints_bytes, stream, build_after, why))
    return false;
  const Ports& p = ses.plan->ports;
  char* extra = ses.workspace + align256(size_t(ses.plan->plan->workspace_bytes));
  float* stats = reinterpret_cast<float*>(extra);
  int32_t* ints = reinterpret_cast<int32_t*>(extra + stats_bytes);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  upload_ints(ints, batch, st);
  const PackedViews view(ints, d.b);
  float scale_value = float(scale), neg_inf = negative_infinity(), neg_inf_pad = neg_inf;
  auto in = [](const void* ptr) { return const_cast<void*>(ptr); };
  ses.plan->plan->execute(
      ses.handle,
      {p.offset_qk, p.offset_v, p.seq_q, p.seq_kv, p.q, p.k, p.v, p.o, p.lse, p.scale, p.neg_inf,
       p.neg_inf_pad},
      {view.offset_qk, view.offset_v, view.len, view.len, in(q), in(k), in(v), o, stats,
       &scale_value, &neg_inf, &neg_inf_pad},
      ses.workspace);
  if (lse)
    attention_detail::launch_ragged_stats(view.row, view.begin, view.len, int(d.b), int(d.H),
                                          int(d.S), int(s.T), stats, lse, /*to_lse=*/true, stream);
  return true;
}

bool cudnn_attention_backward_packed(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                     const uint16_t* o, const float* lse, const uint16_t* dout,
                                     uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                                     double scale, const int32_t* doc_start, CUstream_st* stream,
                                     std::string* why, int build_after) {
  const PackedBatch* layout = packed_layout(doc_start, s, stream, why);
  if (!layout) return false;
  const PackedBatch& batch = *layout;
  const GraphShape d = batch.dims;
  const size_t stats_bytes = align256(size_t(d.b * d.H * d.S) * sizeof(float));
  const size_t accum_floats = size_t(thd_dq_accumulator(d) ? s.B * s.T * s.H * s.Dqk
                                                            : d.b * d.S * d.H * d.Dqk);
  const size_t accum_bytes = align256(accum_floats * sizeof(float));
  const size_t ints_bytes = align256(batch.ints.size() * sizeof(int32_t));
  const PlanKey key{true, 0, true, d.b, d.S, d.H, d.Dqk, d.Dv, float(scale)};
  const GraphFn build = [&](GraphBuilder& g, Ports& p, cudnnDataType_t key_view) {
    backward_graph(g, p, d, key_view);
  };
  Session ses;
  if (!open_session(ses, key, build, 2 * stats_bytes + accum_bytes + ints_bytes, stream,
                    build_after, why))
    return false;
  const Ports& p = ses.plan->ports;
  char* extra = ses.workspace + align256(size_t(ses.plan->plan->workspace_bytes));
  float* stats = reinterpret_cast<float*>(extra);
  float* row_sum = reinterpret_cast<float*>(extra + stats_bytes);
  float* dq_accum = reinterpret_cast<float*>(extra + 2 * stats_bytes);
  int32_t* ints = reinterpret_cast<int32_t*>(extra + 2 * stats_bytes + accum_bytes);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  upload_ints(ints, batch, st);
  const PackedViews view(ints, d.b);
  attention_detail::launch_ragged_stats(view.row, view.begin, view.len, int(d.b), int(d.H),
                                        int(d.S), int(s.T), stats, const_cast<float*>(lse),
                                        /*to_lse=*/false, stream);
  if (cudnn::library_version_number() < 90600)  // later versions zero it themselves
    cudaMemsetAsync(dq_accum, 0, accum_floats * sizeof(float), st);
  float scale_value = float(scale), neg_inf = negative_infinity(), one = 1.0f,
        neg_inf_pad = neg_inf;
  auto in = [](const void* ptr) { return const_cast<void*>(ptr); };
  ses.plan->plan->execute(
      ses.handle,
      {p.offset_qk, p.offset_v, p.seq_q, p.seq_kv, p.q, p.k, p.v, p.o, p.dout, p.lse, p.scale,
       p.neg_inf, p.one, p.neg_inf_pad, p.row_sum, p.dq_accum, p.dq, p.dk, p.dv},
      {view.offset_qk, view.offset_v, view.len, view.len, in(q), in(k), in(v), in(o), in(dout),
       stats, &scale_value, &neg_inf, &one, &neg_inf_pad, row_sum, dq_accum, dq, dk, dv},
      ses.workspace);
  return true;
}

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
  const PlanKey key{false, 0, false, s.B, s.T, s.H, s.Dqk, s.Dv, float(scale)};
  const GraphShape shape{s.B, s.T, s.H, s.Dqk, s.Dv, false};
  const GraphFn build = [&](GraphBuilder& g, Ports& p, cudnnDataType_t) {
    forward_graph(g, p, shape);
  };
  // Scratch: the lse when the caller passes none.
  const size_t extra_bytes = align256(size_t(s.B * s.H * s.T) * sizeof(float));
  if (!open_session(ses, key, build, extra_bytes, stream, build_after, why)) return false;
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
  const PlanKey key{true, 0, false, s.B, s.T, s.H, s.Dqk, s.Dv, float(scale)};
  const GraphShape shape{s.B, s.T, s.H, s.Dqk, s.Dv, false};
  const GraphFn build = [&](GraphBuilder& g, Ports& p, cudnnDataType_t key_view) {
    backward_graph(g, p, shape, key_view);
  };
  // Scratch: Δ [B,H,T] and the dQ accumulator [B,H,T,Dqk], fp32.
  const size_t extra_bytes = align256(size_t(s.B * s.H * s.T) * sizeof(float)) +
                             align256(size_t(s.B * s.H * s.T * s.Dqk) * sizeof(float));
  if (!open_session(ses, key, build, extra_bytes, stream, build_after, why)) return false;
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
  auto it = st.plans.find(PlanKey{backward, device, false, s.B, s.T, s.H, s.Dqk, s.Dv, float(scale)});
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

bool cudnn_attention_forward_packed(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                                    float*, const AttnShape&, double, const int32_t*,
                                    CUstream_st*, std::string* why, int) {
  if (why) *why = "built without cuDNN";
  return false;
}

bool cudnn_attention_backward_packed(const uint16_t*, const uint16_t*, const uint16_t*,
                                     const uint16_t*, const float*, const uint16_t*, uint16_t*,
                                     uint16_t*, uint16_t*, const AttnShape&, double,
                                     const int32_t*, CUstream_st*, std::string* why, int) {
  if (why) *why = "built without cuDNN";
  return false;
}

#endif  // DELTAMOE_HAVE_CUDNN

}  // namespace dm::cuda
