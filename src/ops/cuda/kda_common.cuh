// Device-side pieces shared by the chunked KDA forward (kda_chunk.cu) and backward
// (kda_chunk_backward.cu): problem dims, the workspace layout, the per-chunk "prepare" stage that
// builds the masked intra-chunk products in shared memory, and a plain block-level matmul.
// Included only by nvcc-compiled files. See kda.h for the operator and ops/cpu/kda.cpp for the
// algebra of the chunked form.
//
// Documents inside a chunk are handled with masks instead of the CPU's pieces: seg[i] counts the
// document starts at chunk tokens 0..i (token 0 counts when it starts a document at t > 0), and
//   - only tokens with seg == 0 see the chunk-start state (Q⊙e^Γ and K⊙e^Γ rows masked),
//   - L_ij and P_ij are zero across segments,
//   - only tokens of the last segment feed the state after the chunk (K⊙e^{γ−Γ} rows masked),
//     and the chunk-start state is dropped (decay 0) when the chunk holds any document start.
// Γ is the cumsum from the chunk start even inside later segments: only its differences within a
// segment (pairwise, ≤ 0) and, for segment 0, Γ itself are ever exponentiated.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cpu/kda.h"  // KdaShape
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/elementwise_storage.cuh"

namespace dm::cuda::kda_detail {

constexpr int kChunk = 64;         // tokens per chunk (C)
constexpr int kSubBlock = 16;      // pairwise-exponent sub-block inside a chunk
constexpr int kNumSubBlocks = kChunk / kSubBlock;
constexpr int kPairsPerSubBlock = kSubBlock * (kSubBlock + 1) / 2;  // j ≤ i inside one sub-block
constexpr int kThreads = 256;      // every chunked kernel runs 256 threads
constexpr int kTileV = 32;         // value columns per block in the state / output stages
constexpr int kLowerStride = kChunk + 1;  // row stride of the [C, C] shared matrices
constexpr float kL2NormEps = 1e-6f;       // SPEC §1.1: z / sqrt(Σz² + 1e-6)

// Shapes of one call. KP, VP: K and V rounded up to 16 (zero padded everywhere).
struct KdaDims {
  int64_t B, T, H;
  int K, V, KP, VP;
  int64_t num_chunks;  // ceil(T / C)
  float scale;
};

// The head dims the chunked kernels also compile for as constants (KP = VP = 128, the models'
// head size): kda_static_dims(d) returns 128 for those dims, else 0 (runtime dims). Constant
// dims fold the shared layouts and strides, which frees registers (the split key kernel's
// spills 428 -> 56 bytes) and instructions. DM_KDA_STATIC_DIMS=0 (read once) turns it off.
constexpr int kKdaStaticDims = 128;
int kda_static_dims(const KdaDims& d);

// Inside a 16-token sub-block the pairwise decays may factor through its middle token m,
// e^{Γ_i−Γ_j} = e^{Γ_i−Γ_m}·e^{Γ_m−Γ_j}, as tensor-core products, when every factor stays far
// inside fp32 (and tf32) range: max |Γ_i − Γ_m| over the sub-block and channels < 60. A decay
// gate bounded below by −5 per token (the safe gate) keeps it under 40; sub-blocks over the
// limit (or with NaN) take the exact pair-by-pair loops.
constexpr float kKdaInsideExponentLimit = 60.0f;

// Per chunk-head (index ch = bh·num_chunks + n) forward quantities, all fp32, padded dims.
struct KdaForwardWorkspace {
  float* w;                // [·, C, KP]  A·Diag(β)·(K⊙e^Γ), masked to segment 0
  float* u;                // [·, C, VP]  A·Diag(β)·V
  float* query_decay;      // [·, C, KP]  Q⊙e^Γ (q̂ incl. scale), masked to segment 0
  float* key_to_end;       // [·, C, KP]  K⊙e^{γ−Γ}, masked to the last segment
  float* lower_query_key;  // [·, C, C]   P (j ≤ i, same segment)
  float* lower_key_key;    // [·, C, C]   L without β (j < i, same segment; zero elsewhere), for
                           //             the backward's value kernel (kda_chunk_backward_value.cu)
  float* decay_whole;      // [·, KP]     e^γ, or 0 when the chunk holds a document start
  float* value_new;        // [·, C, VP]  V' = U − W·S
  float* states;           // [·, KP, VP] state at the chunk start
  float* inverse_norms;  // [·, 2, C]   1/‖q‖ then 1/‖k‖ of the chunk's rows, for the backward's
                         //             key kernel (kda_chunk_backward_key.cu)
};

// Views of the prepare stage's shared memory (row strides: LDK = KP + 1, kLowerStride).
struct KdaChunkShared {
  float* query_norm;       // [C, LDK]  q̂·scale (zero rows past the chunk end, zero pad columns)
  float* key_norm;         // [C, LDK]  k̂
  float* gamma;            // [C, LDK]  Γ (inclusive cumsum of g from the chunk start)
  float* lower_key_key;    // [C, C+1]  L without β (j < i, same segment)
  float* lower_query_key;  // [C, C+1]  P (j ≤ i, same segment)
  float* ref_cols;         // [C − 16, LDK]  k̂_j ⊙ e^{Γ_r − Γ_j} for the current reference r
  float* ref_rows_query;   // [16, LDK]      q̂_i ⊙ e^{Γ_i − Γ_r}
  float* ref_rows_key;     // [16, LDK]      k̂_i ⊙ e^{Γ_i − Γ_r}
  float* beta;             // [C]
  float* query_inv_norm;   // [C]  1/sqrt(Σq² + eps)
  float* key_inv_norm;     // [C]
  int* seg;                // [C]
};

__host__ __device__ inline int kda_ldk(const KdaDims& d) { return d.KP + 1; }

// Floats of KdaChunkShared (the seg ints are counted as floats: same size).
__host__ __device__ inline int64_t kda_chunk_shared_floats(const KdaDims& d) {
  const int64_t ldk = kda_ldk(d);
  return 3 * kChunk * ldk + 2 * kChunk * kLowerStride + (kChunk - kSubBlock) * ldk +
         2 * kSubBlock * ldk + 4 * kChunk;
}

__device__ inline KdaChunkShared kda_chunk_shared_carve(float* base, const KdaDims& d) {
  const int ldk = kda_ldk(d);
  KdaChunkShared sm;
  float* p = base;
  sm.query_norm = p;      p += kChunk * ldk;
  sm.key_norm = p;        p += kChunk * ldk;
  sm.gamma = p;           p += kChunk * ldk;
  sm.lower_key_key = p;   p += kChunk * kLowerStride;
  sm.lower_query_key = p; p += kChunk * kLowerStride;
  sm.ref_cols = p;        p += (kChunk - kSubBlock) * ldk;
  sm.ref_rows_query = p;  p += kSubBlock * ldk;
  sm.ref_rows_key = p;    p += kSubBlock * ldk;
  sm.beta = p;            p += kChunk;
  sm.query_inv_norm = p;  p += kChunk;
  sm.key_inv_norm = p;    p += kChunk;
  sm.seg = reinterpret_cast<int*>(p);
  return sm;
}

// Row of token t of head h in batch b (q, k, g rows have K values, v / o rows V values).
__device__ __forceinline__ int64_t kda_token_row(const KdaDims& d, int64_t b, int64_t h,
                                                 int64_t t) {
  return (b * d.T + t) * d.H + h;
}

// Tokens of chunk n (the last chunk may be partial).
__device__ __forceinline__ int kda_chunk_length(const KdaDims& d, int64_t n) {
  const int64_t left = d.T - n * kChunk;
  return left < kChunk ? int(left) : kChunk;
}

// 8 bf16 (one 16-byte load) → 8 fp32 in shared memory (two 16-byte stores; dst 16-byte aligned).
__device__ __forceinline__ void kda_store_8_bf16_as_float(float* dst, uint4 bits) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
  float4 lo, hi;
  lo.x = __uint_as_float(w[0] << 16); lo.y = __uint_as_float(w[0] & 0xffff0000u);
  lo.z = __uint_as_float(w[1] << 16); lo.w = __uint_as_float(w[1] & 0xffff0000u);
  hi.x = __uint_as_float(w[2] << 16); hi.y = __uint_as_float(w[2] & 0xffff0000u);
  hi.z = __uint_as_float(w[3] << 16); hi.w = __uint_as_float(w[3] & 0xffff0000u);
  *reinterpret_cast<float4*>(dst) = lo;
  *reinterpret_cast<float4*>(dst + 4) = hi;
}

