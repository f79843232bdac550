// Mixture-of-experts kernels (SPEC §1.5, §1.6): sigmoid router with expert groups and QB cutoffs,
// QB histogram statistics, token dispatch (stable counting sort by expert), row gather/scatter
// and the grouped expert GEMMs through cublasGemmGroupedBatchedEx. The checked entry points are
// in moe.cpp (the fp32 row moves too); this file only launches.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda::moe_detail {

namespace {

constexpr int kRouteWarps = 4;
constexpr int kRouteLaneSlots = 8;  // experts per lane kept in registers (E ≤ 256)
constexpr int kScanThreads = 1024;

// Selection order of the router: larger value first, ties to the lower index (ops/cpu/moe.cpp
// TopList offers experts in ascending order and never lets an equal value displace).
__device__ __forceinline__ bool comes_before(float a_value, int a_index, float b_value,
                                             int b_index) {
  return a_value > b_value || (a_value == b_value && a_index < b_index);
}

// Warp-wide best (value, index) by comes_before; every lane gets the result.
__device__ __forceinline__ void warp_best(float& value, int& index) {
  for (int o = 16; o > 0; o >>= 1) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, o);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, o);
    if (comes_before(other_value, other_index, value, index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// Order-preserving unsigned key of a float (−0 counted as +0, as float comparison does): a > b
// ⇔ key(a) > key(b) for non-NaN a, b; route_key_value inverts it.
__device__ __forceinline__ unsigned route_order_key(float v) {
  const unsigned u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_key_value(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float router_sigmoid(float x) {
  return x < -87.0f ? 0.0f : 1.0f / (1.0f + expf(-x));
}

// One warp per token. The i-th pick is the best candidate strictly after pick i−1 in the
// selection order, so no "taken" mask is needed: O((k+1)·E/32) per lane. One instantiation per
// path (scores in registers or not, groups or not), so that a decode step's route kernel holds
// only the code it runs: the single kernel with every path was 62 KB of instructions, fetched
// cold by each of the step's 26 launches.
template <bool kInRegisters, bool kGrouped>
__global__ void moe_route_kernel(const RouteProblem p, const float* logits, const float* bias,
                                 float* scores, int32_t* idx, float* w, float* cutoff) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float group_score[kRouteWarps][kRouteMaxGroups];
  __shared__ unsigned char group_kept[kRouteWarps][kRouteMaxGroups];
  __shared__ int pick_expert[kRouteWarps][kRouteMaxPicks];
  __shared__ int sorted_expert[kRouteWarps][kRouteMaxPicks];
  __shared__ float sorted_score[kRouteWarps][kRouteMaxPicks];
  __shared__ float pick_score[kRouteWarps][kRouteMaxPicks];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + warp;
  if (t >= p.N) return;  // uniform per warp; the kernel has no block-wide barrier
  const int E = p.E, k = p.k;
  const float* logit_row = logits + t * E;
  float* score_row = scores + t * E;
  // Up to 32·kRouteLaneSlots experts a lane keeps its scores (and biases) in registers, loaded
  // together up front: at decode the kernel is a chain of dependent memory round trips (the
  // logits, the scores read back, the bias, the picks' scores), which is most of its time.
  constexpr bool in_registers = kInRegisters;  // E ≤ 32·kRouteLaneSlots
  float score_reg[kRouteLaneSlots], bias_reg[kRouteLaneSlots];
  if (in_registers) {
    float logit_reg[kRouteLaneSlots];
#pragma unroll
    for (int slot = 0; slot < kRouteLaneSlots; ++slot) {
      const int e = lane + 32 * slot;
      logit_reg[slot] = e < E ? logit_row[e] : 0.0f;
      bias_reg[slot] = e < E && bias ? bias[e] : 0.0f;
    }
#pragma unroll
    for (int slot = 0; slot < kRouteLaneSlots; ++slot) {
      const int e = lane + 32 * slot;
      score_reg[slot] = router_sigmoid(logit_reg[slot]);
      if (e < E) score_row[e] = score_reg[slot];
    }
  } else {
    for (int e = lane; e < E; e += 32) score_row[e] = router_sigmoid(logit_row[e]);
  }
  __syncwarp();
  auto biased = [&](int e) { return score_row[e] + (bias ? bias[e] : 0.0f); };

  constexpr bool grouped = kGrouped;  // p.n_group > 1 && p.topk_group < p.n_group
  const int group_size = E / p.n_group;
  if (grouped) {
    // A group scores the sum of its two best biased values (its single value if one expert).
    for (int grp = lane; grp < p.n_group; grp += 32) {
      float first = -INFINITY, second = -INFINITY;
      for (int e = grp * group_size; e < (grp + 1) * group_size; ++e) {
        const float v = biased(e);
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score[warp][grp] = group_size >= 2 ? first + second : first;
      group_kept[warp][grp] = 0;
    }
    __syncwarp();
    float previous_value = INFINITY;
    int previous_index = -1;
    for (int i = 0; i < p.topk_group; ++i) {
      float best_value = -INFINITY;
      int best_index = INT_MAX;
      for (int grp = lane; grp < p.n_group; grp += 32) {
        const float v = group_score[warp][grp];
        if (comes_before(previous_value, previous_index, v, grp) &&
            comes_before(v, grp, best_value, best_index)) {
          best_value = v;
          best_index = grp;
        }
      }
      warp_best(best_value, best_index);
      if (best_index == INT_MAX) break;
      if (lane == 0) group_kept[warp][best_index] = 1;
      previous_value = best_value;
      previous_index = best_index;
    }
    __syncwarp();
  }

  // Top-(k+1) over the eligible experts: k picks, the (k+1)-th value is the QB cutoff. Up to
  // 32·kRouteLaneSlots experts the lane's biased values stay in registers across the k + 1
  // rounds (at decode the rounds re-reading them from memory were most of the kernel's 10 µs).
  float cached[kRouteLaneSlots];
  unsigned eligible = 0u;
  if (in_registers) {
#pragma unroll
    for (int slot = 0; slot < kRouteLaneSlots; ++slot) {
      const int e = lane + 32 * slot;
      const bool ok = e < E && (!grouped || group_kept[warp][e / group_size]);
      cached[slot] = ok ? score_reg[slot] + bias_reg[slot] : 0.0f;  // = biased(e), bit for bit
      eligible |= ok ? 1u << slot : 0u;
    }
  }
  float cutoff_value = -INFINITY;
  int count = 0;
  if (in_registers) {
    // Each round: the lane's best eligible candidate (its slots ascend, so a tie keeps the lower
    // expert), the warp's largest value by one redux over order-preserving keys, the lowest
    // expert holding it by another: comes_before's order in two instructions where a shuffle
    // tree took five rounds of paired shuffles. The pick leaves its lane's eligible set.
    for (int i = 0; i <= k; ++i) {
      int best_slot = -1;
      float best_value = 0.0f, best_score = 0.0f;
#pragma unroll
      for (int slot = 0; slot < kRouteLaneSlots; ++slot) {
        const float v = cached[slot];
        if ((eligible >> slot & 1u) && v == v && (best_slot < 0 || v > best_value)) {
          best_slot = slot;
          best_value = v;
          best_score = score_reg[slot];
        }
      }
      if (!__any_sync(0xffffffffu, best_slot >= 0)) break;
      const unsigned key = best_slot >= 0 ? route_order_key(best_value) : 0u;
      const unsigned top = __reduce_max_sync(0xffffffffu, key);
      const unsigned mine =
          best_slot >= 0 && key == top ? unsigned(lane + 32 * best_slot) : 0xffffffffu;
      const int best_index = int(__reduce_min_sync(0xffffffffu, mine));
      if (lane == best_index % 32) {
        eligible &= ~(1u << (best_index / 32));
        if (i < k) {
          pick_expert[warp][i] = best_index;
          pick_score[warp][i] = best_score;
        }
      }
      if (i == k) cutoff_value = route_key_value(top);
      ++count;
    }
  } else {
    float previous_value = INFINITY;
    int previous_index = -1;
    for (int i = 0; i <= k; ++i) {
      float best_value = -INFINITY;
      int best_index = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        if (grouped && !group_kept[warp][e / group_size]) continue;
        const float v = biased(e);
        if (comes_before(previous_value, previous_index, v, e) &&
            comes_before(v, e, best_value, best_index)) {
          best_value = v;
          best_index = e;
        }
      }
      warp_best(best_value, best_index);
      if (best_index == INT_MAX) break;
      if (i < k) {
        if (lane == 0) pick_expert[warp][i] = best_index;
      } else {
        cutoff_value = best_value;
      }
      ++count;
      previous_value = best_value;
      previous_index = best_index;
    }
  }
  if (cutoff && lane == 0) cutoff[t] = count == k + 1 ? cutoff_value : -INFINITY;
  __syncwarp();

  // Without registers the picks' scores are read here once, in parallel (a serial walk through
  // score_row cost one memory round trip per pick).
  if (!in_registers)
    for (int i = lane; i < k; i += 32) pick_score[warp][i] = score_row[pick_expert[warp][i]];
  __syncwarp();
  // Ascending expert order: each pick's position is the number of smaller picked ids.
  for (int i = lane; i < k; i += 32) {
    const int e = pick_expert[warp][i];
    int position = 0;
    for (int j = 0; j < k; ++j) position += pick_expert[warp][j] < e;
    sorted_expert[warp][position] = e;
    sorted_score[warp][position] = pick_score[warp][i];
  }
  __syncwarp();
  float scale = p.scaling;
  if (p.renormalize) {
    // Summed in ascending expert order, as the CPU op does.
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += sorted_score[warp][i];
    scale = p.scaling / (sum + 1e-20f);
  }
  for (int i = lane; i < k; i += 32) {
    idx[t * k + i] = sorted_expert[warp][i];
    w[t * k + i] = sorted_score[warp][i] * scale;
  }
}

__global__ void qb_histogram_kernel(const float* scores, const float* cutoff, int64_t N, int E,
                                    double low, double inverse_width, int bins,
                                    unsigned long long* counts) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = N * E;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / E;
    const int j = int(i % E);
    const float c = cutoff[t];
    if (!isfinite(c)) continue;
    // Same double arithmetic as train/balance.cpp (no contraction), so the bins match exactly.
    const double r = __dsub_rn(double(c), double(scores[i]));
    int64_t bin = int64_t(floor(__dmul_rn(__dsub_rn(r, low), inverse_width)));
    bin = bin < 0 ? 0 : (bin >= bins ? bins - 1 : bin);
    atomicAdd(counts + int64_t(j) * bins + bin, 1ull);
  }
}

// Per block: counts of its pairs per expert in shared memory (E ≤ 8192), then one global add per
// nonzero expert. Integer sums: the result does not depend on the order.
__global__ void expert_loads_kernel(const int32_t* idx, int64_t pairs, int E,
                                    unsigned long long* loads) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  extern __shared__ unsigned int block_loads[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_loads[e] = 0;
  __syncthreads();
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int e = idx[p];
    if (e >= 0 && e < E) atomicAdd(block_loads + e, 1u);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (block_loads[e] != 0) atomicAdd(loads + e, (unsigned long long)block_loads[e]);
}

// Value at 0-based position p of one expert's histogram (train/balance.cpp's estimator).
__device__ double histogram_position_value(const int64_t* counts, int bins, double low,
                                           double width, int64_t p) {
  int64_t before = 0;
  for (int bin = 0; bin < bins; ++bin) {
    const int64_t c = counts[bin];
    if (before + c > p) {
      const double within = __ddiv_rn(__dadd_rn(double(p - before), 0.5), double(c));
      return __dadd_rn(low, __dmul_rn(width, __dadd_rn(double(bin), within)));
    }
    before += c;
  }
  return __dadd_rn(low, __dmul_rn(width, double(bins)));
}

__global__ void qb_raw_bias_kernel(const int64_t* counts, int E, int k, int bins, double low,
                                   double width, double* raw_bias) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= E) return;
  int64_t n = 0;  // every used token adds one count to every expert: read it off row 0
  for (int bin = 0; bin < bins; ++bin) n += counts[bin];
  if (n == 0) return;
  double position = __ddiv_rn(__dmul_rn(double(n), double(k)), double(E));
  position = fmin(fmax(position, 0.0), double(n - 1));
  const int64_t lower = int64_t(floor(position));
  const double fraction = position - double(lower);
  const int64_t* row = counts + int64_t(j) * bins;
  const double lower_value = histogram_position_value(row, bins, low, width, lower);
  double value = lower_value;
  if (fraction > 0.0 && lower + 1 < n)
    value = __dadd_rn(value, __dmul_rn(fraction, __dsub_rn(histogram_position_value(
                                                                row, bins, low, width, lower + 1),
                                                            lower_value)));
  raw_bias[j] = value;
}

