// The KDA decode step from the projections to the gated output in ONE launch (decode_ops.h
// decode_kda_fused_step): the short conv of q, k, v against the slot's tails, the gate's
// up-projection f = W_f↑·low, the decay gate and β, the recurrent update of the slot's state,
// the output gate's up-projection and the per-head gated RMSNorm. The unfused step launches
// five kernels for this (conv, f GEMV, recurrent, g GEMV, gated norm), each of them a few
// microseconds of launch, ramp-up and drain at decode sizes for well under a microsecond of
// bytes; twenty KDA layers paid that a hundred times a step.
//
// Grid (V / 32, n·H), a cluster of the V / 32 = 4 column tiles of one (row, head); 256 threads
// as the recurrent kernel (kda_recurrent.cu): thread (tx, ty) holds state column 32·tile + tx on
// rows ty, ty + 8, … (16 registers). (512 threads, 8 rows each, one block an SM, measured
// slower inside the 48B step: 13.8 against 8.5 us of its critical path, 1 x 32K 2.48 against
// 2.39 ms.) Every tile needs the whole conv'd q and k of its head and
// computes them (256 channels, a few loads each); the decay's 128 rows it splits with its peers
// (32 rows of W_f↑ each, read back through distributed shared memory), the output gate it needs
// only for its own 32 columns. The tails of q and k are advanced by tiles 0 and 1 once the
// cluster has read them (barrier), each tile advances its own 32 v channels. The norm over the
// head's V outputs adds the four tiles' Σ o² through distributed shared memory, in rank order.
// Few rows only (kda_decode_fused_applies: n ≤ kKdaFusedMaxRows): every (row, head) reads its
// 64 KB of gate weights, which a GEMM over many rows reads once.
//
// Rounding follows the unfused step so the two agree but for the order of two GEMV sums and of
// the norm's Σ o²: conv outputs, f, the output gate and o are rounded to bf16 where the unfused
// kernels store them (the decode tests saw the same error against the CPU to three digits).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/kda_gate.cuh"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kDim = kKdaFusedHeadDim;  // K = V
constexpr int kTile = 32;               // state columns a block owns
constexpr int kTiles = kDim / kTile;    // the cluster
constexpr int kRowLanes = 8;
constexpr int kThreads = kTile * kRowLanes;
constexpr int kRows = kDim / kRowLanes;  // state rows a thread holds
constexpr int kMaxTail = kKdaFusedMaxConv - 1;
constexpr float kL2NormEps = 1e-6f;
static_assert(kThreads == 2 * kDim, "one thread per q and k channel");
static_assert(kDim == 128,
              "the low-rank dots below take one 16-byte chunk per lane of a half-warp");

__device__ __forceinline__ float silu(float x) { return x * sigmoid_f32(x); }
__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(uint32_t(bits) << 16);
}

// Σ_j W[row_p, j]·x[j] over kDim = 128 bf16 for kPasses rows row_p = w + p·stride (row-major
// rows of 128): a half-warp per row, a 16-byte chunk per lane (wv, loaded by load_rows before
// x exists), each sum reduced within the half-warp (every lane of the half gets it).
template <int kPasses>
__device__ __forceinline__ void load_rows(const uint16_t* __restrict__ w, int64_t stride,
                                          int lane16, uint4 (&wv)[kPasses]) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p)
    wv[p] = __ldg(reinterpret_cast<const uint4*>(w + p * stride) + lane16);
}

template <int kPasses>
__device__ __forceinline__ void half_warp_dots(const uint4 (&wv)[kPasses],
                                               const uint16_t* __restrict__ x, int lane16,
                                               float (&dots)[kPasses]) {
  const uint4 xv = *(reinterpret_cast<const uint4*>(x) + lane16);  // written by the last launch
  const uint32_t xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const uint32_t wa[4] = {wv[p].x, wv[p].y, wv[p].z, wv[p].w};
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(__uint_as_float(xa[i] << 16), __uint_as_float(wa[i] << 16), acc);
      acc = fmaf(__uint_as_float(xa[i] & 0xffff0000u), __uint_as_float(wa[i] & 0xffff0000u), acc);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    dots[p] = acc;
  }
}

