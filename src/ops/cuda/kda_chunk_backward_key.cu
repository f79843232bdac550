// Stage 4 of the chunked KDA backward, split (KdaBackwardPath::TensorCoreSplit), second kernel:
// the key side, one block per (chunk, batch-head, half of K), after the value kernel
// (kda_chunk_backward_value.cu). Same algebra and precision per product as stages 2–4 of the
// fused kernel (kda_chunk_backward_tc.cu), restricted to the block's KH = KP/2 channels
// c0 + [0, KH):
//   dQd = dO·Sᵀ (bf16) and dKd = −dX·Sᵀ (tf32) in one pass over S's slabs, dKe = V'·dS'ᵀ
//   (tf32) in one over the dS' slabs, with dγ = e^γ ⊙ rowsum(S ⊙ dS') from those,
//   the pairwise sums of dL = β·dM and dP (F, G, G^q formed in the operand loaders from k̂, q̂, Γ
//   instead of stored), dΓ, E = dKe⊙Ke (kept from the dKe product), dg's scans, and dq, dk through
//   the L2 norms.
// Every quantity is per channel except the row sums over all K:
//   - dβ: the value kernel's two partials, added by half 0 (rank 0 of the cluster);
//   - the L2-norm backward dx = inv·(dû − u·(u·dû)) needs u·dû (for q and k) over the whole row:
//     the two halves run as a cluster of two blocks and read each other's partial row dots
//     from shared memory (DSMEM), summing them in rank order, so both halves use the same bits.
// Shared memory at K = V = 128: raw q, k [C, KH+8] bf16, Γ [C, KH+4], dP and dL [C, C+4], dO
// [C, VP+8] bf16 (then dΓ), two slab buffers [KH, 40] (then E); the scans' run totals reuse
// the raw q rows: ~110 KB, two blocks per SM of 512 threads (kMaxColGroups below).
#include <cooperative_groups.h>

#include <cstdlib>
#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_stage4_mma.cuh"

