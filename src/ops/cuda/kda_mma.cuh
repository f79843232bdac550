// Warp-level mma.sync building blocks of the chunked KDA kernels (kda_chunk_backward_tc.cu,
// kda_chunk_state_tf32.cu): tf32 m16n8k8 and bf16 m16n8k16 products whose operands are read
// element by element through loader lambdas (shared or global memory, any layout), fp32
// accumulation. Included only by nvcc-compiled files.
//
// Accumulator layout (both shapes, PTX ISA; lane = 4g + tq): c[0..1] = (row g, columns 2tq,
// 2tq+1), c[2..3] = (row g+8, same columns).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dm::cuda::kda_detail {

enum class MmaPrecision { Bf16, Tf32 };

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// d += a·b, one 16×8 tile: tf32 m16n8k8. Fragments (PTX ISA, g = lane/4, tq = lane%4):
//   a0 = (row g, k tq), a1 = (row g+8, k tq), a2 = (row g, k tq+4), a3 = (row g+8, k tq+4);
//   b0 = (k tq, col g), b1 = (k tq+4, col g); c as for m16n8k16 (attention_mma.cuh).
__device__ __forceinline__ void mma_tf32_16x8x8(float (&d)[4], const uint32_t (&a)[4],
                                                uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// bf16 m16n8k16 (layouts in attention_mma.cuh).
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint32_t (&a)[4],
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 8-wide k-step of a tf32 warp product at k0: acc[j] += A[:, k0..k0+8) · B_j[k0..k0+8, :]
// for the tiles j < n_tiles (warp_mma's operand conventions below).
template <int kTiles, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma_tf32_step(float (&acc)[kTiles][4], int n_tiles, int k0,
                                                   LoadA& load_a, LoadB& load_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const uint32_t a[4] = {to_tf32(load_a(g, k0 + tq)), to_tf32(load_a(g + 8, k0 + tq)),
                         to_tf32(load_a(g, k0 + tq + 4)), to_tf32(load_a(g + 8, k0 + tq + 4))};
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
    if (j < n_tiles)
      mma_tf32_16x8x8(acc[j], a, to_tf32(load_b(k0 + tq, 8 * j + g)),
                      to_tf32(load_b(k0 + tq + 4, 8 * j + g)));
}

// acc[j] += A·B_j for one warp: A = 16 rows × [k_begin, k_end), B_j = the k range × 8 columns
// of tile j (j < n_tiles ≤ kTiles). load_a(r, k): r ∈ [0,16) local row, k absolute;
// load_b(k, n): k absolute, n ∈ [0, 8·n_tiles) local column. k_end − k_begin is a multiple of
// 16. Accumulator element acc[j][2h + e] is (row g + 8h, column 8j + 2tq + e).
template <MmaPrecision kPrecision, int kTiles, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma(float (&acc)[kTiles][4], int n_tiles, int k_begin,
                                         int k_end, LoadA&& load_a, LoadB&& load_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  if constexpr (kPrecision == MmaPrecision::Tf32) {
    for (int k0 = k_begin; k0 < k_end; k0 += 8)
      warp_mma_tf32_step(acc, n_tiles, k0, load_a, load_b);
  } else {
    for (int k0 = k_begin; k0 < k_end; k0 += 16) {
      const int k = k0 + 2 * tq;
      const uint32_t a[4] = {pack_bf16(load_a(g, k), load_a(g, k + 1)),
                             pack_bf16(load_a(g + 8, k), load_a(g + 8, k + 1)),
                             pack_bf16(load_a(g, k + 8), load_a(g, k + 9)),
                             pack_bf16(load_a(g + 8, k + 8), load_a(g + 8, k + 9))};
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
        if (j < n_tiles)
          mma_bf16_16x8x16(acc[j], a, pack_bf16(load_b(k, 8 * j + g), load_b(k + 1, 8 * j + g)),
                           pack_bf16(load_b(k + 8, 8 * j + g), load_b(k + 9, 8 * j + g)));
    }
  }
}

// The lane's tf32 A fragment of the 8-wide k-step at k0 through load_a(r, k) (r local row), as
// the two-product helpers below take it.
struct Tf32Fragment {
  uint32_t v[4];
};
template <typename LoadA>
__device__ __forceinline__ Tf32Fragment tf32_a_fragment(LoadA& load_a, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  return {{to_tf32(load_a(g, k0 + tq)), to_tf32(load_a(g + 8, k0 + tq)),
           to_tf32(load_a(g, k0 + tq + 4)), to_tf32(load_a(g + 8, k0 + tq + 4))}};
}

// warp_mma (tf32) of two left operands against one right operand: first[j] += A1·B_j and
// second[j] += A2·B_j, each B element loaded (and converted) once for both products.
template <int kTiles, typename LoadA1, typename LoadA2, typename LoadB>
__device__ __forceinline__ void warp_mma_tf32_shared_b(float (&first)[kTiles][4],
                                                       float (&second)[kTiles][4], int n_tiles,
                                                       int k_begin, int k_end, LoadA1&& load_a1,
                                                       LoadA2&& load_a2, LoadB&& load_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  for (int k0 = k_begin; k0 < k_end; k0 += 8) {
    const Tf32Fragment a1 = tf32_a_fragment(load_a1, k0), a2 = tf32_a_fragment(load_a2, k0);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      if (j < n_tiles) {
        const uint32_t b0 = to_tf32(load_b(k0 + tq, 8 * j + g)),
                       b1 = to_tf32(load_b(k0 + tq + 4, 8 * j + g));
        mma_tf32_16x8x8(first[j], a1.v, b0, b1);
        mma_tf32_16x8x8(second[j], a2.v, b0, b1);
      }
  }
}

// acc[j] += A1·B1_j + A2·B2_j (tf32) with both right operands from one loader call:
// load_b_both(k, n) = (B1[k][n], B2[k][n]), for operands that share work (a decay factor).
// The two products' k-steps interleave into the one accumulator.
template <int kTiles, typename LoadA1, typename LoadA2, typename LoadBBoth>
__device__ __forceinline__ void warp_mma_tf32_sum_of_two(float (&acc)[kTiles][4], int n_tiles,
                                                         int k_begin, int k_end, LoadA1&& load_a1,
                                                         LoadA2&& load_a2,
                                                         LoadBBoth&& load_b_both) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  for (int k0 = k_begin; k0 < k_end; k0 += 8) {
    const Tf32Fragment a1 = tf32_a_fragment(load_a1, k0), a2 = tf32_a_fragment(load_a2, k0);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      if (j < n_tiles) {
        const float2 b0 = load_b_both(k0 + tq, 8 * j + g), b1 = load_b_both(k0 + tq + 4, 8 * j + g);
        mma_tf32_16x8x8(acc[j], a1.v, to_tf32(b0.x), to_tf32(b1.x));
        mma_tf32_16x8x8(acc[j], a2.v, to_tf32(b0.y), to_tf32(b1.y));
      }
  }
}

