// Routed experts of a few tokens without a host synchronisation (layout and cost in
// moe_decode.h). Up to 32 (token, expert) pairs: two launches, a block per (f-tile, pair) for
// gate/up + GLU and a block per 4 or 8 output channels whose warps take the pairs and whose sums
// go straight into y (the combine). Beyond that: plan → gate/up + GLU → down → combine, the expert
// kernels reading each hit expert's weights once for all its tokens. Both give the same bits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/moe_decode.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGateUpRowsPerWarp = 2;  // f rows per warp: its gate and up rows, 4 weight rows
constexpr int kDownRowsPerWarp = 4;    // output channels per warp
constexpr int kWeightRows = 4;         // weight rows a warp streams at once, both kernels
constexpr int kTokenPass = 4;          // tokens per pass over a warp's rows (1 when alone)
constexpr int kPlanThreads = 1024;
constexpr int kCombineThreads = 256;
static_assert(2 * kGateUpRowsPerWarp == kWeightRows && kDownRowsPerWarp == kWeightRows,
              "both kernels stream four weight rows per warp");

// Device views of the workspace. A = min(E, N·k) bounds the experts one call can hit.
struct Plan {
  int32_t* active_count;   // [1]      experts hit
  int32_t* active_expert;  // [A]      their ids, ascending
  int32_t* row_begin;      // [A + 1]  their ranges in `rows`
  int32_t* rows;           // [N·k]    pair ids t·k + slot grouped by expert, token order inside
  int32_t* pair_rank;      // [N·k]    a pair's position among its expert's rows (scratch)
};
// Up to this many (token, expert) pairs (batch ≤ 4 at k = 8) the pair kernels run instead.
constexpr int kPairPathMaxPairs = 32;
constexpr int kPairDownMaxWarps = 16;  // down + combine pair kernel: most warps a block

// Launch shapes of the pair kernels. Up to 16 pairs (batch 1 and 2 at k = 8, with the shared
// expert): gate/up warps take 2 row pairs each and a down block 8 channels with a warp per pair
// (now 4 channels with a warp per two pairs, below), so that each kernel is one wave on the 48B
// shape (at 64-70 registers 3-4 blocks fit an SM; a
// warp per row pair or per 4 channels made 1.1-1.5 waves, and 9 pairs on 8 warps left warp 0
// two): 1 x 32K 3.07/3.07 -> 2.94/2.94 ms a step on an H200. Beyond, 1 row pair a warp and
// 4-channel blocks of 8 warps striding over the pairs (at 36 pairs, batch 4, the one-wave shape
// left a third of the warps a third pair: 6.27 -> 6.81 ms). Gate/up blocks are 4 warps, not 8:
// at 9 pairs the 288 blocks of 8 warps gave 24 of the 132 SMs a third block (1.37x the mean
// load), 576 of 4 warps give 48 SMs a fifth (1.15x): 1 x 32K 2.304/2.344 vs 2.363/2.374 ms; at
// 36 pairs 4 x 32K 5.889/5.891 vs 5.902/5.920 (twenty-third session, DM_MOE_PAIR_GATE_UP).
// Down blocks up to 16 pairs: 4 channels with a warp per two pairs, 576 blocks of 5 warps at 9
// pairs in one wave (~63 registers, 6 blocks an SM), where 288 blocks of 9 warps left 24 SMs a
// third block: 1 x 32K 2.306/2.296 vs 2.322/2.299 ms, 1 x 1M 4.186/4.175 vs 4.198/4.175
// (twenty-fourth session; DM_MOE_PAIR_DOWN=8 is the old shape).
struct PairPlan {
  int gate_up_steps, down_channels, down_warps;
  int gate_up_warps = 4;  // warps a gate/up block
};
// Env overrides of the shape (read once), for the A/B of block sizes: DM_MOE_PAIR_GATE_UP =
// auto | 8x2 | 8x1 | 4x1 | 4x2 (warps a block × row pairs a warp), DM_MOE_PAIR_DOWN = auto | 8 |
// 4 | 4h (channels a down block; 4h: a warp per two pairs, up to 16 pairs).
PairPlan pair_plan(int64_t pairs) {
  const bool few = pairs <= kPairDownMaxWarps;
  PairPlan plan = few ? PairPlan{2, 4, int((pairs + 1) / 2)} : PairPlan{1, 4, kWarps};
  static const int gate_up = env_choice("DM_MOE_PAIR_GATE_UP", {"auto", "8x2", "8x1", "4x1", "4x2"});
  static const int down = env_choice("DM_MOE_PAIR_DOWN", {"auto", "8", "4", "4h"});
  constexpr int kGateUpShapes[][2] = {{0, 0}, {8, 2}, {8, 1}, {4, 1}, {4, 2}};
  if (gate_up > 0) {
    plan.gate_up_warps = kGateUpShapes[gate_up][0];
    plan.gate_up_steps = kGateUpShapes[gate_up][1];
  }
  if (down > 0) plan.down_channels = down == 1 ? 8 : 4;
  if ((down == 1 || down == 2) && few) plan.down_warps = int(pairs);  // a warp per pair
  return plan;
}
struct Workspace {
  Plan plan;
  uint16_t* h;  // [N·k (+ N shared pairs), F] bf16, row = pair id
  float* o;     // [N·k, Din] fp32, row = pair id
};