// One channel's short conv: its weights and the tail's old values (kept for the caller's shift),
// loaded before the new raw value exists; the guarded unrolled loops keep them in registers.
struct ConvChannel {
  float w[kMaxTail], w_last;
  uint16_t kept[kMaxTail];
};

__device__ __forceinline__ void load_conv_channel(const float* __restrict__ w, const uint16_t* tail,
                                                  int64_t C, int Kc, ConvChannel& ch) {
#pragma unroll
  for (int j = 0; j < kMaxTail; ++j)
    if (j < Kc - 1) {
      ch.kept[j] = tail[int64_t(j) * C];
      ch.w[j] = w[j];
    }
  ch.w_last = w[Kc - 1];
}

// The conv + SiLU of the channel (decode_ops.cu conv_step_kernel's order).
__device__ __forceinline__ float conv_channel(const ConvChannel& ch, uint16_t raw_bits, int Kc) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxTail; ++j)
    if (j < Kc - 1) acc += ch.w[j] * bf16_bits_to_float(ch.kept[j]);
  acc += ch.w_last * bf16_bits_to_float(raw_bits);
  return round_through_bf16(silu(acc));
}

__device__ __forceinline__ void shift_tail(uint16_t* tail, int64_t C, uint16_t raw_bits, int Kc,
                                           const ConvChannel& ch) {
  if (Kc < 2) return;
#pragma unroll
  for (int j = 1; j < kMaxTail; ++j)
    if (j < Kc - 1) tail[int64_t(j - 1) * C] = ch.kept[j];
  tail[int64_t(Kc - 2) * C] = raw_bits;
}