// ---- dispatch ---------------------------------------------------------------------------------

// Exclusive prefix sum over the block (blockDim.x = kScanThreads); *total gets the block's sum.
template <typename T>
__device__ T block_exclusive_scan(T v, T* total) {
  __shared__ T warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  T inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T s = lane < warps ? warp_sums[lane] : T(0);
    for (int o = 1; o < 32; o <<= 1) {
      const T n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const T before = warp == 0 ? T(0) : warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + inclusive - v;
}

// chunk_counts[c, e] = pairs of token chunk c routed to expert e.
__global__ void dispatch_count_kernel(const int32_t* idx, int64_t N, int k, int E,
                                      int32_t* chunk_counts, int32_t* error_flag) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  extern __shared__ int expert_count[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) expert_count[e] = 0;
  __syncthreads();
  const int64_t chunk = blockIdx.x;
  const int64_t first = chunk * kDispatchChunkTokens * k;
  const int64_t last = min(N, (chunk + 1) * kDispatchChunkTokens) * k;
  for (int64_t r = first + threadIdx.x; r < last; r += blockDim.x) {
    const int e = idx[r];
    if (e < 0 || e >= E)
      atomicExch(error_flag, 1);
    else
      atomicAdd(&expert_count[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[chunk * E + e] = expert_count[e];
}

// Per expert: chunk_counts[:, e] → exclusive prefix over chunks; offsets[e+1] = total of e.
__global__ void dispatch_chunk_scan_kernel(int32_t* chunk_counts, int64_t chunks, int E,
                                           int64_t* offsets) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t running = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int32_t n = chunk_counts[c * E + e];
    chunk_counts[c * E + e] = int32_t(running);
    running += n;
  }
  offsets[e + 1] = running;
}

// offsets[1..E] (totals) → inclusive prefix sums; offsets[0] = 0. One block.
__global__ void dispatch_offsets_scan_kernel(int64_t* offsets, int E) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  int64_t carry = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int64_t v = e < E ? offsets[e + 1] : 0;
    int64_t total;
    const int64_t before = block_exclusive_scan<int64_t>(v, &total);
    if (e < E) offsets[e + 1] = carry + before + v;
    carry += total;
  }
  if (threadIdx.x == 0) offsets[0] = 0;
}

