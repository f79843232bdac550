// The prepare stage of the chunked KDA forward for bf16 inputs (kda.h; the fp32 twin is
// kda_chunk_prepare_kernel in kda_chunk.cu, whose outputs this matches): per chunk of one head,
// Γ = cumsum g, the masked intra-chunk products L (β-free, j < i) and P (j ≤ i), the solve
// W = A·Diag(β)·(K⊙e^Γ), U = A·Diag(β)·V with A = (I + Diag(β)L)⁻¹, and the workspace rows
// Q⊙e^Γ, K⊙e^{γ−Γ}, P, e^γ. Grid: num_chunks × B·H, 256 threads.
//
// Why a second kernel: the fp32 one keeps q̂, k̂, Γ and two reference buffers in fp32 shared
// memory (≈ 174 KB at K = 128: one block per SM) and forms every product on CUDA cores. Here
//   - q, k stay as their raw bf16 bits with fp32 inverse norms beside them (exact: they are the
//     inputs), Γ fp32: ≈ 111 KB at K = 128, two blocks per SM;
//   - L and P across sub-blocks (t < s) are tf32 mma.sync products through the first token
//     b = 16(t+1) after sub-block t, e^{Γ_i−Γ_j} = e^{Γ_i−Γ_b}·e^{Γ_b−Γ_j} (i ≥ b > j: both
//     exponents ≤ 0), formed in the fragment loaders (no reference buffers);
//   - inside a sub-block the same products through its middle token when every factor stays
//     in range, else one exponent per pair and channel, Γ_i − Γ_j ≤ 0 (j ≤ i);
//   - the solve by 16-token sub-blocks on tensor cores (phase 5): the diagonal blocks'
//     inverses (16×16, CUDA cores), then a warp per 16 feature columns of [W | U] carries them
//     in registers through the four sub-blocks. It replaced a thread-per-column substitution
//     over all 64 rows, 40% of the kernel's cycles.
// tf32 for L and P matches the backward's stage 4 (kda_chunk_backward_tc.cu), which forms the
// same L the same way.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/attention_mma.cuh"  // cp_async_16 / cp_async_commit / cp_async_wait
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_common.cuh"
#include "ops/cuda/kda_mma.cuh"