int64_t max_active_experts(int64_t N, int k, int64_t E) { return std::min<int64_t>(E, N * k); }

// Carves the workspace from `base`, or (base == nullptr) only counts its bytes.
Workspace carve_workspace(void* base, int64_t N, int k, const ExpertWeightsBf16& ew, bool shared,
                          size_t* bytes) {
  const int64_t pairs = std::max<int64_t>(N * k, 1), A = std::max<int64_t>(max_active_experts(N, k, ew.E), 1);
  const int64_t h_rows = pairs + (shared ? N : 0);
  char* cursor = static_cast<char*>(base);
  size_t used = 0;
  auto take = [&](size_t b) {
    void* p = cursor ? cursor + used : nullptr;
    used += (b + 255) & ~size_t(255);
    return p;
  };
  Workspace w;
  w.plan.active_count = static_cast<int32_t*>(take(sizeof(int32_t)));
  w.plan.active_expert = static_cast<int32_t*>(take(size_t(A) * sizeof(int32_t)));
  w.plan.row_begin = static_cast<int32_t*>(take(size_t(A + 1) * sizeof(int32_t)));
  w.plan.rows = static_cast<int32_t*>(take(size_t(pairs) * sizeof(int32_t)));
  w.plan.pair_rank = static_cast<int32_t*>(take(size_t(pairs) * sizeof(int32_t)));
  w.h = static_cast<uint16_t*>(take(size_t(h_rows) * size_t(ew.F) * sizeof(uint16_t)));
  w.o = static_cast<float*>(take(size_t(pairs) * size_t(ew.Din) * sizeof(float)));
  *bytes = used;
  return w;
}

// ---- plan ---------------------------------------------------------------------------------

// Exclusive prefix sum over the block (blockDim.x = kPlanThreads); *total gets the block's sum.
__device__ unsigned long long plan_exclusive_scan(unsigned long long v, unsigned long long* total) {
  __shared__ unsigned long long warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    unsigned long long s = warp_sums[lane];  // kPlanThreads / 32 == 32 warps
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const unsigned long long before = warp == 0 ? 0ull : warp_sums[warp - 1];
  *total = warp_sums[31];
  __syncthreads();  // warp_sums is reused by the next call
  return before + inclusive - v;
}

// One block. A pair's rank among its expert's rows = rows of that expert from earlier tokens:
// tokens go in groups of 32, bit (t − t0) of mask[e] says token t picks e, so the rank is
// count[e] (earlier groups) + the set bits below t's (stable order without a sort).
__global__ void __launch_bounds__(kPlanThreads)
    moe_decode_plan_kernel(const int32_t* __restrict__ idx, int N, int k, int E, Plan plan) {
  pdl_wait_then_launch_dependents();               // PDL (pdl.h): before any input is read
  __shared__ int32_t count[kMoeDecodeMaxExperts];  // rows so far; later the expert's first row
  __shared__ uint32_t mask[kMoeDecodeMaxExperts];
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kPlanThreads) count[e] = 0;
  for (int t0 = 0; t0 < N; t0 += 32) {
    for (int e = tid; e < E; e += kPlanThreads) mask[e] = 0u;
    __syncthreads();
    const int p0 = t0 * k, p1 = min(N, t0 + 32) * k;
    for (int p = p0 + tid; p < p1; p += kPlanThreads) {
      const int e = idx[p];
      if (e >= 0 && e < E) atomicOr(&mask[e], 1u << (p / k - t0));
    }
    __syncthreads();
    for (int p = p0 + tid; p < p1; p += kPlanThreads) {
      const int e = idx[p];
      if (e >= 0 && e < E)
        plan.pair_rank[p] = count[e] + __popc(mask[e] & ((1u << (p / k - t0)) - 1u));
    }
    __syncthreads();
    for (int e = tid; e < E; e += kPlanThreads) count[e] += __popc(mask[e]);
  }
  __syncthreads();
  // Exclusive scan of (rows, hit) over ascending experts, packed in one 64-bit sum: rows in the
  // high half, the hit count (≤ E) in the low half.
  unsigned long long carry = 0;
  for (int base = 0; base < E; base += kPlanThreads) {
    const int e = base + tid;
    const int c = e < E ? count[e] : 0;
    const unsigned long long v = (static_cast<unsigned long long>(c) << 32) | (c > 0 ? 1ull : 0ull);
    unsigned long long total;
    const unsigned long long before = carry + plan_exclusive_scan(v, &total);
    if (c > 0) {
      const int a = int(before & 0xffffffffull);
      plan.active_expert[a] = e;
      plan.row_begin[a] = int(before >> 32);
    }
    if (e < E) count[e] = int(before >> 32);
    carry += total;
  }
  if (tid == 0) {
    const int hit = int(carry & 0xffffffffull);
    *plan.active_count = hit;
    plan.row_begin[hit] = int(carry >> 32);
  }
  __syncthreads();  // count[] now holds first rows; pair_rank (global) is visible block-wide
  for (int p = tid; p < N * k; p += kPlanThreads) {
    const int e = idx[p];
    if (e >= 0 && e < E) plan.rows[count[e] + plan.pair_rank[p]] = p;
  }
}