// One block per token chunk; after the cursors are set, its first warp hands out the rows. The
// chunk's (token, slot) pairs go 32 at a time in (token, slot) order, one a lane: a pair's row is
// its expert's cursor plus its rank among the lower lanes holding the same expert, and the lowest
// such lane advances the cursor by their count. Rows of one expert are thus in (token, slot) order
// (stable, like moe_plan_build). Ids outside [0, E) take no row (reported by the count kernel).
// Why 32 pairs a step: the former one-token-a-step walk was 256 dependent steps per chunk (73 µs
// at N = 4096, k = 6); now a chunk takes 256·k / 32 steps (48 at k = 6), the expert ids of
// kAssignGroups steps are loaded (a batch ahead) and matched together, and only the cursor
// update is serial.
constexpr int kAssignThreads = 128;  // cursor initialisation (E ≤ 8192); one warp assigns
constexpr int kAssignGroups = 8;     // 32-pair groups per batch of loads and matches

__global__ void dispatch_assign_kernel(const int32_t* idx, int64_t N, int k, int E,
                                       const int64_t* offsets, const int32_t* chunk_counts,
                                       int32_t* token, int32_t* slot, int32_t* row_of_pair) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  extern __shared__ int cursor[];
  const int64_t chunk = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    cursor[e] = int(offsets[e] + chunk_counts[chunk * E + e]);
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const unsigned lanes_below = (1u << lane) - 1u;
  // Pairs of the chunk, counted from its first: pair p is (token t0 + p / k, slot p % k).
  const int64_t t0 = chunk * kDispatchChunkTokens;
  const int pairs = int((min(N, t0 + kDispatchChunkTokens) - t0) * k);
  const int32_t* chunk_idx = idx + t0 * k;
  int32_t* chunk_row_of_pair = row_of_pair + t0 * k;
  constexpr int kBatch = 32 * kAssignGroups;  // pairs
  int next[kAssignGroups];                    // the next batch's expert ids, loaded ahead
  auto load = [&](int batch) {
#pragma unroll
    for (int g = 0; g < kAssignGroups; ++g) {
      const int p = batch + 32 * g + lane;
      next[g] = p < pairs ? chunk_idx[p] : -1;
    }
  };
  load(0);
  for (int batch = 0; batch < pairs; batch += kBatch) {
    int expert[kAssignGroups];  // −1: no pair, or an id outside [0, E)
#pragma unroll
    for (int g = 0; g < kAssignGroups; ++g) expert[g] = next[g] >= 0 && next[g] < E ? next[g] : -1;
    if (batch + kBatch < pairs) load(batch + kBatch);
    unsigned same[kAssignGroups];  // lanes of the group holding this lane's expert
#pragma unroll
    for (int g = 0; g < kAssignGroups; ++g) same[g] = __match_any_sync(0xffffffffu, expert[g]);
    // The serial part: per group, the lowest lane of each expert takes the expert's next rows.
    int first_row[kAssignGroups];
#pragma unroll
    for (int g = 0; g < kAssignGroups; ++g) {
      first_row[g] = 0;
      if (expert[g] >= 0 && (same[g] & lanes_below) == 0) {
        first_row[g] = cursor[expert[g]];
        cursor[expert[g]] = first_row[g] + __popc(same[g]);
      }
      __syncwarp();  // the next group's lowest lane of this expert may be another lane
    }
#pragma unroll
    for (int g = 0; g < kAssignGroups; ++g) {
      const int row = __shfl_sync(0xffffffffu, first_row[g], __ffs(same[g]) - 1) +
                      __popc(same[g] & lanes_below);
      const int p = batch + 32 * g + lane;
      if (expert[g] < 0) continue;
      token[row] = int32_t(t0 + p / k);
      slot[row] = p % k;
      chunk_row_of_pair[p] = row;
    }
  }
}