// The tiles write their decays and Σ o² into every peer's shared memory before the cluster
// barriers (each reads its own copy after them) rather than reading the peers' after them: no
// remote read on the critical path and no third barrier guarding the peers' reads (twenty-fourth
// session: 1 x 1M 4.198/4.175 vs 4.211/4.183 ms, 1 x 32K the same within 0.01).
__global__ void __cluster_dims__(kTiles, 1, 1) __launch_bounds__(kThreads)
    kda_decode_fused_kernel(const KdaFusedStepArgs a) {
  __shared__ float query[kDim], key[kDim], decay[kDim], partial[kRowLanes][kTile];
  __shared__ float gate_tile[kTile], value_tile[kTile];
  __shared__ float reduce_scratch[2][kThreads / 32];
  __shared__ float tile_sums[kTiles];
  cg::cluster_group cluster = cg::this_cluster();
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kTile + tx;
  const int tile = int(cluster.block_rank());
  // A peer's shared memory may be written only once the peer has started (CUDA programming
  // guide, distributed shared memory): arrive now, wait just before the first push. All blocks of
  // a cluster are launched together, so the wait costs nothing by then.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  const int64_t H = a.H, C = H * kDim, bh = blockIdx.y, r = bh / H, h = bh % H;
  const int tail_rows = a.conv_kernel - 1;
  const int e = tile * kTile + tx;
  const int branch = tid / kDim, channel = tid % kDim;  // q (threads 0–127), k (128–255)
  const int64_t qk_c = h * kDim + channel, v_c = h * kDim + tile * kTile + tx;
  // This tile's 32 of the head's 128 decay rows (the peers compute the others; exchanged through
  // distributed shared memory after the barrier) and the output gate of its 32 columns: rows
  // h·128 + tile·32 + half + p·16 of W_f↑ (W_g↑), a half-warp each.
  constexpr int kHalves = kThreads / 16, kPasses = kTile / kHalves;
  const int lane16 = tid & 15, half = tid >> 4;
  const int64_t row0 = h * kDim + tile * kTile + half;  // this half-warp's first row

  // Everything the step reads that the last launch (the projections' GEMV) does not write, loaded
  // BEFORE the PDL wait (pdl.h's two-launches-back rule): the row's slot (prepare_rows, at the
  // step's start), its state tile and conv tails (this layer's previous step), weights. The
  // step's dependent chain then starts at the projections' outputs. (Loaded after the wait, the
  // slot cost a round trip before the state's and the tails' loads could even be issued: 12.2
  // against 9.7 us alone under Nsight Compute, though the 48B step measured the same, 2.382 /
  // 2.399 ms against 2.387 / 2.389 at 1 x 32K, the old chain being hidden by its neighbours.)
  const int64_t slot = a.slots[r];
  float* state = a.state + ((slot * H + h) * kDim) * kDim + e;  // row i at state[i·kDim]
  float s[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) s[j] = state[int64_t(ty + kRowLanes * j) * kDim];
  ConvChannel qk_conv, v_conv;
  load_conv_channel(a.conv_weight[branch] + qk_c * a.conv_kernel,
                    a.tail[branch] + slot * tail_rows * C + qk_c, C, a.conv_kernel, qk_conv);
  if (ty == 0)
    load_conv_channel(a.conv_weight[2] + v_c * a.conv_kernel,
                      a.tail[2] + slot * tail_rows * C + v_c, C, a.conv_kernel, v_conv);
  uint4 f_rows[kPasses], g_rows[kPasses];
  load_rows<kPasses>(a.f_up + row0 * kDim, kHalves * kDim, lane16, f_rows);
  if (a.g_up != nullptr) load_rows<kPasses>(a.g_up + row0 * kDim, kHalves * kDim, lane16, g_rows);
  float dt_bias[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) dt_bias[p] = a.dt_bias[row0 + p * kHalves];
  const float a_head = expf(a.A_log[h]), norm_weight = a.norm_weight[e];
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before reading the projections

  // Conv of q and k channel h·128 + channel; the tails of q and k are advanced after the
  // cluster barrier (every tile reads them), this tile's v column's at once (no other block
  // reads it).
  uint16_t* qk_tail = a.tail[branch] + slot * tail_rows * C + qk_c;
  const uint16_t qk_raw = a.raw[branch][r * C + qk_c];
  const float qk = conv_channel(qk_conv, qk_raw, a.conv_kernel);
  (branch == 0 ? query : key)[channel] = qk;
  if (ty == 0) {
    uint16_t* v_tail = a.tail[2] + slot * tail_rows * C + v_c;
    const uint16_t v_raw = a.raw[2][r * C + v_c];
    value_tile[tx] = conv_channel(v_conv, v_raw, a.conv_kernel);
    shift_tail(v_tail, C, v_raw, a.conv_kernel, v_conv);
  }

  // f = W_f↑[row]·low[r, :], rounded to bf16 as the unfused GEMV stores it; the decay from it.
  float f_dots[kPasses], g_dots[kPasses];
  half_warp_dots<kPasses>(f_rows, a.low + r * kDim, lane16, f_dots);
  if (a.g_up != nullptr) half_warp_dots<kPasses>(g_rows, a.low_gate + r * kDim, lane16, g_dots);
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every peer has started
  if (lane16 == 0) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int i = half + p * kHalves;
      const float d = expf(round_through_bf16(kda_gate_value(
          a_head, round_through_bf16(f_dots[p]) + dt_bias[p], a.safe_gate, a.lower_bound)));
#pragma unroll
      for (int rank = 0; rank < kTiles; ++rank)
        *cluster.map_shared_rank(&decay[tile * kTile + i], unsigned(rank)) = d;
      if (a.g_up != nullptr) gate_tile[i] = round_through_bf16(g_dots[p]);
    }
  }
  if (a.g_up == nullptr && tid < kTile)
    gate_tile[tid] = bf16_bits_to_float(a.gate[r * C + h * kDim + tile * kTile + tid]);

  // Every tile has read the q and k tails (tiles 0 and 1 advance them) and written its decays.
  cluster.sync();
  if (tile == branch) shift_tail(qk_tail, C, qk_raw, a.conv_kernel, qk_conv);

  // The recurrent step (kda_recurrent.cu, T = 1): L2 norms of q and k, β.
  float sum_q = tid < kDim ? qk * qk : 0.0f, sum_k = tid < kDim ? 0.0f : qk * qk;
  // (its barrier also publishes query, key, decay, gate_tile and value_tile)
  block_sum_pair<kThreads / 32>(sum_q, sum_k, tid, reduce_scratch);
  const float query_factor = a.scale / sqrtf(sum_q + kL2NormEps);
  const float key_factor = 1.0f / sqrtf(sum_k + kL2NormEps);
  const float beta = round_through_bf16(sigmoid_f32(a.beta_logits[r * H + h]));
  const float v_t = value_tile[tx];
  float prediction = 0.0f;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int row = ty + kRowLanes * j;
    s[j] *= decay[row];
    prediction += s[j] * key[row] * key_factor;
  }
  partial[ty][tx] = prediction;
  __syncthreads();
  prediction = 0.0f;
  for (int lane = 0; lane < kRowLanes; ++lane) prediction += partial[lane][tx];
  const float delta = beta * (v_t - prediction);
  __syncthreads();  // every lane has read `partial`
  float out = 0.0f;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int row = ty + kRowLanes * j;
    s[j] += key[row] * key_factor * delta;
    out += s[j] * query[row] * query_factor;
    state[int64_t(row) * kDim] = s[j];
  }
  partial[ty][tx] = out;
  __syncthreads();

  // Gated RMSNorm over the head's 128 outputs (kda_layer_ops.h rmsnorm_gated on the bf16 o).
  float o = 0.0f;
  if (ty == 0) {
    for (int lane = 0; lane < kRowLanes; ++lane) o += partial[lane][tx];
    o = round_through_bf16(o);
    const float squares = warp_sum(o * o);
    if (tx == 0) {
#pragma unroll
      for (int rank = 0; rank < kTiles; ++rank)
        *cluster.map_shared_rank(&tile_sums[tile], unsigned(rank)) = squares;
    }
  }
  cluster.sync();  // every tile's Σ o² is written
  if (ty == 0) {
    float total = 0.0f;
    for (int rank = 0; rank < kTiles; ++rank) total += tile_sums[rank];
    const float inverse_rms = 1.0f / sqrtf(total / float(kDim) + a.eps);
    const float y = o * inverse_rms * norm_weight * sigmoid_f32(gate_tile[tx]);
    store_from_float(a.out, r * C + h * kDim + e, y);
  }
}

}  // namespace