namespace dm::cuda::kda_detail {
namespace {

namespace cg = cooperative_groups;

// Warps per 16-row sub-block (column groups, kda_stage4_column_groups): each warp holds a 16-row
// × (KH/groups) tile of dq̂, dk̂ in registers. Four groups (512 threads, 2 tiles of 8 columns per
// warp) when KH % 32 == 0, else two (256 threads, up to 4 tiles): twice the warps per SM to hide
// the phases' memory and barrier latency at the same two blocks per SM (registers: 64 per thread
// instead of 128).
constexpr int kMaxColGroups = kKdaStage4MaxColGroups;

struct KeyLayout {
  int ldr;  // raw q, k rows (bf16): KH + 8
  int ldg;  // Γ rows and the [C, KH] fp32 buffers (dΓ, E, dq, dk): KH + 4
  int ldo;  // dO rows (bf16): VP + 8
  int query_raw, key_raw, gamma, d_query_key, d_lower, d_out, slabs, vectors, total;
};
// β, 1/‖q‖, 1/‖k‖, seg, diag(dP), row dots (q, k) by warp column group [kMaxColGroups, C] each,
// the block's row dots (q, k) [C] each, their cluster totals [C] each; e^γ ⊙ rowsum(S ⊙ dS')
// [KH]; max |Γ_i − Γ_m| per sub-block (float bits) [4].
constexpr int kKeyVectorFloats =
    (9 + 2 * kMaxColGroups) * kChunk + kKdaCudaMaxHeadDim / 2 + kNumSubBlocks;

// Phase clock (bench_cuda_kda --phases), as in the value kernel (block: middle chunk, first
// batch-head, K half 0). Stamps inside the key-side and pairwise phases time warp 0.
constexpr int kKeyStamps = 11;
__device__ int g_key_clock_on;
__device__ long long g_key_clock[kKeyStamps];
const char* const kKeyPhaseNames[kKeyStamps] = {"start",
                                                "row loads",
                                                "norms, Gamma, dP, dL",
                                                "dQd, dKd (one pass)",
                                                "(none: dKd is in the pass)",
                                                "dKe, E, dgamma",
                                                "pairwise rows/cols",
                                                "pairwise inside",
                                                "dGamma, dots, cluster",
                                                "dg scans",
                                                "dg, dq, dk writes"};

__host__ __device__ inline KeyLayout key_layout(int KP, int VP) {
  const int KH = KP / 2;
  KeyLayout l;
  l.ldr = KH + 8;
  l.ldg = KH + 4;
  l.ldo = VP + 8;
  auto round16 = [](int bytes) { return (bytes + 15) / 16 * 16; };
  auto most = [](int a, int b) { return a > b ? a : b; };
  const int channel_matrix = kChunk * l.ldg * 4;  // [C, ldg] fp32
  int at = 0;
  l.query_raw = at;
  at += round16(kChunk * l.ldr * 2);
  l.key_raw = at;
  at += round16(kChunk * l.ldr * 2);
  l.gamma = at;
  at += round16(channel_matrix);
  // dP and dL; dq and dk staged here at the end ([C, KH+4] fits [C, C+4]: KH ≤ 64).
  l.d_query_key = at;
  at += round16(kChunk * kLdPair * 4);
  l.d_lower = at;
  at += round16(kChunk * kLdPair * 4);
  l.d_out = at;
  at += round16(most(kChunk * l.ldo * 2, channel_matrix));  // dO, then dΓ
  l.slabs = at;
  at += round16(most(2 * KH * kSlabLd * 4, channel_matrix));  // then E
  l.vectors = at;
  at += kKeyVectorFloats * 4;
  l.total = at;
  return l;
}

// One pass over the block's rows of S [c0 + KH rows, VP] (slab by slab, as key_side_product
// stages them) for the two products that read S:
//   acc_q += dO·Sᵀ (bf16: A the raw dO bits [C, ldo] in shared memory, B rounded to bf16),
//   acc_k += dX·Sᵀ (tf32: A = dX [C, VP] fp32 in global memory),
// sharing every B pair load (one k16 step of the bf16 product reads the pairs of the two k8
// steps of the tf32 one). Every thread of the block calls it; it ends with a barrier, after
// which the slabs are free.
template <int kTiles, int kBlockThreads>
__device__ __forceinline__ void state_pass(float (&acc_q)[kTiles][4], float (&acc_k)[kTiles][4],
                                           int n_tiles, int col0, int c0, int KH, int VP, int r0,
                                           const float* state, const uint16_t* d_out_s, int ldo,
                                           const float* d_x, float* slabs) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int count = VP / kSlab, buffer = KH * kSlabLd;
  stage_slab<kBlockThreads>(slabs, state, c0, KH, VP, 0);
  attention_detail::cp_async_commit();
  for (int s = 0; s < count; ++s) {
    if (s + 1 < count) {
      // Buffer (s+1)&1 was last read by slab s−1, before the barrier that ended its step.
      stage_slab<kBlockThreads>(slabs + ((s + 1) & 1) * buffer, state, c0, KH, VP, s + 1);
      attention_detail::cp_async_commit();
      attention_detail::cp_async_wait<1>();
    } else {
      attention_detail::cp_async_wait<0>();
    }
    __syncthreads();
    const float* slab = slabs + (s & 1) * buffer;  // [KH, kSlabLd], row = channel − c0
#pragma unroll
    for (int k0 = 0; k0 < kSlab; k0 += 16) {
      const int k = k0 + 2 * tq, e = s * kSlab + k;  // slab column, absolute column
      const uint16_t* o_top = d_out_s + (r0 + g) * ldo + e;
      const uint16_t* o_bottom = o_top + 8 * ldo;
      const uint32_t a_out[4] = {*reinterpret_cast<const uint32_t*>(o_top),
                                 *reinterpret_cast<const uint32_t*>(o_bottom),
                                 *reinterpret_cast<const uint32_t*>(o_top + 8),
                                 *reinterpret_cast<const uint32_t*>(o_bottom + 8)};
      const float* x_top = d_x + (r0 + g) * VP + e;
      const float* x_bottom = x_top + 8 * VP;
      const float2 x0 = load_pair(x_top), x1 = load_pair(x_bottom), x2 = load_pair(x_top + 8),
                   x3 = load_pair(x_bottom + 8);
      const uint32_t a_x0[4] = {to_tf32(x0.x), to_tf32(x1.x), to_tf32(x0.y), to_tf32(x1.y)};
      const uint32_t a_x1[4] = {to_tf32(x2.x), to_tf32(x3.x), to_tf32(x2.y), to_tf32(x3.y)};
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
        if (j < n_tiles) {
          const float* b = slab + (col0 - c0 + 8 * j + g) * kSlabLd + k;
          const float2 b0 = load_pair(b), b1 = load_pair(b + 8);
          mma_bf16_16x8x16(acc_q[j], a_out, pack_bf16(b0.x, b0.y), pack_bf16(b1.x, b1.y));
          mma_tf32_16x8x8(acc_k[j], a_x0, to_tf32(b0.x), to_tf32(b0.y));
          mma_tf32_16x8x8(acc_k[j], a_x1, to_tf32(b1.x), to_tf32(b1.y));
        }
    }
    __syncthreads();
  }
}

template <int kColGroups, int kStaticDims>
__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(kNumSubBlocks* kColGroups * 32, 2)
    kda_chunk_grad_key_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* g_in,
                              const uint16_t* beta_in, const uint16_t* d_o,
                              const int32_t* doc_start, float* dq, float* dk, float* dg,
                              float* dbeta, KdaDims d, KdaForwardWorkspace ws,
                              const float* d_states, KdaSplitWorkspace split, float inside_limit,
                              bool per_block_refs) {
  constexpr int kBlockWarps = kNumSubBlocks * kColGroups, kBlockThreads = 32 * kBlockWarps;
  constexpr int kTiles = 8 / kColGroups;  // 8-column mma tiles per warp: KH/groups/8 for KH ≤ 64
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // K = V = kStaticDims when > 0 (the common 128): the layout and every stride fold to
  // constants, which frees the registers that would hold them.
  const int KP = kStaticDims > 0 ? kStaticDims : d.KP, VP = kStaticDims > 0 ? kStaticDims : d.VP;
  const KeyLayout l = key_layout(KP, VP);
  const int ldr = l.ldr, ldg = l.ldg, ldo = l.ldo;
  uint16_t* query_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.query_raw);  // [C, ldr]
  uint16_t* key_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.key_raw);      // [C, ldr]
  float* gam = reinterpret_cast<float*>(shared_bytes + l.gamma);                  // [C, ldg] Γ
  float* d_pqk = reinterpret_cast<float*>(shared_bytes + l.d_query_key);          // [C, kLdPair] dP
  float* d_lkk = reinterpret_cast<float*>(shared_bytes + l.d_lower);              // [C, kLdPair] dL
  uint16_t* d_out_s = reinterpret_cast<uint16_t*>(shared_bytes + l.d_out);  // [C, ldo] dO bits
  float* slabs = reinterpret_cast<float*>(shared_bytes + l.slabs);
  // [2, kBlockThreads] fp32: the dg scans' run totals, in the raw q rows once those are dead
  // (64·(KH+8)·2 bytes ≥ 2·4·kBlockThreads: KH ≥ 16 with two groups, ≥ 32 with four).
  float* scan = reinterpret_cast<float*>(query_raw);
  float* vec = reinterpret_cast<float*>(shared_bytes + l.vectors);
  float* beta_s = vec;                                  // [C]
  float* query_inv = beta_s + kChunk;                   // [C]
  float* key_inv = query_inv + kChunk;                  // [C]
  int* seg = reinterpret_cast<int*>(key_inv + kChunk);  // [C]
  float* diag_pqk = key_inv + 2 * kChunk;               // [C] diagonal of dP
  float* dots_query = diag_pqk + kChunk;                // [groups, C] q·dq̂ by column group
  float* dots_key = dots_query + kMaxColGroups * kChunk;       // [groups, C] k·dk̂
  float* block_dot_query = dots_key + kMaxColGroups * kChunk;  // [C] over the block's channels
  float* block_dot_key = block_dot_query + kChunk;      // [C]
  float* dot_query = block_dot_key + kChunk;            // [C] over all K (both blocks)
  float* dot_key = dot_query + kChunk;                  // [C]
  float* d_gamma_last = dot_key + kChunk;               // [KH] e^γ ⊙ rowsum(S ⊙ dS')
  unsigned* inside_exponent =  // [4] max |Γ_i − Γ_m| per sub-block, float bits
      reinterpret_cast<unsigned*>(d_gamma_last + kKdaCudaMaxHeadDim / 2);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KH = KP / 2;
  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
  const int64_t ch = bh * d.num_chunks + n;
  const int half = blockIdx.z, c0 = half * KH;
  const int c_len = kda_chunk_length(d, n);
  const float* state = ws.states + ch * KP * VP;             // [KP, VP] S
  const float* d_state = d_states + ch * KP * VP;            // [KP, VP] dS'
  const float* value_new = ws.value_new + ch * kChunk * VP;  // [C, VP]  V'
  const float* decay_whole = ws.decay_whole + ch * KP;
  const float* d_x = split.d_x + ch * kChunk * VP;  // [C, VP]  dX
  auto token_row = [&](int i) { return kda_token_row(d, b, h, t0 + i); };
  const bool stamping = g_key_clock_on && blockIdx.y == 0 && blockIdx.z == 0 &&
                        blockIdx.x == gridDim.x / 2 && tid == 0;
  auto stamp = [&](int phase) {
    if (stamping) g_key_clock[phase] = clock64();
  };
  stamp(0);
  // dP and dM's two value-half partials [2, C, C] each, in flight from here through the row
  // loads and the norms; summed (in a fixed order) and masked into dP, dL = β·dM once their
  // shared matrices are free.
  constexpr int kPairSteps = kChunk * kChunk / 4 / kBlockThreads;
  float4 pairs[kPairSteps][4];
  {
    const float* query_key_parts = split.d_query_key + 2 * ch * kChunk * kChunk;
    const float* mix_parts = split.d_mix + 2 * ch * kChunk * kChunk;
#pragma unroll
    for (int u = 0; u < kPairSteps; ++u) {
      const int at = 4 * (tid + u * kBlockThreads);  // row i = at / C, columns at % C + [0, 4)
      pairs[u][0] = *reinterpret_cast<const float4*>(query_key_parts + at);
      pairs[u][1] = *reinterpret_cast<const float4*>(query_key_parts + kChunk * kChunk + at);
      pairs[u][2] = *reinterpret_cast<const float4*>(mix_parts + at);
      pairs[u][3] = *reinterpret_cast<const float4*>(mix_parts + kChunk * kChunk + at);
    }
  }

  // Channel c below is absolute (c0 ≤ c < c0 + KH); the shared rows hold c − c0.
  auto key_hat = [&](int i, int c) {
    return bf16_bits_to_float(key_raw[i * ldr + c - c0]) * key_inv[i];
  };
  auto query_hat = [&](int i, int c) {
    return bf16_bits_to_float(query_raw[i * ldr + c - c0]) * query_inv[i] * d.scale;
  };
  auto gamma_at = [&](int i, int c) { return gam[i * ldg + c - c0]; };
  auto key_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(key_raw + i * ldr + c - c0);
    const float inv = key_inv[i];
    return make_float2(__uint_as_float(bits << 16) * inv,
                       __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto query_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(query_raw + i * ldr + c - c0);
    const float inv = query_inv[i] * d.scale;
    return make_float2(__uint_as_float(bits << 16) * inv,
                       __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto gamma2 = [&](int i, int c) { return load_pair(gam + i * ldg + c - c0); };

  // ---- 0. The block's channels of q, k (bf16 bits) into their rows and of g into the slab
  // buffers, the dO rows (bits) into their slot: all by cp.async when K, V and the pointers allow
  // 16-byte pieces, so every load of the phase is in flight at once; zero past the chunk end, K
  // and V.
  uint16_t* gate_bits = reinterpret_cast<uint16_t*>(slabs);  // [C, ldr]
  const bool rows_by_8 = kda_rows_by_8(d, q, k, g_in, d_o);
  if (rows_by_8) {
    using attention_detail::cp_async_16;
    const int per_row_half = KH / 8;
    for (int idx = tid; idx < kChunk * per_row_half; idx += kBlockThreads) {
      const int i = idx / per_row_half, col = idx % per_row_half * 8;
      const bool valid = i < c_len && c0 + col < d.K;  // K % 8 == 0: all 8 inside K or none
      const int64_t at = valid ? token_row(i) * d.K + c0 + col : 0;
      cp_async_16(query_raw + i * ldr + col, q + at, valid);
      cp_async_16(key_raw + i * ldr + col, k + at, valid);
      cp_async_16(gate_bits + i * ldr + col, g_in + at, valid);
    }
    const int per_row_v = VP / 8;
    for (int idx = tid; idx < kChunk * per_row_v; idx += kBlockThreads) {
      const int i = idx / per_row_v, e = idx % per_row_v * 8;
      const bool valid = i < c_len && e < d.V;
      cp_async_16(d_out_s + i * ldo + e, d_o + (valid ? token_row(i) * d.V + e : 0), valid);
    }
    attention_detail::cp_async_commit();
  } else {
    for (int idx = tid; idx < kChunk * KH; idx += kBlockThreads) {
      const int i = idx / KH, col = idx % KH;
      const bool valid = i < c_len && c0 + col < d.K;
      const int64_t at = valid ? token_row(i) * d.K + c0 + col : 0;
      query_raw[i * ldr + col] = valid ? q[at] : uint16_t(0);
      key_raw[i * ldr + col] = valid ? k[at] : uint16_t(0);
      gate_bits[i * ldr + col] = valid ? g_in[at] : uint16_t(0);
    }
    for (int idx = tid; idx < kChunk * VP; idx += kBlockThreads) {
      const int i = idx / VP, e = idx % VP;
      d_out_s[i * ldo + e] = (i < c_len && e < d.V) ? d_o[token_row(i) * d.V + e] : uint16_t(0);
    }
  }
  // 1/‖q‖ and 1/‖k‖ of the chunk's rows, as the forward's prepare stage computed them (from the
  // whole rows, which this block then need not load).
  static_assert(kBlockThreads >= 2 * kChunk, "a thread per inverse norm");
  if (tid < 2 * kChunk) query_inv[tid] = ws.inverse_norms[ch * 2 * kChunk + tid];  // key_inv next
  if (tid < kChunk) beta_s[tid] = tid < c_len ? load_as_float(beta_in, token_row(tid)) : 0.0f;
  if (tid < kNumSubBlocks) inside_exponent[tid] = 0u;
  kda_chunk_segments(doc_start, d, b, t0, c_len, seg);
  // dβ: the value kernel's two partials, once per chunk-head (rank 0), in a fixed order.
  if (half == 0 && tid < c_len) {
    const float* parts = split.d_beta + 2 * ch * kChunk;
    const float part = parts[tid] + parts[kChunk + tid];
    float* out = dbeta + token_row(tid);
    *out = split.accumulate ? *out + part : part;
  }
  attention_detail::cp_async_wait<0>();
  __syncthreads();
  stamp(1);

  // Γ = cumsum g down the block's columns.
  {
    // Γ by kBlockThreads/KH adjacent lanes per column (a power of two ≤ 32: KH ∈ {16, 32, 64}),
    // each over a run of rows: the run's sums in registers, the runs' totals scanned by shuffles.
    constexpr int kMaxRows = kChunk * kKdaCudaMaxHeadDim / 2 / kBlockThreads;  // at KH = 64
    const int parts = kBlockThreads / KH, rows = kChunk / parts;
    const int col = tid / parts, part = tid % parts, i0 = part * rows;
    float run[kMaxRows];
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) {
        total += bf16_bits_to_float(gate_bits[(i0 + r) * ldr + col]);
        run[r] = total;
      }
    float before = total;  // inclusive scan of the runs' totals over the column's lanes
    for (int step = 1; step < parts; step *= 2) {
      const float other = __shfl_up_sync(0xffffffffu, before, step, parts);
      if (part >= step) before += other;
    }
    before -= total;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) gam[(i0 + r) * ldg + col] = before + run[r];
  }
  __syncthreads();  // Γ published
  // max |Γ_i − Γ_m| over each sub-block's rows and the block's channels: a thread per (sub-block,
  // channel); whole warps reduce (items < 4·KH, a multiple of 32), one atomic per warp and
  // sub-block it spans (two when KH = 16).
  for (int item = tid; item < kNumSubBlocks * KH; item += kBlockThreads) {
    const int sb = item / KH, col = item % KH, s0 = kSubBlock * sb, m = s0 + kSubBlock / 2;
    const float gamma_m = gam[m * ldg + col];
    unsigned most = 0u;
#pragma unroll 4
    for (int i = s0; i < s0 + kSubBlock; ++i)
      most = max(most, __float_as_uint(fabsf(gam[i * ldg + col] - gamma_m)));  // NaN: largest
    if (KH >= 32) {
      most = __reduce_max_sync(0xffffffffu, most);
      if (lane == 0 && most != 0u) atomicMax(&inside_exponent[sb], most);
    } else if (most != 0u) {
      atomicMax(&inside_exponent[sb], most);
    }
  }

  // dP and dL = β·dM from the partials loaded at the start, strictly lower and same segment;
  // dP's diagonal apart.
