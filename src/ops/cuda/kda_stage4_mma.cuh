// Block-level pieces of stage 4 of the chunked KDA backward shared by its tensor-core kernels:
// the fused one (kda_chunk_backward_tc.cu) and the split pair (kda_chunk_backward_value.cu,
// kda_chunk_backward_key.cu). Every function here is called by all kThreads threads of a block.
// Included only by nvcc-compiled files.
#pragma once
#include <cstdint>

#include "ops/cuda/attention_mma.cuh"  // cp_async_16 / cp_async_commit / cp_async_wait
#include "ops/cuda/kda_backward_detail.cuh"  // kda_stage4_column_groups
#include "ops/cuda/kda_common.cuh"
#include "ops/cuda/kda_mma.cuh"

namespace dm::cuda::kda_detail {

constexpr int kWarps = kThreads / 32;
constexpr int kLdPair = kChunk + 4;  // row stride of the [C, C] fp32 shared matrices

// The key-side products take their [KP, VP] right operand (S or dS', rows = channels) from the
// workspace in column slabs of kSlab, staged in shared memory by the whole block (16-byte
// cp.async, double-buffered) instead of per-warp 8-byte fragment loads from L2: those made each
// warp wait on L2 latency once per k-step, and the warps sharing a channel range each read the
// whole matrix. Row stride kSlabLd ≡ 8 (mod 32) floats: a half-warp's 8-byte fragment loads
// (rows g, columns 2tq) hit 32 distinct banks.
constexpr int kSlab = 32, kSlabLd = kSlab + 8;

// Launches the instance of a split stage-4 kernel (kda_chunk_backward_value.cu, _key.cu) that
// these dims take, over its (chunk, batch-head, half) grid: Kernel<2, 0> (256 threads) when
// kda_stage4_column_groups(half_width) is 2, else Kernel<4, kKdaStaticDims> (512 threads) when
// kda_static_dims(d) picks the compile-time head dims, else Kernel<4, 0>; after raising its
// dynamic shared memory limit to `shared`.
template <typename Kernel, typename... Args>
void launch_stage4_split_kernel(Kernel two_groups, Kernel four_groups_static, Kernel four_groups,
                                int half_width, const KdaDims& d, int shared, cudaStream_t stream,
                                Args... args) {
  const int groups = kda_stage4_column_groups(half_width);
  const Kernel kernel = groups == 2                            ? two_groups
                        : kda_static_dims(d) == kKdaStaticDims ? four_groups_static
                                                               : four_groups;
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  kernel<<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H), 2), 32 * kNumSubBlocks * groups,
           size_t(shared), stream>>>(args...);
}

// Copies rows [row0, row0 + rows) and columns [s·kSlab, (s+1)·kSlab) of the [·, VP] matrix B
// into dst [rows, kSlabLd], by the kBlockThreads threads of the block.
template <int kBlockThreads = kThreads>
__device__ __forceinline__ void stage_slab(float* dst, const float* B, int row0, int rows, int VP,
                                           int s) {
  constexpr int kPerRow = kSlab / 4;
  for (int idx = threadIdx.x; idx < rows * kPerRow; idx += kBlockThreads) {
    const int r = idx / kPerRow, c4 = idx % kPerRow;
    attention_detail::cp_async_16(dst + r * kSlabLd + 4 * c4,
                                  B + int64_t(row0 + r) * VP + s * kSlab + 4 * c4, true);
  }
}

// acc[j] += Σ_e A[r0 + r][e] · B[col0 + 8j + n][e] over e < VP (the warp's 16 rows × 8·n_tiles
// channels, col0 absolute), A through load_a2(r, e) (k-adjacent pairs). slabs == nullptr: B's
// fragments come from global memory directly; otherwise rows [row0, row0 + rows) of B (which
// must hold the warp's channels) are staged slab by slab in `slabs` (two buffers of
// [rows, kSlabLd] fp32; VP % kSlab == 0), and the call ends with a barrier. With slabs every
// thread of the block (kBlockThreads) must call it. Hooks, with slabs only: before_slab(s) runs
// before the barrier that publishes slab s (issue loads there), after_slab(slab, s) after the
// products, before the barrier that retires it (slab: its [rows, kSlabLd] buffer, B's columns
// s·kSlab + [0, kSlab)).
struct NoSlabHook {
  __device__ void operator()(int) const {}
  __device__ void operator()(const float*, int) const {}
};
template <MmaPrecision kPrecision, int kTiles, int kBlockThreads = kThreads, typename LoadA2,
          typename BeforeSlab = NoSlabHook, typename AfterSlab = NoSlabHook>