// ---- expert GEMVs -------------------------------------------------------------------------

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 t = __bfloat1622float2(pairs[q]);
    f[2 * q] = t.x;
    f[2 * q + 1] = t.y;
  }
}

// acc[i][j] = W_i · X_j over `chunks` 16-byte chunks (8 bf16 each), summed over the warp (every
// lane gets the sums). Lane l takes chunks l, l + 32, …, kDotUnroll of them per weight row
// loaded before any is used: kDotUnroll·kWeightRows 16-byte loads in flight per lane (an expert
// row here is only 128–288 chunks, so a shallower pipeline spends most of it filling: the
// kernels ran at 1.9–2.7 TB/s with two loads per row in flight).
constexpr int kDotUnroll = 4;

template <int MT>
__device__ __forceinline__ void dot_chunk(const uint4 (&wv)[kWeightRows],
                                          const uint4* const (&x)[MT], int c,
                                          float (&acc)[kWeightRows][MT]) {
  // Weights are unpacked once per token (cheap next to the loads; keeps registers for the
  // loads in flight).
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    float xf[8];
    bf16x8_to_float(__ldg(x[j] + c), xf);
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i) {
      float wf[8];
      bf16x8_to_float(wv[i], wf);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[i][j] = fmaf(wf[q], xf[q], acc[i][j]);
    }
  }
}