// Chunk: what one thread copies per step: uint4 (8 bf16 or 4 fp32 elements, 16-byte accesses)
// or float (fp32 rows whose width is not a multiple of 4, or that are not 16-byte aligned).
template <typename Chunk>
__global__ void permute_rows_kernel(const Chunk* x, const int32_t* token, int64_t rows,
                                    int64_t chunks_per_row, Chunk* sorted) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, c = i % chunks_per_row;
    sorted[i] = x[int64_t(token[r]) * chunks_per_row + c];
  }
}

__global__ void unpermute_rows_kernel(const uint4* sorted, const int32_t* row_of_pair,
                                      const float* w, int64_t N, int k, int64_t chunks_per_row,
                                      void* y, bool y_f32) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = N * chunks_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks_per_row, c = i % chunks_per_row;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < k; ++s) {
      const float weight = w[t * k + s];
      const uint4 packed = sorted[int64_t(row_of_pair[t * k + s]) * chunks_per_row + c];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(pairs[q]);
        acc[2 * q] += weight * f.x;
        acc[2 * q + 1] += weight * f.y;
      }
    }
    if (y_f32) {
      float4* out = static_cast<float4*>(y) + 2 * i;
      out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      uint4 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int q = 0; q < 4; ++q) pairs[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      static_cast<uint4*>(y)[i] = packed;
    }
  }
}