namespace dm::cuda::kda_detail {
namespace {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;

constexpr int kWarps = kThreads / 32;
constexpr int kLdPair = kChunk + 4;  // row stride of the [C, C] fp32 shared matrices
// Row stride of the four [16, 16] blocks Bt_s of the solve (phase 5): ≡ 24 (mod 32) floats, so
// the 8-byte fragment reads of a half warp (rows g < 4, columns 2tq) hit distinct banks.
constexpr int kLdSolve = kSubBlock + 8;
// V's bf16 rows [C, VP + 8] take P's fp32 buffer [C, kLdPair] in the solve.
static_assert(kChunk * (kKdaCudaMaxHeadDim + 8) * 2 <= kChunk * kLdPair * 4);

// Phase clock (diagnostics, bench_cuda_kda --phases), as stage 4's: SM cycle stamps at the
// phase boundaries of one block (the middle chunk of the first batch-head) while enabled. That
// block alone adds a barrier before each stamp, so a stamp marks the whole block's progress.
constexpr int kPreparePhaseStamps = 7;
__device__ int g_prepare_clock_on;
__device__ long long g_prepare_clock[kPreparePhaseStamps];
const char* const kPreparePhaseNames[kPreparePhaseStamps] = {"start",
                                                             "rows, beta, segments",
                                                             "norms, Gamma cumsum",
                                                             "L, P across sub-blocks",
                                                             "L, P inside sub-blocks",
                                                             "N blocks, workspace rows",
                                                             "W, U solve"};

// Byte offsets of the shared buffers (each a multiple of 16 bytes).
struct TcPrepareLayout {
  int ldk;  // fp32 Γ rows: KP + 4
  int ldr;  // bf16 raw q, k rows: KP + 8
  int gamma, query_raw, key_raw, lower_key_key, lower_query_key, solve_blocks, vectors, total;
};

__host__ __device__ inline TcPrepareLayout tc_prepare_layout(int KP) {
  TcPrepareLayout l;
  l.ldk = KP + 4;
  l.ldr = KP + 8;
  auto round16 = [](int bytes) { return (bytes + 15) / 16 * 16; };
  int at = 0;
  l.gamma = at;           at += round16(kChunk * l.ldk * 4);
  l.query_raw = at;       at += round16(kChunk * l.ldr * 2);
  l.key_raw = at;         at += round16(kChunk * l.ldr * 2);
  l.lower_key_key = at;   at += round16(kChunk * kLdPair * 4);
  l.lower_query_key = at; at += round16(kChunk * kLdPair * 4);
  l.solve_blocks = at;
  at += kChunk * kLdSolve * 4;
  l.vectors = at;  // β, 1/‖q‖, 1/‖k‖, segments [C]; 4 exponents; Γ of the last row [KP]
  at += 4 * kChunk * 4 + kNumSubBlocks * 4 + KP * 4;
  l.total = at;
  return l;
}

template <int kStaticDims>
__global__ void __launch_bounds__(kThreads, 2)
    kda_chunk_prepare_tc_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                const uint16_t* g_in, const uint16_t* beta_in,
                                const int32_t* doc_start, KdaDims d, KdaForwardWorkspace ws,
                                float inside_limit) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // K = V = kStaticDims when > 0 (the common 128): the layout and every stride fold to
  // constants, which frees the registers that would hold them.
  const int KP = kStaticDims > 0 ? kStaticDims : d.KP, VP = kStaticDims > 0 ? kStaticDims : d.VP;
  const TcPrepareLayout l = tc_prepare_layout(KP);
  const int ldk = l.ldk, ldr = l.ldr;
  float* gam = reinterpret_cast<float*>(shared_bytes + l.gamma);                  // [C, ldk] Γ
  uint16_t* query_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.query_raw);  // [C, ldr]
  uint16_t* key_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.key_raw);      // [C, ldr]
  float* lower = reinterpret_cast<float*>(shared_bytes + l.lower_key_key);        // [C, 68] L
  float* lower_qk = reinterpret_cast<float*>(shared_bytes + l.lower_query_key);   // [C, 68] P
  float* solve_blocks = reinterpret_cast<float*>(shared_bytes + l.solve_blocks);  // [C, 24] Bt_s
  float* beta_s = reinterpret_cast<float*>(shared_bytes + l.vectors);             // [C]
  float* query_inv = beta_s + kChunk;                                             // [C]
  float* key_inv = query_inv + kChunk;                                            // [C]
  int* seg = reinterpret_cast<int*>(key_inv + kChunk);                            // [C]

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
  const int64_t ch = bh * d.num_chunks + n;
  const int c_len = kda_chunk_length(d, n);
  auto token_row = [&](int i) { return kda_token_row(d, b, h, t0 + i); };
  const bool block_stamping = g_prepare_clock_on && blockIdx.y == 0 && blockIdx.x == gridDim.x / 2;
  auto stamp = [&](int phase) {  // block-uniform branch: the barrier is legal
    if (!block_stamping) return;
    __syncthreads();
    if (tid == 0) g_prepare_clock[phase] = clock64();
  };
  stamp(0);

  // Adjacent channel pairs (c even): k̂, q̂ (incl. scale) from one 4-byte load, Γ likewise.
  auto key_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(key_raw + i * ldr + c);
    const float inv = key_inv[i];
    return make_float2(__uint_as_float(bits << 16) * inv, __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto query_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(query_raw + i * ldr + c);
    const float inv = query_inv[i] * d.scale;
    return make_float2(__uint_as_float(bits << 16) * inv, __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto gamma2 = [&](int i, int c) { return load_pair(gam + i * ldk + c); };

  // ---- 1. Rows (one round trip), β, segments; the parts of L, P that stay zero. At K = 128
  // with 16-byte rows, the 16 lanes that load a row also reduce its squares for the inverse
  // norms (a separate warp-per-row pass cost ~3K cycles).
  const bool rows_by_8 = kda_rows_by_8(d, q, k, g_in, v);
  const bool norms_in_rows = kStaticDims == 128 && rows_by_8;
  if (norms_in_rows) {
    constexpr int kPerRow = (kStaticDims > 0 ? kStaticDims : 128) / 8;  // 16 lanes: half a warp
    constexpr int kSteps = kChunk * kPerRow / kThreads;
    static_assert(kChunk * kPerRow % kThreads == 0);
    // Every load of the thread issued before any store: one round trip.
    uint4 query_all[kSteps], key_all[kSteps], gate_all[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int idx = tid + u * kThreads, i = idx / kPerRow, col = idx % kPerRow * 8;
      query_all[u] = key_all[u] = gate_all[u] = make_uint4(0, 0, 0, 0);
      if (i < c_len && col < d.K) {  // K % 8 == 0: the 8 columns are all inside K
        const int64_t at = token_row(i) * d.K + col;
        query_all[u] = *reinterpret_cast<const uint4*>(q + at);
        key_all[u] = *reinterpret_cast<const uint4*>(k + at);
        gate_all[u] = *reinterpret_cast<const uint4*>(g_in + at);
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int idx = tid + u * kThreads, i = idx / kPerRow, col = idx % kPerRow * 8;
      const uint4 query_bits = query_all[u], key_bits = key_all[u], gate_bits = gate_all[u];
      *reinterpret_cast<uint4*>(query_raw + i * ldr + col) = query_bits;
      *reinterpret_cast<uint4*>(key_raw + i * ldr + col) = key_bits;
      kda_store_8_bf16_as_float(gam + i * ldk + col, gate_bits);
      auto squares = [](uint4 bits) {
        const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float lo = __uint_as_float(w[u] << 16), hi = __uint_as_float(w[u] & 0xffff0000u);
          sum += lo * lo + hi * hi;
        }
        return sum;
      };
      float sum_q = squares(query_bits), sum_k = squares(key_bits);
#pragma unroll
      for (int offset = kPerRow / 2; offset > 0; offset /= 2) {
        sum_q += __shfl_xor_sync(0xffffffffu, sum_q, offset);
        sum_k += __shfl_xor_sync(0xffffffffu, sum_k, offset);
      }
      if (col == 0) {
        query_inv[i] = 1.0f / sqrtf(sum_q + kL2NormEps);
        key_inv[i] = 1.0f / sqrtf(sum_k + kL2NormEps);
      }
    }
  } else {
    kda_stage_rows_bf16(q, k, g_in, d, b, h, t0, c_len, rows_by_8, query_raw, key_raw, ldr, gam,
                        ldk);
  }
  if (tid < kChunk) beta_s[tid] = tid < c_len ? load_as_float(beta_in, token_row(tid)) : 0.0f;
  kda_chunk_segments(doc_start, d, b, t0, c_len, seg);
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    if (j >= i) lower[i * kLdPair + j] = 0.0f;
    if (j > i) lower_qk[i * kLdPair + j] = 0.0f;
  }
  // max |Γ_i − Γ_m| per sub-block as float bits (non-negative: ordered as unsigned).
  unsigned* inside_exponent = reinterpret_cast<unsigned*>(seg + kChunk);          // [kNumSubBlocks]
  float* gamma_last = reinterpret_cast<float*>(inside_exponent + kNumSubBlocks);  // [KP]
  if (tid < kNumSubBlocks) inside_exponent[tid] = 0u;
  __syncthreads();
  stamp(1);

  // ---- 2. Inverse L2 norms (warp per row; phase 1 formed them at K = 128), then Γ = cumsum g
  // by two threads per column (rows 0–31 and 32–63, each half in registers: a thread per column
  // over all 64 rows was a chain of 64 dependent shared-memory round trips), and max |Γ_i − Γ_m|
  // per sub-block from the same registers. The first half's totals pass through the solve's
  // (still free) buffer.
  if (!norms_in_rows)
    kda_inverse_norms_and_cumsum(query_raw, key_raw, ldr, nullptr, ldk, d, query_inv, key_inv);
  {
    constexpr int kHalf = kChunk / 2;
    const int col = tid % KP, half = tid / KP;  // KP ≤ 128: 2·KP ≤ kThreads
    const bool scans = tid < 2 * KP;
    float run[kHalf];
    if (scans) {
      float* column = gam + (half * kHalf) * ldk + col;
#pragma unroll
      for (int r = 0; r < kHalf; ++r) run[r] = column[r * ldk];
#pragma unroll
      for (int r = 1; r < kHalf; ++r) run[r] += run[r - 1];
      if (half == 0) solve_blocks[col] = run[kHalf - 1];
    }
    __syncthreads();
    if (scans) {
      const float offset = half == 1 ? solve_blocks[col] : 0.0f;
      float* column = gam + (half * kHalf) * ldk + col;
#pragma unroll
      for (int r = 0; r < kHalf; ++r) column[r * ldk] = run[r] += offset;
      if (half == 1) gamma_last[col] = run[kHalf - 1];  // phase 4 overwrites Γ in place
    }
    // Sub-blocks 2·half and 2·half + 1 are this thread's; a warp may hold both halves (KP < 128).
#pragma unroll
    for (int sb = 0; sb < kNumSubBlocks; ++sb) {
      unsigned most = 0u;
      if (scans && sb / 2 == half) {
        const int r0 = (sb % 2) * kSubBlock, m = r0 + kSubBlock / 2;
#pragma unroll
        for (int r = 0; r < kSubBlock; ++r)  // NaN: the largest as unsigned
          most = max(most, __float_as_uint(fabsf(run[r0 + r] - run[m])));
      }
      most = __reduce_max_sync(0xffffffffu, most);
      if ((tid & 31) == 0 && most != 0u) atomicMax(&inside_exponent[sb], most);
    }
  }
  __syncthreads();
  stamp(2);
  auto inside_by_products = [&](int sb) {
    return __uint_as_float(inside_exponent[sb]) < inside_limit;
  };

  // ---- 3. L and P as tf32 products of 16-row blocks, the decays factored through a reference
  // token b formed in the loaders: e^{Γ_i−Γ_j} = e^{Γ_i−Γ_b}·e^{Γ_b−Γ_j}. A warp takes one row
  // block s and one reference for every tile it computes, so one A factor e^{Γ_i−Γ_b} serves
  // its k̂ and q̂ rows (L and P) and every column tile, and one B factor k̂_j·e^{Γ_b−Γ_j} serves
  // L and P:
  //   across sub-blocks (t < s): b = 16s, the row block's first token (i ≥ b > j: both
  //     exponents ≤ 0); warps 0–1 row block 3 (three 8-column tiles each), warp 2 row block 2
  //     (four), warp 3 row block 1 (two);
  //   inside sub-block s (warp 4 + s): b its middle token, when inside_by_products(s).
  // (One task per block pair and matrix, as before, cost the busiest warp 2× the instructions.)
  {
    constexpr int kMaxTiles = 4;
    int s, ref, j0, tiles;
    const bool inside = warp >= 4;
    if (!inside) {
      s = warp < 2 ? 3 : (warp == 2 ? 2 : 1);
      ref = 16 * s, j0 = warp == 1 ? 24 : 0, tiles = warp < 2 ? 3 : 2 * s;
    } else {
      s = warp - 4;
      ref = kSubBlock * s + kSubBlock / 2, j0 = kSubBlock * s, tiles = 2;
    }
    if (!inside || inside_by_products(s)) {  // warp-uniform
      const int lane = tid & 31, g = lane >> 2, tq = lane & 3, r0 = 16 * s;
      float acc_key[kMaxTiles][4], acc_query[kMaxTiles][4];
      zero_tiles(acc_key);
      zero_tiles(acc_query);
      for (int k0 = 0; k0 < KP; k0 += 8) {
        const int c = k0 + 2 * tq;  // k slots tq, tq + 4 ↔ channels c, c + 1 (warp_mma_pairs)
        const float2 gamma_b = gamma2(ref, c);
        float2 key_rows[2], query_rows[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = r0 + g + 8 * half;
          const float2 gamma_i = gamma2(i, c);
          const float2 decay =
              make_float2(__expf(gamma_i.x - gamma_b.x), __expf(gamma_i.y - gamma_b.y));
          const float2 key = key_hat2(i, c), query = query_hat2(i, c);
          key_rows[half] = make_float2(key.x * decay.x, key.y * decay.y);
          query_rows[half] = make_float2(query.x * decay.x, query.y * decay.y);
        }
        const uint32_t a_key[4] = {to_tf32(key_rows[0].x), to_tf32(key_rows[1].x),
                                   to_tf32(key_rows[0].y), to_tf32(key_rows[1].y)};
        const uint32_t a_query[4] = {to_tf32(query_rows[0].x), to_tf32(query_rows[1].x),
                                     to_tf32(query_rows[0].y), to_tf32(query_rows[1].y)};
#pragma unroll
        for (int j = 0; j < kMaxTiles; ++j)
          if (j < tiles) {
            const int col = j0 + 8 * j + g;
            const float2 key = key_hat2(col, c), gamma_j = gamma2(col, c);
            const uint32_t b0 = to_tf32(key.x * __expf(gamma_b.x - gamma_j.x));
            const uint32_t b1 = to_tf32(key.y * __expf(gamma_b.y - gamma_j.y));
            mma_tf32_16x8x8(acc_key[j], a_key, b0, b1);
            mma_tf32_16x8x8(acc_query[j], a_query, b0, b1);
          }
      }
      for_each_element<kMaxTiles>(tiles, r0, j0, [&](int j, int e4, int i, int jj) {
        const bool same_segment = seg[i] == seg[jj];  // across sub-blocks jj < i always
        lower[i * kLdPair + jj] = jj < i && same_segment ? acc_key[j][e4] : 0.0f;
        lower_qk[i * kLdPair + jj] = jj <= i && same_segment ? acc_query[j][e4] : 0.0f;
      });
    }
  }
  stamp(3);
  // Inside the other sub-blocks (j ≤ i): one exp per pair and channel, shared by L and P.
  for (int p = tid; p < kNumSubBlocks * kPairsPerSubBlock; p += kThreads) {
    const int block = p / kPairsPerSubBlock, r = p % kPairsPerSubBlock;
    if (inside_by_products(block)) continue;
    int ii = 0;
    while ((ii + 1) * (ii + 2) / 2 <= r) ++ii;  // r = ii(ii+1)/2 + jj, jj ≤ ii
    const int jj = r - ii * (ii + 1) / 2;
    const int i = block * kSubBlock + ii, j = block * kSubBlock + jj;
    float key_key = 0.0f, query_key = 0.0f;
    for (int c = 0; c < KP; c += 2) {  // padded channels hold k = 0, Γ = 0: they add nothing
      const float2 key_i = key_hat2(i, c), query_i = query_hat2(i, c), key_j = key_hat2(j, c);
      const float2 gamma_i = gamma2(i, c), gamma_j = gamma2(j, c);
      const float x = key_j.x * __expf(gamma_i.x - gamma_j.x);
      const float y = key_j.y * __expf(gamma_i.y - gamma_j.y);
      key_key += key_i.x * x + key_i.y * y;
      query_key += query_i.x * x + query_i.y * y;
    }
    const bool same_segment = seg[i] == seg[j];
    lower[i * kLdPair + j] = (j < i && same_segment) ? key_key : 0.0f;
    lower_qk[i * kLdPair + j] = same_segment ? query_key : 0.0f;
  }
  __syncthreads();
  stamp(4);

  // ---- 4. N_s = (I + Diag(β_s)L_ss)⁻¹ of each sub-block s (warps 0–1: a thread per column,
  // held in registers), stored for phase 5 as Bt_s[i][i'] = β_i'·N_s[i][i'] (zero for i' > i);
  // meanwhile the other warps write the workspace rows the state and output stages (and the
  // backward) read, and replace Γ in place by the solve's key operand K⊙e^Γ (segment 0), from
  // the exponent Q⊙e^Γ takes anyway (formed in the solve, it was ~6K cycles of its key tiles).
  if (tid < kChunk) {
    const int s0 = kSubBlock * (tid / kSubBlock), c = tid % kSubBlock;
    float n_col[kSubBlock];
#pragma unroll
    for (int i = 0; i < kSubBlock; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m) sum += lower[(s0 + i) * kLdPair + s0 + m] * n_col[m];
      n_col[i] = i < c ? 0.0f : (i == c ? 1.0f : -beta_s[s0 + i] * sum);
    }
    const float beta_c = beta_s[s0 + c];
#pragma unroll
    for (int i = 0; i < kSubBlock; ++i) solve_blocks[(s0 + i) * kLdSolve + c] = beta_c * n_col[i];
  } else {
    // Four channels per thread (KP % 16 == 0): 16-byte shared reads and global stores.
    const int last_segment = seg[kChunk - 1];
    auto exp4 = [](float4 x) {
      return make_float4(__expf(x.x), __expf(x.y), __expf(x.z), __expf(x.w));
    };
    auto mul4 = [](float4 a, float4 b) {
      return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
    };
    auto raw4 = [](const uint16_t* p, float scale) {  // 4 bf16 (8-byte aligned) × scale
      const uint2 bits = *reinterpret_cast<const uint2*>(p);
      return make_float4(
          __uint_as_float(bits.x << 16) * scale, __uint_as_float(bits.x & 0xffff0000u) * scale,
          __uint_as_float(bits.y << 16) * scale, __uint_as_float(bits.y & 0xffff0000u) * scale);
    };
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int idx = tid - kChunk; idx < kChunk * KP / 4; idx += kThreads - kChunk) {
      const int i = idx / (KP / 4), c = idx % (KP / 4) * 4;
      const float4 gamma = *reinterpret_cast<const float4*>(gam + i * ldk + c);
      const float4 gamma_end = *reinterpret_cast<const float4*>(gamma_last + c);
      const float4 query = raw4(query_raw + i * ldr + c, query_inv[i] * d.scale);
      const float4 key = raw4(key_raw + i * ldr + c, key_inv[i]);
      const bool first_segment = seg[i] == 0;
      const float4 decay = exp4(gamma);
      const float4 to_end = exp4(make_float4(gamma_end.x - gamma.x, gamma_end.y - gamma.y,
                                             gamma_end.z - gamma.z, gamma_end.w - gamma.w));
      // K⊙e^Γ over Γ: this thread's own four elements only.
      *reinterpret_cast<float4*>(gam + i * ldk + c) = first_segment ? mul4(key, decay) : zero4;
      *reinterpret_cast<float4*>(ws.query_decay + (ch * kChunk + i) * KP + c) =
          first_segment ? mul4(query, decay) : zero4;
      *reinterpret_cast<float4*>(ws.key_to_end + (ch * kChunk + i) * KP + c) =
          seg[i] == last_segment ? mul4(key, to_end) : zero4;
    }
    for (int idx = tid - kChunk; idx < kChunk * kChunk / 4; idx += kThreads - kChunk) {
      const int i = idx / (kChunk / 4), j = idx % (kChunk / 4) * 4;
      const float4 p = *reinterpret_cast<const float4*>(lower_qk + i * kLdPair + j);
      const float4 l = *reinterpret_cast<const float4*>(lower + i * kLdPair + j);
      float* dst_p = ws.lower_query_key + (ch * kChunk + i) * kChunk + j;
      float* dst_l = ws.lower_key_key + (ch * kChunk + i) * kChunk + j;
      *reinterpret_cast<float4*>(dst_p) = p;
      *reinterpret_cast<float4*>(dst_l) =
          make_float4(j < i ? l.x : 0.0f, j + 1 < i ? l.y : 0.0f, j + 2 < i ? l.z : 0.0f,
                      j + 3 < i ? l.w : 0.0f);
    }
    for (int col = tid - kChunk; col < KP; col += kThreads - kChunk)
      ws.decay_whole[ch * KP + col] = last_segment == 0 ? __expf(gamma_last[col]) : 0.0f;
    for (int r = tid - kChunk; r < 2 * kChunk; r += kThreads - kChunk)
      ws.inverse_norms[ch * 2 * kChunk + r] = r < kChunk ? query_inv[r] : key_inv[r - kChunk];
  }
  __syncthreads();
  stamp(5);

  // ---- 5. [W | U] = (I + Diag(β)L)⁻¹·Diag(β)·X, X = [K⊙e^Γ (segment 0) | V], by sub-blocks on
  // tensor cores. Transposed, so that a warp's 16 feature columns of Y = [W | U] stay in its
  // registers from one sub-block to the next:
  //   Yᵀ_s = (Xᵀ_s − Σ_{t<s} Yᵀ_t·Lᵀ_st)·Btᵀ_s
  // Yᵀ_t's accumulator is the A operand of the later products as it stands, with the k slots
  // permuted as in warp_mma_pairs (slot tq ↔ token 2tq, slot tq + 4 ↔ token 2tq + 1); the B
  // operands (L_st, Bt_s) are pairs of adjacent floats in shared memory.
  //
  // V's rows of the chunk go into P's buffer (P left in phase 4), 16 bytes per cp.async, while
  // the key tiles compute: loaded element by element in fragment order inside the value tiles
  // they took ~19K cycles per block (first wave), more than the rest of the solve. (Issued
  // before phase 4 instead, with P stored first, it was no faster.)
  const int lane = tid & 31, g = lane >> 2, tq = lane & 3;
  uint16_t* value_rows = reinterpret_cast<uint16_t*>(lower_qk);  // [C, VP + 8] bf16
  const int ldv = VP + 8;
  {
    const uint16_t* v_rows = v + token_row(0) * d.V;  // token i's row: i·H·V further
    const int v_stride = int(d.H * d.V);
    if (d.V % 8 == 0) {
      const int per_row = VP / 8;
      for (int idx = tid; idx < kChunk * per_row; idx += kThreads) {
        const int i = idx / per_row, e = idx % per_row * 8;
        const bool valid = i < c_len && e < d.V;  // else zero-filled
        cp_async_16(value_rows + i * ldv + e, valid ? v_rows + i * v_stride + e : v, valid);
      }
    } else {
      for (int idx = tid; idx < kChunk * VP; idx += kThreads) {
        const int i = idx / VP, e = idx % VP;
        value_rows[i * ldv + e] = i < c_len && e < d.V ? v_rows[i * v_stride + e] : uint16_t(0);
      }
    }
    cp_async_commit();
  }
  auto solve_tile = [&](int f0) {  // feature columns f0 + g, f0 + g + 8 of [K | V]
    const bool key_tile = f0 < KP;
    // y[s][nt][e4]: feature f0 + g + 8·(e4/2), token 16s + 8nt + 2tq + e4%2.
    float y[kNumSubBlocks][2][4];
#pragma unroll
    for (int s = 0; s < kNumSubBlocks; ++s)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) {
          const int i = 16 * s + 8 * nt + 2 * tq + (e4 & 1), f = f0 + g + 8 * (e4 >> 1);
          if (key_tile) {
            y[s][nt][e4] = gam[i * ldk + f];  // K⊙e^Γ since phase 4
          } else {
            y[s][nt][e4] = bf16_bits_to_float(value_rows[i * ldv + f - KP]);
          }
        }