template <int MT>
__device__ __forceinline__ void warp_rows_dot(const uint4* const (&w)[kWeightRows],
                                              const uint4* const (&x)[MT], int chunks, int lane,
                                              float (&acc)[kWeightRows][MT]) {
#pragma unroll
  for (int i = 0; i < kWeightRows; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[i][j] = 0.0f;
  int c = lane;
  for (; c + (kDotUnroll - 1) * 32 < chunks; c += kDotUnroll * 32) {
    uint4 wv[kDotUnroll][kWeightRows];
#pragma unroll
    for (int u = 0; u < kDotUnroll; ++u)
#pragma unroll
      for (int i = 0; i < kWeightRows; ++i) wv[u][i] = __ldcs(w[i] + c + u * 32);
#pragma unroll
    for (int u = 0; u < kDotUnroll; ++u) dot_chunk<MT>(wv[u], x, c + u * 32, acc);
  }
  for (; c < chunks; c += 32) {
    uint4 wv[kWeightRows];
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i) wv[i] = __ldcs(w[i] + c);
    dot_chunk<MT>(wv, x, c, acc);
  }
#pragma unroll
  for (int i = 0; i < kWeightRows; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[i][j] = warp_sum(acc[i][j]);
}

__device__ __forceinline__ float glu_value(float gate, float up, const GluKernelParams& p) {
  const float sig = sigmoid_f32(gate);  // the formulas of elementwise.cu glu_forward_kernel
  return p.situ ? (p.beta1 * tanhf(gate / p.beta1) * sig) * (p.beta2 * tanhf(up / p.beta2))
                : gate * sig * up;
}

// Hit expert a = blockIdx.y of the plan: its id and its rows rows[0..count); false when the
// block has no expert.
__device__ __forceinline__ bool block_expert(const Plan& plan, int& expert, const int32_t*& rows,
                                             int& count) {
  const int a = blockIdx.y;
  if (a >= *plan.active_count) return false;
  expert = plan.active_expert[a];
  rows = plan.rows + plan.row_begin[a];
  count = plan.row_begin[a + 1] - plan.row_begin[a];
  return true;
}

// A warp's weight rows: gate rows f0, f0 + 1 then up rows f0, f0 + 1 of `expert` (rows past F
// clamped to the last valid one, nf ≥ 1), each Din long.
__device__ __forceinline__ void gate_up_rows(const uint16_t* gate_w, const uint16_t* up_w,
                                             int expert, int64_t f0, int nf, int64_t F, int64_t Din,
                                             const uint4* (&w)[kWeightRows]) {
#pragma unroll
  for (int r = 0; r < kGateUpRowsPerWarp; ++r) {
    const int64_t row = (int64_t(expert) * F + f0 + min(r, nf - 1)) * Din;  // clamped tail row
    w[r] = reinterpret_cast<const uint4*>(gate_w + row);
    w[kGateUpRowsPerWarp + r] = reinterpret_cast<const uint4*>(up_w + row);
  }
}

// A warp's down rows: channels c0 … c0 + 3 of `expert` (clamped past Din, nc ≥ 1), each F long.
__device__ __forceinline__ void down_rows(const uint16_t* down_w, int expert, int64_t c0, int nc,
                                          int64_t Din, int64_t F, const uint4* (&w)[kWeightRows]) {
#pragma unroll
  for (int i = 0; i < kDownRowsPerWarp; ++i)
    w[i] =
        reinterpret_cast<const uint4*>(down_w + (int64_t(expert) * Din + c0 + min(i, nc - 1)) * F);
}

// One pass of up to MT tokens (rows[0..count)) against a warp's gate rows f0, f0+1 (w[0], w[1])
// and up rows (w[2], w[3]); valid rows nf ≤ 2. Stores spread over lanes (lane = 2j + r).
template <int MT>
__device__ __forceinline__ void gate_up_pass(const uint4* const (&w)[kWeightRows],
                                             const uint16_t* __restrict__ x, int64_t Din, int k,
                                             const int32_t* __restrict__ rows, int count,
                                             int64_t f0, int nf, int64_t F,
                                             const GluKernelParams& act, uint16_t* __restrict__ h,
                                             int lane, int token = -1) {
  // token ≥ 0 (MT = 1): the row's token, where it is not rows[0] / k (a shared-expert pair).
  const uint4* xr[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j)
    xr[j] = reinterpret_cast<const uint4*>(
        x + int64_t(token >= 0 ? token : rows[min(j, count - 1)] / k) * Din);
  float acc[kWeightRows][MT];
  warp_rows_dot<MT>(w, xr, int(Din / 8), lane, acc);
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int r = 0; r < kGateUpRowsPerWarp; ++r)
      if (lane == j * kGateUpRowsPerWarp + r && j < count && r < nf)
        store_from_float(h, int64_t(rows[j]) * F + f0 + r,
                         glu_value(acc[r][j], acc[kGateUpRowsPerWarp + r][j], act));
}

// Grid (ceil(F / 16), A), kThreads: warp w of block (bx, a) owns f rows f0 = (bx·8 + w)·2 … +1.
__global__ void __launch_bounds__(kThreads)
    moe_decode_gate_up_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ gate_w,
                              const uint16_t* __restrict__ up_w, int64_t Din, int64_t F, int k,
                              Plan plan, GluKernelParams act, uint16_t* __restrict__ h) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t f0 = (int64_t(blockIdx.x) * kWarps + warp) * kGateUpRowsPerWarp;
  if (f0 >= F) return;  // warp-uniform; the kernel has no block barrier
  int expert, count;
  const int32_t* rows;
  if (!block_expert(plan, expert, rows, count)) return;
  const int nf = int(min(int64_t(kGateUpRowsPerWarp), F - f0));
  const uint4* w[kWeightRows];
  gate_up_rows(gate_w, up_w, expert, f0, nf, F, Din, w);
  for (int r = 0; r < count;) {
    if (count - r == 1) {
      gate_up_pass<1>(w, x, Din, k, rows + r, 1, f0, nf, F, act, h, lane);
      r += 1;
    } else {
      gate_up_pass<kTokenPass>(w, x, Din, k, rows + r, min(count - r, kTokenPass), f0, nf, F, act,
                               h, lane);
      r += kTokenPass;
    }
  }
}