// True when rows of K (and V) bf16 values can be read 8 at a time from these pointers.
__device__ __forceinline__ bool kda_rows_by_8(const KdaDims& d, const void* a, const void* b,
                                              const void* c, const void* e) {
  return d.K % 8 == 0 && d.V % 8 == 0 &&
         ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
           reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(e)) & 15) == 0;
}

// The chunk's raw q, k rows as bf16 bits [C, ldr] and g as fp32 [C, ldg] in shared memory, by
// the whole block (one round trip for the chunk; no barrier inside); zero past the chunk end
// (c_len tokens) and K up to KP, by the kBlockThreads threads of the block. by_8 (kda_rows_by_8):
// 16-byte loads; ldr, ldg keep 16-byte aligned rows (KP + 8 and KP + 4 with KP a multiple of 16).
// query_raw == nullptr: k and g only.
template <int kBlockThreads = kThreads>
__device__ inline void kda_stage_rows_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* g,
                                           const KdaDims& d, int64_t b, int64_t h, int64_t t0,
                                           int c_len, bool by_8, uint16_t* query_raw,
                                           uint16_t* key_raw, int ldr, float* gamma, int ldg) {
  const int tid = threadIdx.x;
  if (by_8) {
    const int per_row = d.KP / 8;
    for (int idx = tid; idx < kChunk * per_row; idx += kBlockThreads) {
      const int i = idx / per_row, col = idx % per_row * 8;
      uint4 query_bits = make_uint4(0, 0, 0, 0), key_bits = query_bits, gate_bits = query_bits;
      if (i < c_len && col < d.K) {  // K % 8 == 0: the 8 columns are all inside K
        const int64_t at = ((b * d.T + t0 + i) * d.H + h) * d.K + col;
        if (query_raw != nullptr) query_bits = *reinterpret_cast<const uint4*>(q + at);
        key_bits = *reinterpret_cast<const uint4*>(k + at);
        gate_bits = *reinterpret_cast<const uint4*>(g + at);
      }
      if (query_raw != nullptr) *reinterpret_cast<uint4*>(query_raw + i * ldr + col) = query_bits;
      *reinterpret_cast<uint4*>(key_raw + i * ldr + col) = key_bits;
      kda_store_8_bf16_as_float(gamma + i * ldg + col, gate_bits);
    }
    return;
  }
  for (int idx = tid; idx < kChunk * d.KP; idx += kBlockThreads) {
    const int i = idx / d.KP, col = idx % d.KP;
    const bool valid = i < c_len && col < d.K;
    const int64_t at = valid ? ((b * d.T + t0 + i) * d.H + h) * d.K + col : 0;
    if (query_raw != nullptr) query_raw[i * ldr + col] = valid ? q[at] : uint16_t(0);
    key_raw[i * ldr + col] = valid ? k[at] : uint16_t(0);
    gamma[i * ldg + col] = valid ? load_as_float(g, at) : 0.0f;
  }
}