#pragma unroll
    for (int s = 0; s < kNumSubBlocks; ++s) {
#pragma unroll
      for (int t = 0; t < s; ++t)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint32_t a[4] = {to_tf32(-y[t][kk][0]), to_tf32(-y[t][kk][2]),
                                 to_tf32(-y[t][kk][1]), to_tf32(-y[t][kk][3])};
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const float2 b =
                load_pair(lower + (16 * s + 8 * nt + g) * kLdPair + 16 * t + 8 * kk + 2 * tq);
            mma_tf32_16x8x8(y[s][nt], a, to_tf32(b.x), to_tf32(b.y));
          }
        }
      uint32_t a[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        a[kk][0] = to_tf32(y[s][kk][0]), a[kk][1] = to_tf32(y[s][kk][2]);
        a[kk][2] = to_tf32(y[s][kk][1]), a[kk][3] = to_tf32(y[s][kk][3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) y[s][nt][e4] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const float2 b =
              load_pair(solve_blocks + (16 * s + 8 * nt + g) * kLdSolve + 8 * kk + 2 * tq);
          mma_tf32_16x8x8(y[s][nt], a[kk], to_tf32(b.x), to_tf32(b.y));
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kNumSubBlocks; ++s)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) {
          const int i = 16 * s + 8 * nt + 2 * tq + (e4 & 1), f = f0 + g + 8 * (e4 >> 1);
          if (key_tile)
            ws.w[(ch * kChunk + i) * KP + f] = y[s][nt][e4];
          else
            ws.u[(ch * kChunk + i) * VP + f - KP] = y[s][nt][e4];
        }
  };
  for (int tile = warp; tile < KP / 16; tile += kWarps) solve_tile(16 * tile);
  cp_async_wait<0>();
  __syncthreads();  // V's rows landed
  for (int tile = warp; tile < VP / 16; tile += kWarps) solve_tile(KP + 16 * tile);
  stamp(6);
}

}  // namespace