// One pass of up to MT tokens against a warp's down rows c0..c0+3 (valid nc ≤ 4).
template <int MT>
__device__ __forceinline__ void down_pass(const uint4* const (&w)[kWeightRows],
                                          const uint16_t* __restrict__ h, int64_t F, int64_t Din,
                                          const int32_t* __restrict__ rows, int count, int64_t c0,
                                          int nc, float* __restrict__ o, int lane) {
  const uint4* hr[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j)
    hr[j] = reinterpret_cast<const uint4*>(h + int64_t(rows[min(j, count - 1)]) * F);
  float acc[kWeightRows][MT];
  warp_rows_dot<MT>(w, hr, int(F / 8), lane, acc);
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int i = 0; i < kDownRowsPerWarp; ++i)
      if (lane == j * kDownRowsPerWarp + i && j < count && i < nc)
        o[int64_t(rows[j]) * Din + c0 + i] = acc[i][j];
}

// Grid (ceil(Din / 32), A), kThreads: warp w of block (bx, a) owns channels (bx·8 + w)·4 … +3.
__global__ void __launch_bounds__(kThreads)
    moe_decode_down_kernel(const uint16_t* __restrict__ h, const uint16_t* __restrict__ down_w,
                           int64_t Din, int64_t F, Plan plan, float* __restrict__ o) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t c0 = (int64_t(blockIdx.x) * kWarps + warp) * kDownRowsPerWarp;
  if (c0 >= Din) return;  // warp-uniform; the kernel has no block barrier
  int expert, count;
  const int32_t* rows;
  if (!block_expert(plan, expert, rows, count)) return;
  const int nc = int(min(int64_t(kDownRowsPerWarp), Din - c0));
  const uint4* w[kWeightRows];
  down_rows(down_w, expert, c0, nc, Din, F, w);
  for (int r = 0; r < count;) {
    if (count - r == 1) {
      down_pass<1>(w, h, F, Din, rows + r, 1, c0, nc, o, lane);
      r += 1;
    } else {
      down_pass<kTokenPass>(w, h, F, Din, rows + r, min(count - r, kTokenPass), c0, nc, o, lane);
      r += kTokenPass;
    }
  }
}

// ---- pair path (N·k ≤ kPairPathMaxPairs) ---------------------------------------------------

// Gate/up: grid (ceil(F / (2·kBlockWarps·kSteps)), N·k + shared pairs), 32·kBlockWarps threads:
// block (bx, p) applies expert idx[p]'s gate and up rows f0 = ((bx·kBlockWarps + w)·kSteps +
// step)·2 … +1 (warp w; pair_plan() picks the shape) to token p / k, h[p, f] exactly as
// gate_up_pass<1> of the planned kernel computes it; pair N·k + t (with a shared expert) applies
// the shared expert's rows to token t. A pair with an expert outside [0, E) is skipped (never
// combined).
template <int kSteps, int kBlockWarps>
__global__ void __launch_bounds__(kBlockWarps * 32)
    moe_decode_gate_up_pairs_kernel(const uint16_t* __restrict__ x,
                                    const uint16_t* __restrict__ gate_w,
                                    const uint16_t* __restrict__ up_w, int64_t Din, int64_t F,
                                    int k, const int32_t* __restrict__ idx, int E, int routed_pairs,
                                    SharedExpertBf16 shared, GluKernelParams act,
                                    uint16_t* __restrict__ h) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t pair = int32_t(blockIdx.y);
  const bool shared_pair = pair >= routed_pairs;
  // The shared expert's rows do not depend on the routing: lane 0 of each warp asks for them
  // into L2 before the wait (the routed experts' rows are known only after it).
  if (shared_pair && shared.prefetch && lane == 0) {
#pragma unroll 1
    for (int step = 0; step < kSteps; ++step) {
      const int64_t f0 =
          ((int64_t(blockIdx.x) * kBlockWarps + warp) * kSteps + step) * kGateUpRowsPerWarp;
      for (int r = 0; r < kGateUpRowsPerWarp && f0 + r < F; ++r) {
        prefetch_l2_bulk(shared.gate + (f0 + r) * Din, uint32_t(Din * 2));
        prefetch_l2_bulk(shared.up + (f0 + r) * Din, uint32_t(Din * 2));
      }
    }
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int expert = shared_pair ? 0 : idx[pair];
  if (expert < 0 || expert >= E) return;
#pragma unroll 1
  for (int step = 0; step < kSteps; ++step) {
    const int64_t f0 = ((int64_t(blockIdx.x) * kBlockWarps + warp) * kSteps + step) * kGateUpRowsPerWarp;
    if (f0 >= F) return;  // warp-uniform; the kernel has no block barrier
    const int nf = int(min(int64_t(kGateUpRowsPerWarp), F - f0));
    const uint4* w[kWeightRows];
    gate_up_rows(shared_pair ? shared.gate : gate_w, shared_pair ? shared.up : up_w, expert, f0, nf,
                 F, Din, w);
    gate_up_pass<1>(w, x, Din, k, &pair, 1, f0, nf, F, act, h, lane,
                    shared_pair ? pair - routed_pairs : -1);
  }
}