// kVec consecutive floats from p: one 16-byte access for kVec = 4 (p 16-byte aligned), else one
// scalar.
template <int kVec>
__device__ __forceinline__ void load_floats(const float* p, float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  } else {
    static_assert(kVec == 1, "kVec is 4 or 1");
    v[0] = p[0];
  }
}

// The fp32 twin of unpermute_rows_kernel: y [N, D] fp32 (written), sorted [N·k, D] fp32, one
// thread per kVec columns of a token, the same fp32 sums in slot order. kVec = 4 needs D % 4 == 0
// and 16-byte aligned sorted / y; kVec = 1 takes any D.
template <int kVec>
__global__ void unpermute_rows_f32_kernel(const float* sorted, const int32_t* row_of_pair,
                                          const float* w, int64_t N, int k, int64_t D, float* y) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t chunks_per_row = D / kVec, total = N * chunks_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks_per_row, c = i % chunks_per_row;
    float acc[kVec] = {};
    for (int s = 0; s < k; ++s) {
      const float weight = w[t * k + s];
      float v[kVec];
      load_floats<kVec>(sorted + int64_t(row_of_pair[t * k + s]) * D + c * kVec, v);
#pragma unroll
      for (int q = 0; q < kVec; ++q) acc[q] += weight * v[q];
    }
    float* out = y + t * D + c * kVec;
    if constexpr (kVec == 4)
      *reinterpret_cast<float4*>(out) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    else
      out[0] = acc[0];
  }
}

bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// cuBLAS grouped-GEMM pointer arrays for the non-empty experts in ascending order (group g).
// Layout (9E entries): A1 B1 C1 [2E each: gate groups 0..G−1, up groups G..2G−1], A2 B2 C2 [E].
__global__ void expert_pointer_kernel(const int64_t* offsets, const ExpertGemmBuffers b, int G) {
  const int E = b.E;
  const void** A1 = b.pointer_arrays;
  const void** B1 = A1 + 2 * E;
  const void** C1 = B1 + 2 * E;
  const void** A2 = C1 + 2 * E;
  const void** B2 = A2 + E;
  const void** C2 = B2 + E;
  const int64_t Din = b.Din, F = b.F;
  int carry = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int64_t begin = e < E ? offsets[e] : 0;
    const int nonempty = e < E && offsets[e + 1] > begin ? 1 : 0;
    int total;
    const int before = block_exclusive_scan<int>(nonempty, &total);
    if (nonempty) {
      const int g = carry + before;
      A1[g] = b.gate_w + int64_t(e) * F * Din;
      A1[G + g] = b.up_w + int64_t(e) * F * Din;
      B1[g] = B1[G + g] = b.x_sorted + begin * Din;
      C1[g] = b.gate_out + begin * F;
      C1[G + g] = b.up_out + begin * F;
      A2[g] = b.down_w + int64_t(e) * Din * F;
      B2[g] = (b.down_in ? b.down_in : b.gate_out) + begin * F;
      C2[g] = b.expert_out + begin * Din;
    }
    carry += total;
  }
}

int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return int(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

}  // namespace

void launch_route(const RouteProblem& p, const float* logits, const float* bias, float* scores,
                  int32_t* idx, float* w, float* cutoff, CUstream_st* stream) {
  if (p.N == 0) return;
  const bool in_registers = p.E <= 32 * kRouteLaneSlots;
  const bool grouped = p.n_group > 1 && p.topk_group < p.n_group;
  auto kernel = in_registers
                    ? (grouped ? moe_route_kernel<true, true> : moe_route_kernel<true, false>)
                    : (grouped ? moe_route_kernel<false, true> : moe_route_kernel<false, false>);
  launch_pdl(kernel, ceil_div(p.N, kRouteWarps), kRouteWarps * 32, 0, stream, p, logits, bias,
             scores, idx, w, cutoff);
  check_last_error("moe_route_kernel");
}

void launch_qb_histogram(const float* scores, const float* cutoff, int64_t N, int E, double low,
                         double inverse_width, int bins, int64_t* counts, CUstream_st* stream) {
  if (N == 0) return;
  launch_pdl(qb_histogram_kernel, grid_for(N * E, 256), 256, 0, stream, scores, cutoff, N, E, low,
             inverse_width, bins, reinterpret_cast<unsigned long long*>(counts));
  check_last_error("qb_histogram_kernel");
}

void launch_expert_loads(const int32_t* idx, int64_t pairs, int E, int64_t* loads,
                         CUstream_st* stream) {
  if (pairs == 0) return;
  const int blocks = int(std::min<int64_t>((pairs + 255) / 256, 512));
  launch_pdl(expert_loads_kernel, blocks, 256, size_t(E) * sizeof(unsigned int), stream, idx, pairs,
             E, reinterpret_cast<unsigned long long*>(loads));
  check_last_error("expert_loads_kernel");
}

void launch_qb_raw_bias(const int64_t* counts, int E, int k, int bins, double low, double width,
                        double* raw_bias, CUstream_st* stream) {
  qb_raw_bias_kernel<<<ceil_div(E, 128), 128, 0, stream>>>(counts, E, k, bins, low, width,
                                                           raw_bias);
  check_last_error("qb_raw_bias_kernel");
}

size_t dispatch_scratch_bytes(int64_t N, int E) {
  const int64_t chunks = (N + kDispatchChunkTokens - 1) / kDispatchChunkTokens;
  return size_t(std::max<int64_t>(chunks, 1)) * size_t(E) * sizeof(int32_t);
}