bool kda_decode_fused_applies(int64_t n, int64_t K, int64_t V, int conv_kernel) {
  return n >= 0 && n <= kKdaFusedMaxRows && K == kKdaFusedHeadDim && V == kKdaFusedHeadDim &&
         conv_kernel >= 1 && conv_kernel <= kKdaFusedMaxConv;
}

void decode_kda_fused_step(const KdaFusedStepArgs& a, int64_t n, DecodeStream stream) {
  DM_CHECK(kda_decode_fused_applies(n, kKdaFusedHeadDim, kKdaFusedHeadDim, a.conv_kernel),
           "decode_kda_fused_step: n = ", n, " (at most ", kKdaFusedMaxRows, "), conv kernel ",
           a.conv_kernel, " (1 to ", kKdaFusedMaxConv, ")");
  DM_CHECK(a.H > 0 && n * a.H < 65536, "decode_kda_fused_step: n·H = ", n * a.H);
  DM_CHECK((a.g_up != nullptr) != (a.gate != nullptr),
           "decode_kda_fused_step: give the low-rank output gate or the full-rank one");
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  DM_CHECK(aligned16(a.low) && aligned16(a.f_up) && aligned16(a.low_gate) && aligned16(a.g_up),
           "decode_kda_fused_step: low, f_up, low_gate and g_up must be 16-byte aligned");
  if (n == 0) return;
  launch_pdl(kda_decode_fused_kernel, dim3(kTiles, unsigned(n * a.H)), dim3(kTile, kRowLanes), 0,
             stream, a);
  check_last_error("decode_kda_fused_step");
}

}  // namespace dm::cuda