// Down + combine: grid ceil(Din / kChannels), block b owns channels c0 = kChannels·b … + kChannels
// − 1, its warps take pairs w, w + warps, …: dots[p][i] = W_down,idx[p][c0 + i, :]·h[p, :] for
// each group of 4 channels (warp_rows_dot, as down_pass<1>); then y[t, c0 + i] = Σ_slot w[t,
// slot]·dots[t·k + slot][i] in slot order, the combine kernel's sum: the same bits as the planned
// path, with one launch and no o buffer. With a shared expert (shared_pairs = N) the shared
// pair's dot is added last, weight 1. pair_plan() picks the shape.
template <bool kF32Out, int kChannels>
__global__ void __launch_bounds__(kPairDownMaxWarps * 32)
    moe_decode_down_combine_pairs_kernel(const uint16_t* __restrict__ h,
                                         const uint16_t* __restrict__ down_w, int64_t Din,
                                         int64_t F, const int32_t* __restrict__ idx,
                                         const float* __restrict__ weight, int N, int k, int E,
                                         const uint16_t* __restrict__ shared_down, int shared_pairs,
                                         bool prefetch_shared, void* __restrict__ y) {
  __shared__ float dots[2 * kPairPathMaxPairs][kChannels];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t block_c0 = int64_t(blockIdx.x) * kChannels;
  const int block_nc = int(min(int64_t(kChannels), Din - block_c0));
  // The shared expert's down rows of this block's channels into L2 before the wait (they do not
  // depend on the routing), one row per thread of the first warp. (The routed experts' rows the
  // same way, idx being final here, made the step slower: 1 x 32K 2.577 vs 2.480 ms, 4 x 32K
  // 6.069 vs 5.872, H200, twenty-third session.)
  if (shared_pairs > 0 && prefetch_shared && warp == 0 && lane < block_nc)
    prefetch_l2_bulk(shared_down + (block_c0 + lane) * F, uint32_t(F * 2));
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int routed_pairs = N * k;
  for (int p = warp; p < routed_pairs + shared_pairs; p += warps) {
    const bool shared_pair = p >= routed_pairs;
    const int expert = shared_pair ? 0 : idx[p];
    if (expert < 0 || expert >= E) continue;
    const uint4* const hr[1] = {reinterpret_cast<const uint4*>(h + int64_t(p) * F)};
#pragma unroll 1
    for (int group = 0; group < kChannels / kDownRowsPerWarp; ++group) {
      if (group * kDownRowsPerWarp >= block_nc) break;
      const int64_t c0 = block_c0 + group * kDownRowsPerWarp;
      const int nc = int(min(int64_t(kDownRowsPerWarp), Din - c0));
      const uint4* w[kWeightRows];
      down_rows(shared_pair ? shared_down : down_w, expert, c0, nc, Din, F, w);
      float acc[kWeightRows][1];
      warp_rows_dot<1>(w, hr, int(F / 8), lane, acc);
#pragma unroll
      for (int i = 0; i < kDownRowsPerWarp; ++i)
        if (lane == i) dots[p][group * kDownRowsPerWarp + i] = acc[i][0];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < N * block_nc; i += blockDim.x) {
    const int t = i / block_nc, c = i % block_nc;
    float sum = 0.0f;
    for (int s = 0; s < k; ++s) {
      const int pair = t * k + s;
      const int e = idx[pair];
      if (e < 0 || e >= E) continue;
      sum += weight[pair] * dots[pair][c];
    }
    if (shared_pairs > 0) sum += dots[routed_pairs + t][c];
    const int64_t at = int64_t(t) * Din + block_c0 + c;
    if constexpr (kF32Out)
      static_cast<float*>(y)[at] = sum;
    else
      static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(sum);
  }
}

// ---- combine ------------------------------------------------------------------------------

// y[t, 4q .. 4q+3] = Σ_slot w[t, slot]·o[t·k + slot, 4q .. 4q+3], fp32 sums in slot order (as
// moe.cu's unpermute); pairs with an expert outside [0, E) were never computed and are skipped.
template <bool kF32Out>
__global__ void moe_decode_combine_kernel(const float* __restrict__ o,
                                          const int32_t* __restrict__ idx,
                                          const float* __restrict__ w, int64_t N, int k, int E,
                                          int64_t Din, void* __restrict__ y) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t quads = Din / 4, total = N * quads;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / quads, q = i % quads;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < k; ++s) {
      const int64_t pair = t * k + s;
      const int e = idx[pair];
      if (e < 0 || e >= E) continue;
      const float weight = w[pair];
      const float4 v = reinterpret_cast<const float4*>(o + pair * Din)[q];
      acc.x += weight * v.x;
      acc.y += weight * v.y;
      acc.z += weight * v.z;
      acc.w += weight * v.w;
    }
    if constexpr (kF32Out) {
      reinterpret_cast<float4*>(y)[i] = acc;
    } else {
      uint2 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
      pairs[0] = __floats2bfloat162_rn(acc.x, acc.y);
      pairs[1] = __floats2bfloat162_rn(acc.z, acc.w);
      reinterpret_cast<uint2*>(y)[i] = packed;
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::atomic<bool> g_force_plan_kernel{false};
bool force_plan_kernel() { return g_force_plan_kernel.load(std::memory_order_relaxed); }

}  // namespace

