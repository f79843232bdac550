// Recurrent KDA on CUDA (kda.h): the definition, one token at a time; with T = 1 it is the decode
// step of many sequences at once.
//
// Columns of the state are independent given k, q, g, β (S[:, e] only mixes rows), so a block
// owns a [K, 32] column tile of one head's state and walks the tokens; thread (tx, ty) holds
// column tx on rows ty, ty + 8, … in registers (R = ⌈K/8⌉ rounded up to a power of two, a
// template parameter, so the loads of the whole tile are in flight at once). Per token the block
// reads q, k, g (K values each), v (32), β once: a decode step reads and writes each state
// element once (8 bytes), which is the floor for this operator (memory-bound, ≈ 4 FLOP/element).
// The decode step (decode_ops.h decode_kda_recurrent_step) runs the same kernel with a per-row
// state index, so rows of any set of slots share one launch, and applies the decay gate and β's
// sigmoid itself.
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_gate.cuh"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kRecurrentTile = 32;                         // state columns per block
constexpr int kRecurrentRowLanes = 8;                      // row lanes (blockDim.y)
constexpr int kRecurrentThreads = kRecurrentTile * kRecurrentRowLanes;
constexpr float kRecurrentL2NormEps = 1e-6f;
static_assert(kKdaCudaRecurrentMaxK <= 32 * kRecurrentRowLanes, "the widest launch holds 32 rows");

struct KdaRecurrentDims {
  int64_t B, T, H;
  int K, V;
  float scale;
};

// gates.f != nullptr (the decode step): g and β come raw through `gates` (decode_ops.h) and g,
// beta are not read. R: state rows per thread (K ≤ 8·R).
template <typename Storage, int R>
__global__ void __launch_bounds__(kRecurrentThreads)
    kda_recurrent_kernel(const Storage* q, const Storage* k, const Storage* v, const Storage* g,
                         const Storage* beta, const float* s0, Storage* o, float* sT,
                         const int32_t* doc_start, const int32_t* state_index, KdaRecurrentDims d,
                         const KdaStepGates gates) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  extern __shared__ float shared[];
  float* key_hat = shared;           // [K]
  float* query_hat = key_hat + d.K;  // [K]
  float* decay = query_hat + d.K;    // [K]
  float* partial = decay + d.K;      // [8, 32]
  __shared__ float reduce_scratch[2][kRecurrentThreads / 32];

  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kRecurrentTile + tx;
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  // The state of sequence b: its own, or slot state_index[b] of a larger state array (decode).
  const int64_t state_bh = state_index != nullptr ? int64_t(state_index[b]) * d.H + h : bh;
  const int e = blockIdx.x * kRecurrentTile + tx;
  const bool column_real = e < d.V;
  // Row of register j: ty + 8j (rows ≥ K hold zeros and are never stored).
  auto row_of = [&](int j) { return ty + kRecurrentRowLanes * j; };

  float state[R];
#pragma unroll
  for (int j = 0; j < R; ++j)
    state[j] = (s0 != nullptr && column_real && row_of(j) < d.K)
                   ? s0[(state_bh * d.K + row_of(j)) * d.V + e]
                   : 0.0f;

  for (int64_t t = 0; t < d.T; ++t) {
    const int64_t row = (b * d.T + t) * d.H + h;
    if (doc_start != nullptr && t > 0 && doc_start[b * d.T + t] == t)
#pragma unroll
      for (int j = 0; j < R; ++j) state[j] = 0.0f;

    // q̂·scale, k̂, e^g into shared memory (norms by a block reduction).
    float sum_q = 0.0f, sum_k = 0.0f;
    const float a_head = gates.f == nullptr ? 0.0f : expf(gates.A_log[h]);
    for (int col = tid; col < d.K; col += kRecurrentThreads) {
      const float qv = load_as_float(q, row * d.K + col), kv = load_as_float(k, row * d.K + col);
      query_hat[col] = qv;
      key_hat[col] = kv;
      const float g_value =
          gates.f == nullptr
              ? load_as_float(g, row * d.K + col)
              : round_through_bf16(kda_gate_value(
                    a_head, load_as_float(gates.f, row * d.K + col) + gates.dt_bias[h * d.K + col],
                    gates.safe_gate, gates.lower_bound));
      decay[col] = expf(g_value);
      sum_q += qv * qv;
      sum_k += kv * kv;
    }
    block_sum_pair<kRecurrentThreads / 32>(sum_q, sum_k, tid, reduce_scratch);
    const float query_factor = d.scale / sqrtf(sum_q + kRecurrentL2NormEps);
    const float key_factor = 1.0f / sqrtf(sum_k + kRecurrentL2NormEps);
    const float beta_t = gates.f == nullptr
                             ? load_as_float(beta, row)
                             : round_through_bf16(sigmoid_f32(gates.beta_logits[row]));
    const float value_t = column_real ? load_as_float(v, row * d.V + e) : 0.0f;

    // Pass 1: S ← Diag(e^g)·S and the prediction Sᵀk̂ (column tx, rows of this lane).
    float prediction = 0.0f;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (row_of(j) >= d.K) continue;
      state[j] *= decay[row_of(j)];
      prediction += state[j] * key_hat[row_of(j)] * key_factor;
    }
    partial[ty * kRecurrentTile + tx] = prediction;
    __syncthreads();
    prediction = 0.0f;
    for (int lane = 0; lane < kRecurrentRowLanes; ++lane) prediction += partial[lane * kRecurrentTile + tx];
    const float delta = beta_t * (value_t - prediction);
    __syncthreads();  // every lane has read `partial`

    // Pass 2: S ← S + k̂·δᵀ and o = Sᵀ(q̂·scale) with the updated S.
    float out = 0.0f;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (row_of(j) >= d.K) continue;
      state[j] += key_hat[row_of(j)] * key_factor * delta;
      out += state[j] * query_hat[row_of(j)] * query_factor;
    }
    partial[ty * kRecurrentTile + tx] = out;
    __syncthreads();
    if (ty == 0 && column_real) {
      out = 0.0f;
      for (int lane = 0; lane < kRecurrentRowLanes; ++lane) out += partial[lane * kRecurrentTile + tx];
      store_from_float(o, row * d.V + e, out);
    }
    __syncthreads();  // partial, key_hat, query_hat, decay and reduce_scratch are rewritten next token
  }

  if (sT != nullptr && column_real)
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (row_of(j) < d.K) sT[(state_bh * d.K + row_of(j)) * d.V + e] = state[j];
}