// seg[i] for the chunk's tokens (this file's header): thread 0 writes them, the caller's next
// barrier publishes them. Tokens past the chunk end (i ≥ c_len) keep the last segment.
__device__ inline void kda_chunk_segments(const int32_t* doc_start, const KdaDims& d, int64_t b,
                                          int64_t t0, int c_len, int* seg) {
  if (threadIdx.x != 0) return;
  int segment = 0;
  for (int i = 0; i < kChunk; ++i) {
    const int64_t t = t0 + i;
    if (i < c_len && doc_start != nullptr && t > 0 && doc_start[b * d.T + t] == t) ++segment;
    seg[i] = segment;
  }
}

// After kda_stage_rows_bf16 and a barrier: the rows' inverse L2 norms (warp per row, from the
// bf16 bits) and Γ = cumsum g down each column in place (thread per column), by the whole block
// of kBlockThreads threads; no barrier inside. query_raw == nullptr: k's norms only; gamma ==
// nullptr: the norms only.
template <int kBlockThreads = kThreads>
__device__ inline void kda_inverse_norms_and_cumsum(const uint16_t* query_raw,
                                                    const uint16_t* key_raw, int ldr, float* gamma,
                                                    int ldg, const KdaDims& d, float* query_inv,
                                                    float* key_inv) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = warp; i < kChunk; i += kBlockThreads / 32) {
    float sum_q = 0.0f, sum_k = 0.0f;
    for (int col = lane; col < d.K; col += 32) {
      const float qv = query_raw ? __uint_as_float(uint32_t(query_raw[i * ldr + col]) << 16) : 0.0f;
      const float kv = __uint_as_float(uint32_t(key_raw[i * ldr + col]) << 16);
      sum_q += qv * qv;
      sum_k += kv * kv;
    }
    sum_q = warp_sum(sum_q);
    sum_k = warp_sum(sum_k);
    if (lane == 0) {
      if (query_raw != nullptr) query_inv[i] = 1.0f / sqrtf(sum_q + kL2NormEps);
      key_inv[i] = 1.0f / sqrtf(sum_k + kL2NormEps);
    }
  }
  for (int col = tid; gamma != nullptr && col < d.KP; col += kBlockThreads) {
    float running = 0.0f;
    for (int i = 0; i < kChunk; ++i) {
      running += gamma[i * ldg + col];
      gamma[i * ldg + col] = running;
    }
  }
}