void moe_decode_force_plan_kernel(bool on) { g_force_plan_kernel.store(on); }

bool moe_decode_supported(int64_t N, int k, const ExpertWeightsBf16& ew) {
  return ew.E >= 1 && ew.E <= kMoeDecodeMaxExperts && k >= 1 && k <= ew.E && ew.Din > 0 &&
         ew.F > 0 && ew.Din % 8 == 0 && ew.F % 8 == 0 && N >= 0 &&
         N * k < int64_t(std::numeric_limits<int32_t>::max());
}

// Measured (H200, Kimi-Linear-48B shape, 2026-11-29): at N·k = 2E (batch 64, k 8, E 256) the
// grouped GEMMs took 42.8 ms/step against 49.7 for these kernels, at N·k = E/32 (batch 1) 8.6
// against 6.0 (with graphs): the kernels do not yet reach the bandwidth their bytes allow once
// most experts are hit, so the bound is one row per expert on average.
bool moe_decode_preferred(int64_t N, int k, int64_t E) { return N * k <= E; }

bool moe_decode_folds_shared(int64_t N, int k, const ExpertWeightsBf16& ew, int64_t Fs) {
  // DM_MOE_DECODE_FOLD_SHARED=0 (read once) keeps the shared expert's own launches, to compare.
  static const bool allowed = env_flag("DM_MOE_DECODE_FOLD_SHARED", true);
  return allowed && N >= 1 && N * k <= kPairPathMaxPairs && !force_plan_kernel() && Fs == ew.F;
}

size_t moe_decode_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew, bool shared) {
  size_t bytes = 0;
  carve_workspace(nullptr, N, k, ew, shared, &bytes);
  return bytes;
}