void launch_dispatch_plan(const int32_t* idx, int64_t N, int k, int E, int64_t* offsets,
                          int32_t* token, int32_t* slot, int32_t* row_of_pair, void* scratch,
                          int32_t* error_flag, CUstream_st* stream) {
  const int64_t chunks = (N + kDispatchChunkTokens - 1) / kDispatchChunkTokens;
  int32_t* chunk_counts = static_cast<int32_t*>(scratch);
  const size_t expert_smem = size_t(E) * sizeof(int);
  if (chunks > 0) {
    launch_pdl(dispatch_count_kernel, unsigned(chunks), 256, expert_smem, stream, idx, N, k, E,
               chunk_counts, error_flag);
    check_last_error("dispatch_count_kernel");
  } else {
    DM_CUDA_CHECK(cudaMemsetAsync(offsets, 0, (size_t(E) + 1) * sizeof(int64_t), stream));
  }
  launch_pdl(dispatch_chunk_scan_kernel, ceil_div(E, 128), 128, 0, stream, chunk_counts, chunks, E,
             offsets);
  check_last_error("dispatch_chunk_scan_kernel");
  launch_pdl(dispatch_offsets_scan_kernel, 1, kScanThreads, 0, stream, offsets, E);
  check_last_error("dispatch_offsets_scan_kernel");
  if (chunks > 0) {
    launch_pdl(dispatch_assign_kernel, unsigned(chunks), kAssignThreads, expert_smem, stream, idx,
               N, k, E, offsets, chunk_counts, token, slot, row_of_pair);
    check_last_error("dispatch_assign_kernel");
  }
}

void launch_permute_rows(const uint16_t* x, const int32_t* token, int64_t rows, int64_t D,
                         uint16_t* sorted, CUstream_st* stream) {
  if (rows == 0 || D == 0) return;
  launch_pdl(permute_rows_kernel<uint4>, grid_for(rows * (D / 8), 256), 256, 0, stream,
             reinterpret_cast<const uint4*>(x), token, rows, D / 8,
             reinterpret_cast<uint4*>(sorted));
  check_last_error("permute_rows_kernel");
}

void launch_unpermute_rows(const uint16_t* sorted, const int32_t* row_of_pair, const float* w,
                           int64_t N, int k, int64_t D, void* y, bool y_f32,
                           CUstream_st* stream) {
  if (N == 0 || D == 0) return;
  launch_pdl(unpermute_rows_kernel, grid_for(N * (D / 8), 256), 256, 0, stream,
             reinterpret_cast<const uint4*>(sorted), row_of_pair, w, N, k, D / 8, y, y_f32);
  check_last_error("unpermute_rows_kernel");
}

void launch_permute_rows(const float* x, const int32_t* token, int64_t rows, int64_t D,
                         float* sorted, CUstream_st* stream) {
  if (rows == 0 || D == 0) return;
  if (D % 4 == 0 && aligned_16(x) && aligned_16(sorted))
    launch_pdl(permute_rows_kernel<uint4>, grid_for(rows * (D / 4), 256), 256, 0, stream,
               reinterpret_cast<const uint4*>(x), token, rows, D / 4,
               reinterpret_cast<uint4*>(sorted));
  else
    launch_pdl(permute_rows_kernel<float>, grid_for(rows * D, 256), 256, 0, stream, x, token, rows,
               D, sorted);
  check_last_error("permute_rows_kernel (fp32)");
}

void launch_unpermute_rows(const float* sorted, const int32_t* row_of_pair, const float* w,
                           int64_t N, int k, int64_t D, float* y, CUstream_st* stream) {
  if (N == 0 || D == 0) return;
  if (D % 4 == 0 && aligned_16(sorted) && aligned_16(y))
    launch_pdl(unpermute_rows_f32_kernel<4>, grid_for(N * (D / 4), 256), 256, 0, stream, sorted,
               row_of_pair, w, N, k, D, y);
  else
    launch_pdl(unpermute_rows_f32_kernel<1>, grid_for(N * D, 256), 256, 0, stream, sorted,
               row_of_pair, w, N, k, D, y);
  check_last_error("unpermute_rows_f32_kernel");
}

size_t expert_pointer_array_bytes(int E) { return size_t(9) * size_t(E) * sizeof(void*); }

size_t expert_grouped_host_bytes(int E) {
  return size_t(2) * size_t(E) * (2 * sizeof(cublasOperation_t) + 7 * sizeof(int) + 2 * sizeof(float));
}