// Runs step(into, k0) over the 8-wide k-steps k0 of [k_begin, k_end) ((k_end − k_begin) % 16
// == 0), alternating `into` between acc and a second accumulator that is added to acc at the
// end, with the loop unrolled.
template <int kTiles, typename Step>
__device__ __forceinline__ void two_accumulator_chains(float (&acc)[kTiles][4], int k_begin,
                                                       int k_end, Step&& step) {
  float other[kTiles][4];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) other[j][0] = other[j][1] = other[j][2] = other[j][3] = 0.0f;
#pragma unroll 4
  for (int k0 = k_begin; k0 < k_end; k0 += 16) {
    step(acc, k0);
    step(other, k0 + 8);
  }
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] += other[j][e];
}

// warp_mma (tf32) with the 8-wide k-steps alternating between two accumulators, summed at the
// end, and the loop unrolled: consecutive mma no longer wait on each other, and later steps'
// fragment loads can issue early. A 16-step product becomes two interleaved chains of 8. For
// the sequential KDA state kernels, whose step time is these products' latency (clock64 probes
// of the forward state kernel: its 16-step phase 1 took 1.44K cycles a step, ~90 per k-step).
// (k_end − k_begin) % 16 == 0.
template <int kTiles, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma_tf32_two_chains(float (&acc)[kTiles][4], int n_tiles,
                                                         int k_begin, int k_end, LoadA&& load_a,
                                                         LoadB&& load_b) {
  two_accumulator_chains(acc, k_begin, k_end, [&](float(&into)[kTiles][4], int k0) {
    warp_mma_tf32_step(into, n_tiles, k0, load_a, load_b);
  });
}