#pragma unroll
  for (int u = 0; u < kPairSteps; ++u) {
    const int idx = tid + u * kBlockThreads, i = idx / (kChunk / 4), j0 = idx % (kChunk / 4) * 4;
    const float p[4] = {pairs[u][0].x + pairs[u][1].x, pairs[u][0].y + pairs[u][1].y,
                        pairs[u][0].z + pairs[u][1].z, pairs[u][0].w + pairs[u][1].w};
    const float m[4] = {pairs[u][2].x + pairs[u][3].x, pairs[u][2].y + pairs[u][3].y,
                        pairs[u][2].z + pairs[u][3].z, pairs[u][2].w + pairs[u][3].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + e;
      const bool structural = j < i && seg[i] == seg[j];
      if (j == i) diag_pqk[i] = p[e];
      d_pqk[i * kLdPair + j] = structural ? p[e] : 0.0f;
      d_lkk[i * kLdPair + j] = structural ? beta_s[i] * m[e] : 0.0f;
    }
  }
  __syncthreads();
  stamp(2);
  const int last_segment = seg[kChunk - 1];

  // ---- 2. Key side. Warp tile: rows r0..r0+15, channels col0_k + [0, 8·tiles_k) (absolute),
  // kept in registers through stage 3: dq̂ (acc_q), dk̂ (acc_k). dΓ accumulates in shared memory
  // (d_gamma, in dO's slot: dO's one reader is dQd, whose product ends with a barrier), each
  // element owned by the lane that holds it in the fragment layout; in registers too, at the
  // 128-register bound, it spilled in the pairwise loops.
  const int row_block = warp / kColGroups, group = warp % kColGroups, r0 = 16 * row_block;
  const int tiles_k = KH / (8 * kColGroups), col0_k = c0 + group * tiles_k * 8;
  float acc_q[kTiles][4], acc_k[kTiles][4];
  float* d_gamma = reinterpret_cast<float*>(d_out_s);  // [C, ldg] dΓ from the end of stage 2
  zero_tiles(acc_q);
  zero_tiles(acc_k);
  float* key_end_terms = slabs;  // E [C, ldg], once the last product has freed the slabs
  {
    // dQd = dO·Sᵀ (bf16: dO exact) into acc_q and dX·Sᵀ (tf32) into acc_k, in one pass over S;
    // both scaled by e^Γ (first segment) below, dKd = −dX·Sᵀ.
    state_pass<kTiles, kBlockThreads>(acc_q, acc_k, tiles_k, col0_k, c0, KH, VP, r0, state, d_out_s,
                                      ldo, d_x, slabs);
    for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_from_start = seg[i] == 0 ? __expf(gamma_at(i, c)) : 0.0f;
      const float value_q = acc_q[j][e4] * decay_from_start;
      const float value_k = -acc_k[j][e4] * decay_from_start;
      acc_q[j][e4] = value_q;
      acc_k[j][e4] = value_k;
      d_gamma[i * ldg + c - c0] = value_q * query_hat(i, c) + value_k * key_hat(i, c);
    });
    stamp(3);
    stamp(4);
  }
  {
    float acc[kTiles][4];
    // dKe = V'·dS'ᵀ (tf32): dk̂ += dKe ⊙ e^{γ−Γ} (last segment), and E = that ⊙ k̂ for dg's
    // exclusive forward prefix (stage 4 of the fused kernel explains why not total − suffix).
    // dγ = e^γ ⊙ rowsum(S ⊙ dS') for the block's channels from the same slabs: item 8·r + p
    // (r < KH ≤ 64) takes columns 4p.. of slab row r, with S's piece from global memory (in L2
    // since the pass above staged it), loaded before the slab's barrier.
    constexpr int kDotItems = (kKdaCudaMaxHeadDim / 2 * 8 + kBlockThreads - 1) / kBlockThreads;
    float dot[kDotItems];
    float4 state_piece[kDotItems];
#pragma unroll
    for (int m = 0; m < kDotItems; ++m) dot[m] = 0.0f;
    zero_tiles(acc);
    key_side_product<MmaPrecision::Tf32, kTiles, kBlockThreads>(
        acc, tiles_k, col0_k, c0, KH, VP, d_state, slabs,
        [&](int r, int e) { return load_pair(value_new + (r0 + r) * VP + e); },
        [&](int s) {
#pragma unroll
          for (int m = 0; m < kDotItems; ++m) {
            const int idx = tid + m * kBlockThreads, r = idx >> 3, p = idx & 7;
            state_piece[m] = r < KH ? *reinterpret_cast<const float4*>(
                                          state + int64_t(c0 + r) * VP + s * kSlab + 4 * p)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        },
        [&](const float* slab, int) {
#pragma unroll
          for (int m = 0; m < kDotItems; ++m) {
            const int idx = tid + m * kBlockThreads, r = idx >> 3, p = idx & 7;
            if (r < KH) {
              const float4 a = state_piece[m];
              const float4 b = *reinterpret_cast<const float4*>(slab + r * kSlabLd + 4 * p);
              dot[m] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
          }
        });
#pragma unroll
    for (int m = 0; m < kDotItems; ++m) {  // the 8 items of a row are 8 adjacent lanes
      const int idx = tid + m * kBlockThreads, r = idx >> 3;
      float x = dot[m];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      if ((idx & 7) == 0 && r < KH) d_gamma_last[r] = decay_whole[c0 + r] * x;
    }
    for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_to_end =
          seg[i] == last_segment ? __expf(gamma_at(kChunk - 1, c) - gamma_at(i, c)) : 0.0f;
      const float value = acc[j][e4] * decay_to_end;
      acc_k[j][e4] += value;
      key_end_terms[i * ldg + c - c0] = value * key_hat(i, c);
    });
  }
  stamp(5);

  // ---- 3. Pairwise sums of dL and dP, the per-token factors formed in the B loaders:
  //   rows    F_j = k̂_j e^{Γ_b − Γ_j}, b = r0 (the row block's first token) for every j < r0,
  //   columns G_l = k̂_l e^{Γ_l − Γ_a}, G^q_l = q̂_l e^{Γ_l − Γ_a}, a = r0 + 16 (the first token
  //   after the row block) for every l ≥ a:
  // both exponents ≤ 0 (j < b ≤ i, i < a ≤ l), so each side is one product over all its
  // sub-blocks with one epilogue (a reference per sub-block, as before, took one product and one
  // epilogue of exponents per sub-block; DM_KDA_KEY_PAIRWISE=blocks keeps that). Inside the
  // warp's own sub-block the same products through its middle token m (b = a = m) when its
  // exponents allow (kKdaInsideExponentLimit), else pairwise_inside_sub_block.
  {
    const bool inside_by_products = __uint_as_float(inside_exponent[row_block]) < inside_limit;
    // Diagonal of dP: dq̂_i += dP_ii k̂_i, dk̂_i += dP_ii q̂_i (its dΓ terms cancel).
    for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      acc_q[j][e4] += diag_pqk[i] * key_hat(i, c);
      acc_k[j][e4] += diag_pqk[i] * query_hat(i, c);
    });
    float acc[kTiles][4];
    // Row passes: (k range, reference) = ([j0, j1), b). One pass over [0, r0) with b = r0, then
    // the inside one; or, per_block, one per earlier sub-block with b its next token.
    const int row_passes = per_block_refs ? row_block : (row_block > 0 ? 1 : 0);
    for (int pass = 0; pass < row_passes + int(inside_by_products); ++pass) {
      int j0, j1, after;
      if (pass == row_passes) {
        j0 = r0, j1 = r0 + kSubBlock, after = r0 + kSubBlock / 2;
      } else if (per_block_refs) {
        j0 = kSubBlock * pass, j1 = j0 + kSubBlock, after = j1;
      } else {
        j0 = 0, j1 = r0, after = r0;
      }
      auto f_key = [&](int j, int nn) {
        const int c = col0_k + nn;
        return key_hat(j, c) * __expf(gamma_at(after, c) - gamma_at(j, c));
      };
      // dL and dP against the same F: one B load per element for both products.
      float acc_query_key[kTiles][4];
      zero_tiles(acc);
      zero_tiles(acc_query_key);
      warp_mma_tf32_shared_b(
          acc, acc_query_key, tiles_k, j0, j1,
          [&](int r, int j) { return d_lkk[(r0 + r) * kLdPair + j]; },
          [&](int r, int j) { return d_pqk[(r0 + r) * kLdPair + j]; }, f_key);
      for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
        const float decay = __expf(gamma_at(i, c) - gamma_at(after, c));
        const float row_lower = acc[j][e4] * decay;
        const float row_query_key = acc_query_key[j][e4] * decay;
        acc_k[j][e4] += row_lower;
        acc_q[j][e4] += row_query_key;
        d_gamma[i * ldg + c - c0] += key_hat(i, c) * row_lower + query_hat(i, c) * row_query_key;
      });
    }
    // Column passes: the inside one (if by products), then one over [r0 + 16, C) with a = r0 + 16;
    // or, per_block, one per later sub-block with a its first token.
    const int later = kNumSubBlocks - 1 - row_block;  // sub-blocks after the row block
    const int column_passes = per_block_refs ? later : (later > 0 ? 1 : 0);
    for (int pass = int(!inside_by_products); pass <= column_passes; ++pass) {
      int l0, l1, ref;
      if (pass == 0) {
        l0 = r0, l1 = r0 + kSubBlock, ref = r0 + kSubBlock / 2;
      } else if (per_block_refs) {
        l0 = r0 + kSubBlock * pass, l1 = l0 + kSubBlock, ref = l0;
      } else {
        l0 = r0 + kSubBlock, l1 = kChunk, ref = l0;
      }
      // G and G^q share their decay factor: one exponent per element for both products.
      zero_tiles(acc);
      warp_mma_tf32_sum_of_two(
          acc, tiles_k, l0, l1, [&](int r, int l) { return d_lkk[l * kLdPair + r0 + r]; },
          [&](int r, int l) { return d_pqk[l * kLdPair + r0 + r]; },
          [&](int l, int nn) {
            const int c = col0_k + nn;
            const float decay = __expf(gamma_at(l, c) - gamma_at(ref, c));
            return make_float2(key_hat(l, c) * decay, query_hat(l, c) * decay);
          });
      for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
        const float cols = acc[j][e4] * __expf(gamma_at(ref, c) - gamma_at(i, c));
        acc_k[j][e4] += cols;
        d_gamma[i * ldg + c - c0] -= key_hat(i, c) * cols;
      });
    }
    stamp(6);
    // Inside the sub-block, pair by pair (kda_stage4_mma.cuh).
    if (!inside_by_products)
      pairwise_inside_sub_block(acc_q, acc_k, tiles_k, r0, col0_k, d_lkk, d_pqk, key_hat2,
                                query_hat2, gamma2, [&](int, int, int i, int c, float2 value) {
                                  float2* pair =
                                      reinterpret_cast<float2*>(d_gamma + i * ldg + c - c0);
                                  float2 sum = *pair;
                                  sum.x += value.x;
                                  sum.y += value.y;
                                  *pair = sum;
                                });
  }

  stamp(7);

  // ---- 4. The block's row dots q·dq̂, k·dk̂ by warp column half, then over the block's
  // channels, then over both blocks of the cluster.
  {
    float row_q[2] = {0.0f, 0.0f}, row_k[2] = {0.0f, 0.0f};
    for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      row_q[e4 >> 1] += bf16_bits_to_float(query_raw[i * ldr + c - c0]) * acc_q[j][e4];
      row_k[e4 >> 1] += bf16_bits_to_float(key_raw[i * ldr + c - c0]) * acc_k[j][e4];
    });
    store_row_dots(row_q, r0, dots_query + group * kChunk);
    store_row_dots(row_k, r0, dots_key + group * kChunk);
  }
  __syncthreads();
  if (tid < kChunk) {
    float sum_query = dots_query[tid], sum_key = dots_key[tid];
#pragma unroll
    for (int p = 1; p < kColGroups; ++p) {
      sum_query += dots_query[p * kChunk + tid];
      sum_key += dots_key[p * kChunk + tid];
    }
    block_dot_query[tid] = sum_query;
    block_dot_key[tid] = sum_key;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // both blocks' row dots are written
  if (tid < kChunk) {
    const unsigned peer = cluster.block_rank() ^ 1u;
    const float peer_query = cluster.map_shared_rank(block_dot_query, peer)[tid];
    const float peer_key = cluster.map_shared_rank(block_dot_key, peer)[tid];
    const bool first = cluster.block_rank() == 0;  // sum in rank order: the same bits in both
    dot_query[tid] = first ? block_dot_query[tid] + peer_query : peer_query + block_dot_query[tid];
    dot_key[tid] = first ? block_dot_key[tid] + peer_key : peer_key + block_dot_key[tid];
  }
  cluster.sync();  // the peer has read ours (it may exit now), and dot_* are visible block-wide
  stamp(8);

  // dq, dk through the L2 norm (u = x·inv: dx = inv·(dû − u·(u·dû))) into the dP and dL matrices
  // (dead since the pairwise phase), so one coalesced pass adds dg, dq, dk at the end.
  float* d_query_s = d_pqk;  // [C, ldg]
  float* d_key_s = d_lkk;    // [C, ldg]
  for_each_element<kTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
    const float q_inv = query_inv[i], k_inv = key_inv[i];
    const float q_raw = bf16_bits_to_float(query_raw[i * ldr + c - c0]);
    const float k_raw = bf16_bits_to_float(key_raw[i * ldr + c - c0]);
    d_query_s[i * ldg + c - c0] =
        d.scale * q_inv * (acc_q[j][e4] - q_raw * q_inv * (dot_query[i] * q_inv));
    d_key_s[i * ldg + c - c0] = k_inv * (acc_k[j][e4] - k_raw * k_inv * (dot_key[i] * k_inv));
  });

  // dg = the exclusive forward prefix of E (zero outside the last segment) + the reverse cumsum
  // of dΓ restarting at document starts, seeded (last segment) with dγ. Segmented scans with
  // kBlockThreads/KH threads per column, each over a run of `rows` rows: local scans in place, each
  // run's totals through shared memory, then the carries. Reverse: the running sum at a run's
  // first row t is its local sum plus, when no document starts between t and the next run's
  // first row u (seg[t] == seg[u]), the running sum at u; row C is virtual, with running sum dγ
  // and the last row's segment.
  __syncthreads();  // the raw q rows (read just above) become the scans' totals
  {
    const int parts = kBlockThreads / KH, rows = kChunk / parts;  // KH ∈ {16, 32, 64}
    const int col = tid % KH, part = tid / KH, i0 = part * rows;
    float* e_totals = scan;               // [parts, KH] Σ E over each run
    float* gamma_tops =
        scan + kBlockThreads;  // [parts, KH] local reverse sums at each run's first row
    float prefix = 0.0f, running = 0.0f;
    for (int i = i0; i < i0 + rows; ++i) {
      const float e = key_end_terms[i * ldg + col];
      key_end_terms[i * ldg + col] = prefix;
      prefix += e;
    }
    for (int i = i0 + rows - 1; i >= i0; --i) {
      if (i < i0 + rows - 1 && seg[i] != seg[i + 1]) running = 0.0f;
      running += d_gamma[i * ldg + col];
      d_gamma[i * ldg + col] = running;
    }
    e_totals[part * KH + col] = prefix;
    gamma_tops[part * KH + col] = running;
    __syncthreads();
    float e_carry = 0.0f;
    for (int p = 0; p < part; ++p) e_carry += e_totals[p * KH + col];
    float carry = d_gamma_last[col];
    int carry_seg = seg[kChunk - 1];
    for (int p = parts - 1; p > part; --p) {
      const int top = p * rows;
      carry = gamma_tops[p * KH + col] + (seg[top] == carry_seg ? carry : 0.0f);
      carry_seg = seg[top];
    }
    for (int i = i0; i < i0 + rows; ++i)
      d_gamma[i * ldg + col] += (seg[i] == carry_seg ? carry : 0.0f) + key_end_terms[i * ldg + col] + e_carry;
  }
  __syncthreads();
  stamp(9);

  // dg, dq, dk += those (= with !split.accumulate) over the block's channels, row-coalesced by
  // the whole block.
  const int width = d.K - c0 < KH ? d.K - c0 : KH;  // the block's channels inside K
  if (width <= 0) return;
  const bool accumulate = split.accumulate;
  auto add4 = [accumulate](float* dst, const float* src) {
    float4 y = *reinterpret_cast<const float4*>(src);
    if (accumulate) {
      const float4 x = *reinterpret_cast<const float4*>(dst);
      y = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    *reinterpret_cast<float4*>(dst) = y;
  };
  auto add1 = [accumulate](float* dst, float y) { *dst = accumulate ? *dst + y : y; };
  if (d.K % 4 == 0 && ((reinterpret_cast<uintptr_t>(dg) | reinterpret_cast<uintptr_t>(dq) |
                        reinterpret_cast<uintptr_t>(dk)) &
                       15) == 0) {
    const int per_row = width / 4;
#pragma unroll 4
    for (int idx = tid; idx < c_len * per_row; idx += kBlockThreads) {
      const int i = idx / per_row, col = idx % per_row * 4;
      const int64_t at = token_row(i) * d.K + c0 + col;
      add4(dg + at, d_gamma + i * ldg + col);
      add4(dq + at, d_query_s + i * ldg + col);
      add4(dk + at, d_key_s + i * ldg + col);
    }
  } else {
    for (int idx = tid; idx < c_len * width; idx += kBlockThreads) {
      const int i = idx / width, col = idx % width;
      const int64_t at = token_row(i) * d.K + c0 + col;
      add1(dg + at, d_gamma[i * ldg + col]);
      add1(dq + at, d_query_s[i * ldg + col]);
      add1(dk + at, d_key_s[i * ldg + col]);
    }
  }
  stamp(10);
}

}  // namespace