void moe_decode_experts_forward(const uint16_t* x, const int32_t* idx, const float* w, int64_t N,
                                int k, const ExpertWeightsBf16& ew, const GluKernelParams& act,
                                void* y, GemmOutType y_type, void* workspace, CUstream_st* stream,
                                const SharedExpertBf16* shared) {
  const char* who = "moe_decode_experts_forward";
  DM_CHECK(moe_decode_supported(N, k, ew), who, ": unsupported shape N=", N, " k=", k, " E=",
           ew.E, " Din=", ew.Din, " F=", ew.F, " (need E ≤ ", kMoeDecodeMaxExperts,
           ", k ≤ E, Din and F multiples of 8)");
  DM_CHECK(!act.situ || (act.beta1 > 0.0f && act.beta2 > 0.0f), who,
           ": SiTU-GLU needs beta1 > 0 and beta2 > 0");
  if (N == 0) return;
  DM_CHECK(x && idx && w && y && workspace && ew.gate && ew.up && ew.down, who,
           ": null argument");
  DM_CHECK(aligned16(x) && aligned16(y) && aligned16(ew.gate) && aligned16(ew.up) &&
               aligned16(ew.down) && reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
           who, ": x, y and the weights must be 16-byte aligned, the workspace 256-byte aligned");
  if (shared) {
    DM_CHECK(moe_decode_folds_shared(N, k, ew, ew.F), who, ": a shared expert needs the pair path ",
             "(N·k ≤ ", kPairPathMaxPairs, "), got N=", N, " k=", k);
    DM_CHECK(shared->gate && shared->up && shared->down && aligned16(shared->gate) &&
                 aligned16(shared->up) && aligned16(shared->down),
             who, ": the shared expert's weights must be non-null and 16-byte aligned");
  }
  size_t bytes = 0;
  const Workspace ws = carve_workspace(workspace, N, k, ew, shared != nullptr, &bytes);
  const int64_t A = max_active_experts(N, k, ew.E);
  const int E = int(ew.E);
  if (N * k <= kPairPathMaxPairs && !force_plan_kernel()) {
    SharedExpertBf16 folded = shared ? *shared : SharedExpertBf16{};
    folded.prefetch = shared != nullptr && shared->prefetch && decode_l2_prefetch(N);
    const int shared_pairs = shared ? int(N) : 0;
    const PairPlan shape = pair_plan(N * k + shared_pairs);
    const dim3 gate_up_grid(
        unsigned(ceil_div(ew.F, shape.gate_up_warps * kGateUpRowsPerWarp * shape.gate_up_steps)),
        unsigned(N * k + shared_pairs));
    auto gate_up = [&](auto kernel) {
      launch_pdl(kernel, gate_up_grid, 32 * shape.gate_up_warps, 0, stream, x, ew.gate, ew.up,
                 ew.Din, ew.F, k, idx, E, int(N * k), folded, act, ws.h);
    };
    if (shape.gate_up_warps == 8)
      gate_up(shape.gate_up_steps == 2 ? moe_decode_gate_up_pairs_kernel<2, 8>
                                       : moe_decode_gate_up_pairs_kernel<1, 8>);
    else
      gate_up(shape.gate_up_steps == 2 ? moe_decode_gate_up_pairs_kernel<2, 4>
                                       : moe_decode_gate_up_pairs_kernel<1, 4>);
    check_last_error("moe_decode_gate_up_pairs_kernel");
    const unsigned down_blocks = unsigned(ceil_div(ew.Din, shape.down_channels));
    const unsigned down_threads = 32u * unsigned(shape.down_warps);
    auto down = [&](auto kernel) {
      launch_pdl(kernel, down_blocks, down_threads, 0, stream, ws.h, ew.down, ew.Din, ew.F, idx, w,
                 int(N), k, E, folded.down, shared_pairs, folded.prefetch, y);
    };
    const bool f32 = y_type == GemmOutType::F32;
    if (shape.down_channels == 8)
      down(f32 ? moe_decode_down_combine_pairs_kernel<true, 8>
               : moe_decode_down_combine_pairs_kernel<false, 8>);
    else
      down(f32 ? moe_decode_down_combine_pairs_kernel<true, 4>
               : moe_decode_down_combine_pairs_kernel<false, 4>);
    check_last_error("moe_decode_down_combine_pairs_kernel");
    return;
  }
  const Plan plan = ws.plan;
  launch_pdl(moe_decode_plan_kernel, 1, kPlanThreads, 0, stream, idx, int(N), k, E, plan);
  check_last_error("moe_decode_plan_kernel");
  const dim3 gate_up_grid(unsigned(ceil_div(ew.F, kWarps * kGateUpRowsPerWarp)), unsigned(A));
  launch_pdl(moe_decode_gate_up_kernel, gate_up_grid, kThreads, 0, stream, x, ew.gate, ew.up,
             ew.Din, ew.F, k, plan, act, ws.h);
  check_last_error("moe_decode_gate_up_kernel");
  const dim3 down_grid(unsigned(ceil_div(ew.Din, kWarps * kDownRowsPerWarp)), unsigned(A));
  launch_pdl(moe_decode_down_kernel, down_grid, kThreads, 0, stream, ws.h, ew.down, ew.Din, ew.F,
             plan, ws.o);
  check_last_error("moe_decode_down_kernel");
  const int64_t quads = N * (ew.Din / 4);
  const int blocks = int(std::min<int64_t>((quads + kCombineThreads - 1) / kCombineThreads, 4096));
  if (y_type == GemmOutType::F32)
    launch_pdl(moe_decode_combine_kernel<true>, blocks, kCombineThreads, 0, stream, ws.o, idx, w, N,
               k, E, ew.Din, y);
  else
    launch_pdl(moe_decode_combine_kernel<false>, blocks, kCombineThreads, 0, stream, ws.o, idx, w,
               N, k, E, ew.Din, y);
  check_last_error("moe_decode_combine_kernel");
}

}  // namespace dm::cuda