__device__ __forceinline__ void key_side_product(float (&acc)[kTiles][4], int n_tiles, int col0,
                                                 int row0, int rows, int VP, const float* B,
                                                 float* slabs, LoadA2&& load_a2,
                                                 BeforeSlab&& before_slab = {},
                                                 AfterSlab&& after_slab = {}) {
  if (slabs == nullptr) {
    warp_mma_pairs<kPrecision>(acc, n_tiles, 0, VP, load_a2, [&](int e, int nn) {
      return load_pair(B + int64_t(col0 + nn) * VP + e);
    });
    return;
  }
  const int count = VP / kSlab, buffer = rows * kSlabLd;
  stage_slab<kBlockThreads>(slabs, B, row0, rows, VP, 0);
  attention_detail::cp_async_commit();
  for (int s = 0; s < count; ++s) {
    if (s + 1 < count) {
      // Buffer (s+1)&1 was last read by slab s−1, before the barrier that ended its step.
      stage_slab<kBlockThreads>(slabs + ((s + 1) & 1) * buffer, B, row0, rows, VP, s + 1);
      attention_detail::cp_async_commit();
      attention_detail::cp_async_wait<1>();
    } else {
      attention_detail::cp_async_wait<0>();
    }
    before_slab(s);
    __syncthreads();
    const float* slab = slabs + (s & 1) * buffer - s * kSlab - row0 * kSlabLd;  // absolute e, row
    warp_mma_pairs<kPrecision>(
        acc, n_tiles, s * kSlab, (s + 1) * kSlab, load_a2,
        [&](int e, int nn) { return load_pair(slab + (col0 + nn) * kSlabLd + e); });
    after_slab(slabs + (s & 1) * buffer, s);
    __syncthreads();
  }
}

// acc[j] += Σ_c A[r0 + r][c] · B[c][col0 + 8j + n] over c < K for the warp's 16 rows × 8·n_tiles
// columns (col0 local to the block's `width` columns), where B [K, ·] is row-major in global
// memory (row stride ld_b, its first column at B) and is staged kSlab rows at a time in `slabs`
// (two buffers of [kSlab, width + 4] fp32, 16-byte cp.async by the whole block, the next slab in
// flight while the current one is used): the warps sharing B's columns read each element once
// from L2 between them, and their fragment loads wait on shared memory instead of L2. A comes
// through load_a2(r, c) (k-adjacent pairs). Row stride width + 4 ≡ 4 (mod 32) floats when
// width % 32 == 0: the two rows 2tq, 2tq + 1 a lane reads per k pair land on banks 8tq + g (+4).
// K % kSlab == 0, width % 4 == 0. Every thread of the block (kBlockThreads) must call it; it
// ends with a barrier, after which `slabs` (and `a_slabs`) are free.
// kStageA: A itself is a row-major [C, K] matrix in global memory (row stride lda) and is staged
// too, its kSlab columns of every row per step in a_slabs (two buffers of [C, kSlab] fp32, 16 KB,
// 16-byte pieces placed at piece ^ 2·(row & 3) so that a half warp's pair loads, rows g and
// columns 2tq of a 16-row tile, hit 32 distinct banks); load_a2 is then unused.
template <MmaPrecision kPrecision, int kTiles, int kBlockThreads, bool kStageA = false,
          typename LoadA2>