size_t kda_chunk_grad_key_shared_bytes(const KdaDims& d) {
  return size_t(key_layout(d.KP, d.VP).total);
}

int kda_stage4_column_groups(int half_width) {
  static const bool force_two = [] {
    return env_choice("DM_KDA_STAGE4_GROUPS", {"4", "2"}) == 1;
  }();
  return half_width % 32 == 0 && !force_two ? 4 : 2;
}
void kda_key_phase_clock(bool enable) { phase_clock_enable(g_key_clock_on, enable); }
int kda_key_phase_cycles(long long* cycles, const char** names, int max_phases) {
  return phase_clock_read(g_key_clock, kKeyPhaseNames, cycles, names, max_phases);
}

void kda_chunk_grad_key_launch(const uint16_t* q, const uint16_t* k, const uint16_t* g,
                               const uint16_t* beta, const uint16_t* d_o, const int32_t* doc_start,
                               float* dq, float* dk, float* dg, float* dbeta, const KdaDims& d,
                               const KdaForwardWorkspace& ws, const float* d_states,
                               const KdaSplitWorkspace& split, cudaStream_t stream) {
  DM_CHECK(kda_split_supported(d),
           "kda stage 4 (split): needs KP % 32 == 0, KP <= 128 and VP % 32 == 0");
  const int shared = key_layout(d.KP, d.VP).total;
  // DM_KDA_KEY_INSIDE=pairs (read once): every sub-block's inside sums pair by pair.
  static const float inside_limit = [] {
    return env_choice("DM_KDA_KEY_INSIDE", {"limit", "pairs"}) == 1 ? 0.0f
                                                                    : kKdaInsideExponentLimit;
  }();
  // DM_KDA_KEY_PAIRWISE=blocks (read once): a reference token per sub-block in the pairwise
  // sums (one product and epilogue each) instead of one per side.
  static const bool per_block_refs = [] {
    return env_choice("DM_KDA_KEY_PAIRWISE", {"sides", "blocks"}) == 1;
  }();
  launch_stage4_split_kernel(
      kda_chunk_grad_key_kernel<2, 0>, kda_chunk_grad_key_kernel<4, kKdaStaticDims>,
      kda_chunk_grad_key_kernel<4, 0>, d.KP / 2, d, shared, stream, q, k, g, beta, d_o, doc_start,
      dq, dk, dg, dbeta, d, ws, d_states, split, inside_limit, per_block_refs);
  check_last_error("cuda kda_chunk_backward (stage 4, key kernel)");
}