// warp_mma with each operand fetched as two k-adjacent values: load_a2(r, k) = (A[r][k],
// A[r][k+1]) and load_b2(k, n) = (B[k][n], B[k+1][n]), k even. For tf32 the k slots of every
// 8-step are permuted the same way in A and B (slot tq ↔ k0 + 2tq, slot tq + 4 ↔ k0 + 2tq + 1),
// which leaves the product unchanged; bf16 fragments hold adjacent pairs already. Where an
// operand is stored k-contiguous the pair is one 8-byte load instead of two.
template <MmaPrecision kPrecision, int kTiles, typename LoadA2, typename LoadB2>
__device__ __forceinline__ void warp_mma_pairs(float (&acc)[kTiles][4], int n_tiles, int k_begin,
                                               int k_end, LoadA2&& load_a2, LoadB2&& load_b2) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  if constexpr (kPrecision == MmaPrecision::Tf32) {
    for (int k0 = k_begin; k0 < k_end; k0 += 8) {
      const int k = k0 + 2 * tq;
      const float2 top = load_a2(g, k), bottom = load_a2(g + 8, k);
      const uint32_t a[4] = {to_tf32(top.x), to_tf32(bottom.x), to_tf32(top.y), to_tf32(bottom.y)};
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
        if (j < n_tiles) {
          const float2 b = load_b2(k, 8 * j + g);
          mma_tf32_16x8x8(acc[j], a, to_tf32(b.x), to_tf32(b.y));
        }
    }
  } else {
    for (int k0 = k_begin; k0 < k_end; k0 += 16) {
      const int k = k0 + 2 * tq;
      const float2 a0 = load_a2(g, k), a1 = load_a2(g + 8, k), a2 = load_a2(g, k + 8),
                   a3 = load_a2(g + 8, k + 8);
      const uint32_t a[4] = {pack_bf16(a0.x, a0.y), pack_bf16(a1.x, a1.y), pack_bf16(a2.x, a2.y),
                             pack_bf16(a3.x, a3.y)};
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
        if (j < n_tiles) {
          const float2 b0 = load_b2(k, 8 * j + g), b1 = load_b2(k + 8, 8 * j + g);
          mma_bf16_16x8x16(acc[j], a, pack_bf16(b0.x, b0.y), pack_bf16(b1.x, b1.y));
        }
    }
  }
}

// Two adjacent floats (index even, 8-byte aligned base): one 8-byte load.
__device__ __forceinline__ float2 load_pair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

template <int kTiles>
__device__ __forceinline__ void zero_tiles(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
}

// Calls f(j, e4, row, col) for this lane's accumulator elements of tiles j < n_tiles, with the
// tile origin (row0, col0): row = row0 + g + 8·(e4/2), col = col0 + 8j + 2tq + e4%2.
template <int kTiles, typename F>
__device__ __forceinline__ void for_each_element(int n_tiles, int row0, int col0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
    if (j < n_tiles)
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) f(j, e4, row0 + g + 8 * (e4 >> 1), col0 + 8 * j + 2 * tq + (e4 & 1));
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(uint32_t(bits) << 16);
}

}  // namespace dm::cuda::kda_detail