// The prepare stage for chunk n of head bh, by the whole block (kThreads threads); ends with a
// barrier. Fills every KdaChunkShared view: rows past the chunk end are zero (q, k, g, β), so
// they add nothing anywhere and Γ of those rows equals Γ of the last real token.
template <typename Storage>
__device__ void kda_chunk_prepare(const Storage* q, const Storage* k, const Storage* g,
                                  const Storage* beta, const int32_t* doc_start,
                                  const KdaDims& d, int64_t bh, int64_t n,
                                  const KdaChunkShared& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = bh / d.H, h = bh % d.H;
  const int64_t t0 = n * kChunk;
  const int c = kda_chunk_length(d, n);
  const int ldk = kda_ldk(d);

  // 1. Raw q, k, g rows and β, block-wide and coalesced (one round trip for the whole chunk;
  //    a warp walking its rows would wait on one per row). Zero past the chunk end and K.
  for (int idx = tid; idx < kChunk * d.KP; idx += kThreads) {
    const int i = idx / d.KP, col = idx % d.KP;
    const bool valid = i < c && col < d.K;
    const int64_t at = valid ? kda_token_row(d, b, h, t0 + i) * d.K + col : 0;
    sm.query_norm[i * ldk + col] = valid ? load_as_float(q, at) : 0.0f;
    sm.key_norm[i * ldk + col] = valid ? load_as_float(k, at) : 0.0f;
    sm.gamma[i * ldk + col] = valid ? load_as_float(g, at) : 0.0f;
  }
  if (tid < kChunk) sm.beta[tid] = tid < c ? load_as_float(beta, kda_token_row(d, b, h, t0 + tid)) : 0.0f;
  kda_chunk_segments(doc_start, d, b, t0, c, sm.seg);
  // Entries above the diagonal are never written below: zero them now.
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    if (j > i) {
      sm.lower_key_key[i * kLowerStride + j] = 0.0f;
      sm.lower_query_key[i * kLowerStride + j] = 0.0f;
    }
  }
  __syncthreads();

  // 2. L2 norms (one warp per row, in place: q̂·scale, k̂) and Γ, the inclusive cumsum down
  //    each column (threads by column; disjoint from the rows' data).
  for (int i = warp; i < kChunk; i += kThreads / 32) {
    float sum_q = 0.0f, sum_k = 0.0f;
    for (int col = lane; col < d.K; col += 32) {
      const float qv = sm.query_norm[i * ldk + col], kv = sm.key_norm[i * ldk + col];
      sum_q += qv * qv;
      sum_k += kv * kv;
    }
    sum_q = warp_sum(sum_q);
    sum_k = warp_sum(sum_k);
    const float query_inv = 1.0f / sqrtf(sum_q + kL2NormEps);
    const float key_inv = 1.0f / sqrtf(sum_k + kL2NormEps);
    for (int col = lane; col < d.K; col += 32) {
      sm.query_norm[i * ldk + col] = sm.query_norm[i * ldk + col] * query_inv * d.scale;
      sm.key_norm[i * ldk + col] = sm.key_norm[i * ldk + col] * key_inv;
    }
    if (lane == 0) {
      sm.query_inv_norm[i] = query_inv;
      sm.key_inv_norm[i] = key_inv;
    }
  }
  for (int col = tid; col < d.KP; col += kThreads) {
    float running = 0.0f;
    for (int i = 0; i < kChunk; ++i) {
      running += sm.gamma[i * ldk + col];
      sm.gamma[i * ldk + col] = running;
    }
  }
  __syncthreads();

  // 3. Pairs inside one sub-block: pairwise exponent Γ_i − Γ_j ≤ 0 (j ≤ i).
  for (int p = tid; p < kNumSubBlocks * kPairsPerSubBlock; p += kThreads) {
    const int block = p / kPairsPerSubBlock;
    const int r = p % kPairsPerSubBlock;
    int ii = 0;
    while ((ii + 1) * (ii + 2) / 2 <= r) ++ii;  // r = ii(ii+1)/2 + jj, jj ≤ ii
    const int jj = r - ii * (ii + 1) / 2;
    const int i = block * kSubBlock + ii, j = block * kSubBlock + jj;
    float key_key = 0.0f, query_key = 0.0f;
    for (int col = 0; col < d.K; ++col) {
      const float key_j = sm.key_norm[j * ldk + col] *
                          expf(sm.gamma[i * ldk + col] - sm.gamma[j * ldk + col]);
      key_key += sm.key_norm[i * ldk + col] * key_j;
      query_key += sm.query_norm[i * ldk + col] * key_j;
    }
    const bool same_segment = sm.seg[i] == sm.seg[j];
    sm.lower_key_key[i * kLowerStride + j] = (j < i && same_segment) ? key_key : 0.0f;
    sm.lower_query_key[i * kLowerStride + j] = same_segment ? query_key : 0.0f;
  }

  // 4. Rows of sub-block r against all earlier columns, through the reference token r0 = 16r:
  //    e^{Γ_i − Γ_j} = e^{Γ_i − Γ_r0} · e^{Γ_r0 − Γ_j}, both exponents ≤ 0 (j < r0 ≤ i).
  for (int block = 1; block < kNumSubBlocks; ++block) {
    const int r0 = block * kSubBlock;
    for (int idx = tid; idx < r0 * d.KP; idx += kThreads) {
      const int j = idx / d.KP, col = idx % d.KP;
      sm.ref_cols[j * ldk + col] =
          sm.key_norm[j * ldk + col] * expf(sm.gamma[r0 * ldk + col] - sm.gamma[j * ldk + col]);
    }
    for (int idx = tid; idx < kSubBlock * d.KP; idx += kThreads) {
      const int ii = idx / d.KP, col = idx % d.KP;
      const int i = r0 + ii;
      const float decay_from_ref = expf(sm.gamma[i * ldk + col] - sm.gamma[r0 * ldk + col]);
      sm.ref_rows_query[ii * ldk + col] = sm.query_norm[i * ldk + col] * decay_from_ref;
      sm.ref_rows_key[ii * ldk + col] = sm.key_norm[i * ldk + col] * decay_from_ref;
    }
    __syncthreads();
    for (int idx = tid; idx < kSubBlock * r0; idx += kThreads) {
      const int ii = idx / r0, j = idx % r0;  // consecutive threads: consecutive j
      const int i = r0 + ii;
      float key_key = 0.0f, query_key = 0.0f;
      for (int col = 0; col < d.K; ++col) {
        const float ref_col = sm.ref_cols[j * ldk + col];
        key_key += sm.ref_rows_key[ii * ldk + col] * ref_col;
        query_key += sm.ref_rows_query[ii * ldk + col] * ref_col;
      }
      const bool same_segment = sm.seg[i] == sm.seg[j];
      sm.lower_key_key[i * kLowerStride + j] = same_segment ? key_key : 0.0f;
      sm.lower_query_key[i * kLowerStride + j] = same_segment ? query_key : 0.0f;
    }
    __syncthreads();  // the next reference overwrites ref_*
  }
}