void kda_chunk_grad_split(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const uint16_t* g, const uint16_t* beta, const uint16_t* d_o,
                          const int32_t* doc_start, float* dq, float* dk, float* dv, float* dg,
                          float* dbeta, const KdaDims& d, const KdaForwardWorkspace& ws,
                          const float* d_states, const KdaSplitWorkspace& split,
                          cudaStream_t stream) {
  if (d.num_chunks == 0 || d.B * d.H == 0) return;
  kda_chunk_grad_value_launch(k, v, g, beta, d_o, doc_start, dv, d, ws, d_states, split, stream);
  kda_chunk_grad_key_launch(q, k, g, beta, d_o, doc_start, dq, dk, dg, dbeta, d, ws, d_states,
                            split, stream);
}

}  // namespace dm::cuda::kda_detail

namespace dm::cuda {

void kda_stage4_split_phase_clock(bool enable) {
  kda_detail::kda_value_phase_clock(enable);
  kda_detail::kda_key_phase_clock(enable);
}
int kda_stage4_split_phase_cycles(int kernel, long long* cycles, const char** names,
                                  int max_phases) {
  return kernel == 0 ? kda_detail::kda_value_phase_cycles(cycles, names, max_phases)
                     : kda_detail::kda_key_phase_cycles(cycles, names, max_phases);
}

}  // namespace dm::cuda