int kda_static_dims(const KdaDims& d) {
  static const bool off = !env_flag("DM_KDA_STATIC_DIMS", true);
  return !off && d.KP == kKdaStaticDims && d.VP == kKdaStaticDims ? kKdaStaticDims : 0;
}

void kda_chunk_prepare_tensor_cores(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* g, const uint16_t* beta,
                                    const int32_t* doc_start, const KdaDims& d,
                                    const KdaForwardWorkspace& ws, cudaStream_t stream) {
  if (d.num_chunks == 0 || d.B * d.H == 0) return;
  const int shared = tc_prepare_layout(d.KP).total;
  // DM_KDA_PREPARE_INSIDE=pairs (read once): every sub-block's inside pairs one by one.
  static const float inside_limit = [] {
    return env_choice("DM_KDA_PREPARE_INSIDE", {"limit", "pairs"}) == 1 ? 0.0f
                                                                        : kKdaInsideExponentLimit;
  }();
  auto launch = [&](auto kernel) {
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    kernel<<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H)), kThreads, size_t(shared), stream>>>(
        q, k, v, g, beta, doc_start, d, ws, inside_limit);
  };
  if (kda_static_dims(d) == kKdaStaticDims)
    launch(kda_chunk_prepare_tc_kernel<kKdaStaticDims>);
  else
    launch(kda_chunk_prepare_tc_kernel<0>);
  check_last_error("cuda kda_chunk_forward (prepare, tensor cores)");
}

}  // namespace dm::cuda::kda_detail

namespace dm::cuda {

void kda_prepare_phase_clock(bool enable) {
  kda_detail::phase_clock_enable(kda_detail::g_prepare_clock_on, enable);
}

int kda_prepare_phase_cycles(long long* cycles, const char** names, int max_phases) {
  return kda_detail::phase_clock_read(kda_detail::g_prepare_clock, kda_detail::kPreparePhaseNames,
                                      cycles, names, max_phases);
}

}  // namespace dm::cuda