// C[M,N] = alpha · op(A)[M,Kd] · op(B)[Kd,N] (+ C when accumulate), by the whole block
// (kThreads threads; no barrier inside: the caller orders dependent calls with __syncthreads).
// op(A)[m,k] = TransA ? A[k·lda + m] : A[m·lda + k];  op(B)[k,n] = TransB ? B[n·ldb + k] : B[k·ldb + n].
// Pointers may be shared or global memory. Each thread owns a 4×4 micro-tile strided by 16, so a
// pass covers 64×64 outputs; a plain, obviously-correct helper for the fp32 backward.
template <bool TransA, bool TransB>
__device__ void block_matmul(int M, int N, int Kd, float alpha, const float* A, int lda,
                             const float* B, int ldb, bool accumulate, float* C, int ldc) {
  const int tm = threadIdx.x / 16, tn = threadIdx.x % 16;
  for (int m0 = 0; m0 < M; m0 += 64)
    for (int n0 = 0; n0 < N; n0 += 64) {
      float acc[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int s = 0; s < 4; ++s) acc[r][s] = 0.0f;
      for (int kk = 0; kk < Kd; ++kk) {
        float a[4], bv[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int m = m0 + tm + 16 * r;
          a[r] = m < M ? (TransA ? A[kk * lda + m] : A[m * lda + kk]) : 0.0f;
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int nn = n0 + tn + 16 * s;
          bv[s] = nn < N ? (TransB ? B[nn * ldb + kk] : B[kk * ldb + nn]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int s = 0; s < 4; ++s) acc[r][s] += a[r] * bv[s];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int m = m0 + tm + 16 * r, nn = n0 + tn + 16 * s;
          if (m < M && nn < N) {
            const float value = alpha * acc[r][s];
            C[m * ldc + nn] = accumulate ? C[m * ldc + nn] + value : value;
          }
        }
    }
}

// Phase-clock readout (bench_cuda_kda --phases): cycles[i] = stamps[i] − stamps[0] and the
// phase names, for up to max_phases of the `count` stamps; returns how many were written.
inline int phase_cycles_since_start(const long long* stamps, const char* const* table, int count,
                                    long long* cycles, const char** names, int max_phases) {
  const int n = max_phases < count ? max_phases : count;
  for (int i = 0; i < n; ++i) {
    cycles[i] = stamps[i] - stamps[0];
    names[i] = table[i];
  }
  return n;
}

// Host side of a kernel's phase clock: its __device__ int flag and __device__ long long stamp
// array (kCount phases, names in `table`). Synchronous symbol copies.
template <typename Flag>
void phase_clock_enable(const Flag& flag, bool enable) {
  const int on = enable ? 1 : 0;
  DM_CUDA_CHECK(cudaMemcpyToSymbol(flag, &on, sizeof on));
}
template <int kCount>
int phase_clock_read(const long long (&stamps_symbol)[kCount], const char* const* table,
                     long long* cycles, const char** names, int max_phases) {
  long long stamps[kCount];
  DM_CUDA_CHECK(cudaMemcpyFromSymbol(stamps, stamps_symbol, sizeof stamps));
  return phase_cycles_since_start(stamps, table, kCount, cycles, names, max_phases);
}

// ---------------------------------------------------------------------------------------------
// Host helpers defined in kda_chunk.cu, shared with kda_chunk_backward.cu.

// Checks the shape (K, V ≤ 128, B·H < 65536) and fills KdaDims; errors name `who`.
KdaDims kda_make_dims(const KdaShape& s, float scale, const char* who);
// Carves the forward workspace from `base` into *ws (ws == nullptr: only counts); returns bytes.
size_t kda_forward_workspace_carve(const KdaDims& d, void* base, KdaForwardWorkspace* ws);
// Stages 1 and 2 of the forward: fills ws (chunk-start states, V', …) and writes sT. The state
// stage runs on tensor cores (tf32 operands) when `tensor_cores`, else in fp32 on CUDA cores.
template <typename Storage>
void kda_chunk_prepare_and_state(const Storage* q, const Storage* k, const Storage* v,
                                 const Storage* g, const Storage* beta, const float* s0,
                                 float* sT, const KdaDims& d, const KdaForwardWorkspace& ws,
                                 const int32_t* doc_start, bool tensor_cores,
                                 cudaStream_t stream);
// Prepare stage for bf16 inputs (kda_chunk_prepare_tc.cu): the same workspace as the fp32
// prepare kernel, L and P across sub-blocks on tensor cores (tf32), two blocks per SM.
void kda_chunk_prepare_tensor_cores(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* g, const uint16_t* beta,
                                    const int32_t* doc_start, const KdaDims& d,
                                    const KdaForwardWorkspace& ws, cudaStream_t stream);
// State stage on tensor cores (tf32 operands, fp32 state; kda_chunk_state_tf32.cu).
void kda_chunk_state_tf32(const float* s0, float* sT, const KdaDims& d,
                          const KdaForwardWorkspace& ws, cudaStream_t stream);
// Output stage on tensor cores (bf16 operands; kda_chunk_tc.cu).
template <typename Storage>
void kda_chunk_output_tensor_cores(Storage* o, const KdaDims& d, const KdaForwardWorkspace& ws,
                                   cudaStream_t stream);

}  // namespace dm::cuda::kda_detail