__device__ __forceinline__ void row_slab_product(float (&acc)[kTiles][4], int n_tiles, int col0,
                                                 int K, const float* B, int ld_b, int width,
                                                 float* slabs, LoadA2&& load_a2,
                                                 const float* A = nullptr, int lda = 0,
                                                 int row0 = 0, float* a_slabs = nullptr) {
  const int ld = width + 4, buffer = kSlab * ld, count = K / kSlab, per_row = width / 4;
  constexpr int kPieces = kSlab / 4;  // 16-byte pieces per row of an A slab
  auto stage = [&](int s) {
    float* dst = slabs + (s & 1) * buffer;
    const float* src = B + int64_t(s) * kSlab * ld_b;
    for (int idx = threadIdx.x; idx < kSlab * per_row; idx += kBlockThreads) {
      const int r = idx / per_row, c4 = idx % per_row;
      attention_detail::cp_async_16(dst + r * ld + 4 * c4, src + int64_t(r) * ld_b + 4 * c4, true);
    }
    if constexpr (kStageA) {
      float* a_dst = a_slabs + (s & 1) * kChunk * kSlab;
      for (int idx = threadIdx.x; idx < kChunk * kPieces; idx += kBlockThreads) {
        const int r = idx / kPieces, piece = idx % kPieces;
        attention_detail::cp_async_16(a_dst + r * kSlab + 4 * (piece ^ ((r & 3) << 1)),
                                      A + int64_t(r) * lda + s * kSlab + 4 * piece, true);
      }
    }
    attention_detail::cp_async_commit();
  };
  stage(0);
  for (int s = 0; s < count; ++s) {
    if (s + 1 < count) {
      // Buffer (s+1)&1 was last read by slab s−1, before the barrier that ended its step.
      stage(s + 1);
      attention_detail::cp_async_wait<1>();
    } else {
      attention_detail::cp_async_wait<0>();
    }
    __syncthreads();
    const float* slab = slabs + (s & 1) * buffer - s * kSlab * ld;  // absolute row c
    auto load_b2 = [&](int c, int nn) {
      return make_float2(slab[c * ld + col0 + nn], slab[(c + 1) * ld + col0 + nn]);
    };
    if constexpr (kStageA) {
      const float* a_slab = a_slabs + (s & 1) * kChunk * kSlab;
      auto staged_a2 = [&](int r, int c) {  // c absolute, even
        const int row = row0 + r, cc = c - s * kSlab;
        return load_pair(a_slab + row * kSlab + 4 * ((cc >> 2) ^ ((row & 3) << 1)) + (cc & 3));
      };
      warp_mma_pairs<kPrecision>(acc, n_tiles, s * kSlab, (s + 1) * kSlab, staged_a2, load_b2);
    } else {
      warp_mma_pairs<kPrecision>(acc, n_tiles, s * kSlab, (s + 1) * kSlab, load_a2, load_b2);
    }
    __syncthreads();
  }
}

// Columns [e0, e0 + width) of the chunk's dO rows as fp32 in dst [C, ld] (zero past the chunk end
// and V), 8 bf16 per 16-byte load when by_8 (kda_rows_by_8; e0 a multiple of 8), by the
// kBlockThreads threads of the block. No barrier.
template <int kBlockThreads = kThreads>
__device__ inline void kda_stage_d_out_f32(const uint16_t* d_o, const KdaDims& d, int64_t b,
                                           int64_t h, int64_t t0, int c_len, bool by_8, int e0,
                                           int width, float* dst, int ld) {
  auto row = [&](int i) { return kda_token_row(d, b, h, t0 + i) * d.V + e0; };
  if (by_8) {
    const int per_row = width / 8;
    for (int idx = threadIdx.x; idx < kChunk * per_row; idx += kBlockThreads) {
      const int i = idx / per_row, e = idx % per_row * 8;
      uint4 bits = make_uint4(0, 0, 0, 0);
      if (i < c_len && e0 + e < d.V) bits = *reinterpret_cast<const uint4*>(d_o + row(i) + e);
      kda_store_8_bf16_as_float(dst + i * ld + e, bits);
    }
    return;
  }
  for (int idx = threadIdx.x; idx < kChunk * width; idx += kBlockThreads) {
    const int i = idx / width, e = idx % width;
    dst[i * ld + e] = (i < c_len && e0 + e < d.V) ? load_as_float(d_o, row(i) + e) : 0.0f;
  }
}