template <typename Storage>
void kda_recurrent_launch(const Storage* q, const Storage* k, const Storage* v, const Storage* g,
                          const Storage* beta, const float* s0, Storage* o, float* sT,
                          const KdaShape& s, float scale, const int32_t* doc_start,
                          cudaStream_t stream, const int32_t* state_index = nullptr,
                          const KdaStepGates& gates = KdaStepGates{}) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.K > 0 && s.V > 0,
           "cuda kda_recurrent_forward: bad shape B=", s.B, " T=", s.T, " H=", s.H, " K=", s.K,
           " V=", s.V);
  DM_CHECK(s.K <= kKdaCudaRecurrentMaxK, "cuda kda_recurrent_forward: K=", s.K,
           " (the recurrent CUDA kernel takes K ≤ ", kKdaCudaRecurrentMaxK, ")");
  DM_CHECK(s.B * s.H < 65536, "cuda kda_recurrent_forward: B·H=", s.B * s.H,
           " exceeds one grid dimension (65535)");
  if (s.B * s.H == 0) return;
  const KdaRecurrentDims d{s.B, s.T, s.H, int(s.K), int(s.V), scale};
  const size_t shared_bytes =
      size_t(3 * s.K + kRecurrentRowLanes * kRecurrentTile) * sizeof(float);  // ≤ 4 KB
  const dim3 grid(unsigned(ceil_div(s.V, kRecurrentTile)), unsigned(s.B * s.H));
  const dim3 block(kRecurrentTile, kRecurrentRowLanes);
  // Registers of state per thread: the smallest power of two covering K / 8.
  const auto launch = [&](auto rows) {
    launch_pdl(kda_recurrent_kernel<Storage, decltype(rows)::value>, grid, block, shared_bytes,
               stream, q, k, v, g, beta, s0, o, sT, doc_start, state_index, d, gates);
  };
  const int64_t rows = ceil_div(s.K, kRecurrentRowLanes);
  if (rows <= 1)
    launch(std::integral_constant<int, 1>{});
  else if (rows <= 2)
    launch(std::integral_constant<int, 2>{});
  else if (rows <= 4)
    launch(std::integral_constant<int, 4>{});
  else if (rows <= 8)
    launch(std::integral_constant<int, 8>{});
  else if (rows <= 16)
    launch(std::integral_constant<int, 16>{});
  else
    launch(std::integral_constant<int, 32>{});  // K ≤ kKdaCudaRecurrentMaxK = 256
  check_last_error("cuda kda_recurrent_forward");
}

}  // namespace

void kda_recurrent_forward(const float* q, const float* k, const float* v, const float* g,
                           const float* beta, const float* s0, float* o, float* sT,
                           const KdaShape& s, float scale, const int32_t* doc_start,
                           KdaStream stream) {
  kda_recurrent_launch(q, k, v, g, beta, s0, o, sT, s, scale, doc_start, stream);
}
void kda_recurrent_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                           const uint16_t* g, const uint16_t* beta, const float* s0, uint16_t* o,
                           float* sT, const KdaShape& s, float scale, const int32_t* doc_start,
                           KdaStream stream) {
  kda_recurrent_launch(q, k, v, g, beta, s0, o, sT, s, scale, doc_start, stream);
}

void decode_kda_recurrent_step(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const KdaStepGates& gates, float* state, const int32_t* slots,
                               uint16_t* o, int64_t n, int64_t H, int64_t K, int64_t V, float scale,
                               DecodeStream stream) {
  DM_CHECK(state && slots, "decode_kda_recurrent_step: null state or slots");
  DM_CHECK(gates.f && gates.A_log && gates.dt_bias && gates.beta_logits,
           "decode_kda_recurrent_step: null gate input");
  kda_recurrent_launch<uint16_t>(q, k, v, nullptr, nullptr, state, o, state,
                                 KdaShape{n, 1, H, K, V}, scale, nullptr, stream, slots, gates);
}

}  // namespace dm::cuda