void run_expert_gemms_grouped(void* cublas_handle, const ExpertGemmBuffers& b,
                              const int64_t* host_offsets, const int64_t* device_offsets,
                              int phase, void* host_scratch, CUstream_st* stream) {
  const int E = b.E;
  int G = 0;
  for (int e = 0; e < E; ++e) G += host_offsets[e + 1] > host_offsets[e];
  if (G == 0) return;
  if (phase == 0) {
    expert_pointer_kernel<<<1, kScanThreads, 0, stream>>>(device_offsets, b, G);
    check_last_error("expert_pointer_kernel");
  }
  // Host descriptor arrays, one entry per group.
  const int groups = phase == 0 ? 2 * G : G;
  char* cursor = static_cast<char*>(host_scratch);
  auto take = [&](size_t bytes) {
    void* p = cursor;
    cursor += bytes;
    return p;
  };
  auto* op_a = static_cast<cublasOperation_t*>(take(2 * E * sizeof(cublasOperation_t)));
  auto* op_b = static_cast<cublasOperation_t*>(take(2 * E * sizeof(cublasOperation_t)));
  int* m = static_cast<int*>(take(2 * E * sizeof(int)));
  int* n = static_cast<int*>(take(2 * E * sizeof(int)));
  int* kdim = static_cast<int*>(take(2 * E * sizeof(int)));
  int* lda = static_cast<int*>(take(2 * E * sizeof(int)));
  int* ldb = static_cast<int*>(take(2 * E * sizeof(int)));
  int* ldc = static_cast<int*>(take(2 * E * sizeof(int)));
  int* group_size = static_cast<int*>(take(2 * E * sizeof(int)));
  float* alpha = static_cast<float*>(take(2 * E * sizeof(float)));
  float* beta = static_cast<float*>(take(2 * E * sizeof(float)));
  // Column-major view (see gemm.cu): out_rowmajor[rows, N] = in[rows, K]·W[N, K]ᵀ is
  // Cᵀ[N, rows] = op_T(W as [K, N]) · in as [K, rows].
  const int64_t out_dim = phase == 0 ? b.F : b.Din, in_dim = phase == 0 ? b.Din : b.F;
  int g = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t rows = host_offsets[e + 1] - host_offsets[e];
    if (rows == 0) continue;
    for (int copy = 0; copy < (phase == 0 ? 2 : 1); ++copy) {
      const int i = g + copy * G;
      op_a[i] = CUBLAS_OP_T;
      op_b[i] = CUBLAS_OP_N;
      m[i] = int(out_dim);
      n[i] = int(rows);
      kdim[i] = int(in_dim);
      lda[i] = int(in_dim);
      ldb[i] = int(in_dim);
      ldc[i] = int(out_dim);
      group_size[i] = 1;
      alpha[i] = 1.0f;
      beta[i] = 0.0f;
    }
    ++g;
  }
  const void* const* A = b.pointer_arrays + (phase == 0 ? 0 : 6 * E);
  const void* const* B = A + (phase == 0 ? 2 * E : E);
  void* const* C = const_cast<void* const*>(B + (phase == 0 ? 2 * E : E));
  cublasHandle_t handle = static_cast<cublasHandle_t>(cublas_handle);
  const cublasStatus_t set_status = cublasSetStream(handle, stream);
  DM_CHECK(set_status == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed: ", int(set_status));
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      handle, op_a, op_b, m, n, kdim, alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, beta, C,
      CUDA_R_16BF, ldc, groups, group_size, CUBLAS_COMPUTE_32F);
  DM_CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasGemmGroupedBatchedEx (phase ", phase,
           ", ", groups, " groups) failed: cuBLAS status ", int(status));
}

void copy_to_host_and_wait(void* dst0, const void* src0, size_t bytes0, void* dst1,
                           const void* src1, size_t bytes1, CUstream_st* stream) {
  if (bytes0) DM_CUDA_CHECK(cudaMemcpyAsync(dst0, src0, bytes0, cudaMemcpyDeviceToHost, stream));
  if (bytes1) DM_CUDA_CHECK(cudaMemcpyAsync(dst1, src1, bytes1, cudaMemcpyDeviceToHost, stream));
  DM_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void copy_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  if (bytes) DM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

void memset_async(void* dst, int value, size_t bytes, CUstream_st* stream) {
  if (bytes) DM_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream));
}

}  // namespace dm::cuda::moe_detail