// L (β-free, strictly lower, same segment) of the chunk into lower [C, kLdPair] (j < i; the
// caller zeroes j ≥ i): across sub-blocks t < s as one [16×16]·K product per (s, t) through the
// first token b = 16(t+1) after sub-block t (e^{Γ_i−Γ_j} = e^{Γ_i−Γ_b}·e^{Γ_b−Γ_j}, both ≤ 0),
// inside a sub-block one exp per pair and channel. k̂ from the raw bf16 rows [C, ldr] times
// key_inv, Γ [C, ldk] over KP channels (padded channels hold k = 0: they add nothing).
__device__ inline void kda_stage4_lower(const uint16_t* key_raw, int ldr, const float* key_inv,
                                        const float* gam, int ldk, const int* seg, int KP,
                                        float* lower) {
  const int tid = threadIdx.x, warp = tid >> 5;
  auto key_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(key_raw + i * ldr + c);
    const float inv = key_inv[i];
    return make_float2(__uint_as_float(bits << 16) * inv,
                       __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto gamma2 = [&](int i, int c) { return load_pair(gam + i * ldk + c); };
  // Across sub-blocks: warp w < 6 takes the (s, t) block below, through b = 16(t+1).
  if (warp < 6) {
    const int s = warp < 1 ? 1 : (warp < 3 ? 2 : 3), t = warp - (s - 1) * s / 2;  // (1,0) … (3,2)
    const int r0 = 16 * s, j0 = 16 * t, ref = 16 * (t + 1);
    float acc[2][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Tf32>(
        acc, 2, 0, KP,
        [&](int r, int c) {
          const float2 key = key_hat2(r0 + r, c), gamma_i = gamma2(r0 + r, c),
                       gamma_b = gamma2(ref, c);
          return make_float2(key.x * __expf(gamma_i.x - gamma_b.x),
                             key.y * __expf(gamma_i.y - gamma_b.y));
        },
        [&](int c, int nn) {
          const float2 key = key_hat2(j0 + nn, c), gamma_j = gamma2(j0 + nn, c),
                       gamma_b = gamma2(ref, c);
          return make_float2(key.x * __expf(gamma_b.x - gamma_j.x),
                             key.y * __expf(gamma_b.y - gamma_j.y));
        });
    for_each_element<2>(2, r0, j0, [&](int j, int e4, int i, int jj) {
      lower[i * kLdPair + jj] = seg[i] == seg[jj] ? acc[j][e4] : 0.0f;
    });
  }
  // Inside a sub-block: one exp per pair and channel (Γ_i − Γ_j ≤ 0, j < i).
  constexpr int kStrictPairs = kSubBlock * (kSubBlock - 1) / 2;
  for (int p = tid; p < kNumSubBlocks * kStrictPairs; p += kThreads) {
    const int block = p / kStrictPairs, r = p % kStrictPairs;
    int ii = 1;
    while (ii * (ii + 1) / 2 <= r) ++ii;  // r = ii(ii−1)/2 + jj, jj < ii
    const int jj = r - ii * (ii - 1) / 2;
    const int i = block * kSubBlock + ii, j = block * kSubBlock + jj;
    float sum = 0.0f;
    for (int c = 0; c < KP; c += 2) {
      const float2 key_i = key_hat2(i, c), key_j = key_hat2(j, c);
      const float2 gamma_i = gamma2(i, c), gamma_j = gamma2(j, c);
      sum += key_i.x * key_j.x * __expf(gamma_i.x - gamma_j.x) +
             key_i.y * key_j.y * __expf(gamma_i.y - gamma_j.y);
    }
    lower[i * kLdPair + j] = seg[i] == seg[j] ? sum : 0.0f;
  }
}

// dR = M⁻ᵀ·dV' in place in d_value [C, ld] (width columns, a multiple of 8), M = I + Diag(β)L:
// dR_j = dV'_j − Σ_{i>j} β_i L_ij dR_i, sub-blocks bottom up. Rows below sub-block s are final:
// their contribution is one tf32 product per 8-column tile; then the 16×16 diagonal block by
// substitution, a thread per column. Starts after a barrier; ends with one.
__device__ inline void kda_stage4_solve(float* d_value, int ld, int width, const float* beta_s,
                                        const float* lower) {
  const int tid = threadIdx.x, warp = tid >> 5;
  for (int s = kNumSubBlocks - 1; s >= 0; --s) {
    const int s0 = 16 * s;
    if (s < kNumSubBlocks - 1) {
      for (int tile = warp; tile < width / 8; tile += kWarps) {
        float acc[1][4];
        zero_tiles(acc);
        warp_mma<MmaPrecision::Tf32>(
            acc, 1, s0 + 16, kChunk,
            [&](int r, int i) { return beta_s[i] * lower[i * kLdPair + s0 + r]; },
            [&](int i, int nn) { return d_value[i * ld + 8 * tile + nn]; });
        for_each_element<1>(1, s0, 8 * tile,
                            [&](int, int e4, int j, int e) { d_value[j * ld + e] -= acc[0][e4]; });
      }
      __syncthreads();
    }
    for (int e = tid; e < width; e += kThreads)
      for (int j = s0 + kSubBlock - 2; j >= s0; --j) {
        float upper_sum = 0.0f;
        for (int i = j + 1; i < s0 + kSubBlock; ++i)
          upper_sum += beta_s[i] * lower[i * kLdPair + j] * d_value[i * ld + e];
        d_value[j * ld + e] -= upper_sum;
      }
    __syncthreads();
  }
}

// The pairwise sums of dL and dP inside the warp's 16-row sub-block (rows r0 … r0 + 15): one
// fixed pass over the sub-block's positions p serves both rows of a lane (i = r0 + g + 8·hh) and
// both directions. Rows take the weights dL_ip, dP_ip (zero unless p < i: the structural zeros
// of d_lkk, d_pqk [C, kLdPair]), columns dL_pi, dP_pi (zero unless p > i), and the one exponent
// −|Γ_i − Γ_p| is ≤ 0 for every pair used. For each of the lane's column pairs c = col0 + 8j +
// 2tq (tiles j < n_tiles): acc_q += the dP row sums, acc_k += the dL row and both column sums,
// and the dΓ terms go to add_gamma(j, hh, i, c, float2). key_hat2, query_hat2, gamma2 (i, c)
// return the pairs (c, c + 1) of k̂, q̂ (scaled) and Γ; the unrolled loop keeps the next
// positions' loads in flight.
template <int kTiles, typename KeyHat2, typename QueryHat2, typename Gamma2, typename AddGamma>
__device__ __forceinline__ void pairwise_inside_sub_block(
    float (&acc_q)[kTiles][4], float (&acc_k)[kTiles][4], int n_tiles, int r0, int col0,
    const float* d_lkk, const float* d_pqk, KeyHat2&& key_hat2, QueryHat2&& query_hat2,
    Gamma2&& gamma2, AddGamma&& add_gamma) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    if (j >= n_tiles) continue;
    const int c = col0 + 8 * j + 2 * tq;
    int rows[2];
    float2 gamma_row[2], row_lower[2], row_query_key[2], cols[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      rows[hh] = r0 + g + 8 * hh;
      gamma_row[hh] = gamma2(rows[hh], c);
      row_lower[hh] = row_query_key[hh] = cols[hh] = make_float2(0.0f, 0.0f);
    }
#pragma unroll(kTiles > 2 ? 4 : 2)
    for (int p = 0; p < kSubBlock; ++p) {
      const int position = r0 + p;
      const float2 key = key_hat2(position, c), query = query_hat2(position, c);
      const float2 gamma_p = gamma2(position, c);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = rows[hh];
        const float w_lower_row = d_lkk[i * kLdPair + position];
        const float w_query_key_row = d_pqk[i * kLdPair + position];
        const float w_lower_col = d_lkk[position * kLdPair + i];
        const float w_query_key_col = d_pqk[position * kLdPair + i];
        const float decay_x = __expf(-fabsf(gamma_row[hh].x - gamma_p.x));
        const float decay_y = __expf(-fabsf(gamma_row[hh].y - gamma_p.y));
        const float key_x = key.x * decay_x, key_y = key.y * decay_y;
        row_lower[hh].x += w_lower_row * key_x;
        row_lower[hh].y += w_lower_row * key_y;
        row_query_key[hh].x += w_query_key_row * key_x;
        row_query_key[hh].y += w_query_key_row * key_y;
        cols[hh].x += w_lower_col * key_x + w_query_key_col * (query.x * decay_x);
        cols[hh].y += w_lower_col * key_y + w_query_key_col * (query.y * decay_y);
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = rows[hh];
      const float2 key_i = key_hat2(i, c), query_i = query_hat2(i, c);
      acc_q[j][2 * hh] += row_query_key[hh].x;
      acc_q[j][2 * hh + 1] += row_query_key[hh].y;
      acc_k[j][2 * hh] += row_lower[hh].x + cols[hh].x;
      acc_k[j][2 * hh + 1] += row_lower[hh].y + cols[hh].y;
      add_gamma(j, hh, i, c,
                make_float2(key_i.x * (row_lower[hh].x - cols[hh].x) + query_i.x * row_query_key[hh].x,
                            key_i.y * (row_lower[hh].y - cols[hh].y) + query_i.y * row_query_key[hh].y));
    }
  }
}

// Adds the row dots of a lane's accumulator rows (g and g + 8 of its warp tile at r0: the two
// entries of `dot`) over the 4 lanes sharing them, and stores them in out[r0 + g + 8·half] (lane
// tq == 0). One writer per element: no atomics, so the result does not depend on warp order.
__device__ __forceinline__ void store_row_dots(const float (&dot)[2], int r0, float* out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float x = dot[half];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if (tq == 0) out[r0 + g + 8 * half] = x;
  }
}

}  // namespace dm::cuda::kda_detail
