// The backward's grouped row products as a persistent pingpong kernel (moe_kernels.h
// launch_grouped_rows_backward_pingpong; the skeleton is pingpong.cuh's), with the contracts and
// output bits of the TMA-fed wgmma backward kernel (moe_grouped_gemm_wgmma_backward.cu):
//   dx  Y [R, N] fp32 = A1[r, :]·B1_e + A2[r, :]·B2_e   (dg·W_gate_e + du·W_up_e)
//   dh  Y [R, N] bf16 = A1[r, :]·B1_e                    (dout·W_down_e), optionally followed by
//       the GLU backward at the kept g, u: Y = dg, u overwritten by du,
// for r in expert e's rows, B_e [K, N] n-contiguous (read MN-major through 3-D tensor maps, so k
// past K reads zeros, never the next expert's matrix).
//
// Why: the same as the forward's (moe_grouped_gemm_pingpong.cu): short K loops (8 or 16 steps a
// product) whose fill and epilogue left the tensor cores idle; here the dx tile's 64 KB of fp32
// and the dh tile's GLU backward (g and u read, dg and du written) run under the other
// consumer's MMAs.
//
// Measured on an H200 (bench_cuda_moe_gemm, 24576 rows over 32 experts, Din 512, F 1024; µs,
// TMA-fed → this kernel): dx 120.4 → 111.2, dh 65.6 → 64.7. With the GLU backward in the
// epilogue it took 162.3 µs against 129.3 for dh and the separate GLU pass (138.8 for the wgmma
// kernel's fused epilogue): its g and u loads outlast the other consumer's K loop, so the layers
// do not use it (moe.h).
//
// Rows past the expert's end are loaded but never stored; columns past N read zeros. The k
// steps (the first product's, then the second's) and k16 slices accumulate in the TMA-fed
// kernel's order: the same bits.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/pingpong.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::moe_detail {
namespace {

constexpr int kTile = 128, kStepK = 64;
constexpr int kLineBytes = 128;                  // one swizzled line: 64 bf16
constexpr int kABytes = kTile * kLineBytes;      // 16 KB: 128 K-major rows
constexpr int kAtomBytes = kStepK * kLineBytes;  // 8 KB: one 64-wide MN atom, 64 k deep
constexpr int kStagedRowBytes = pingpong::kStagedBf16RowBytes;
constexpr int kStagedLd = pingpong::kStagedF32Ld;
static_assert(kABytes + 2 * kAtomBytes == pingpong::kStageBytes, "A rows and B atoms fill a stage");
static_assert(kTile * kStagedRowBytes <= pingpong::kStagingBytes, "the bf16 tile fits");

struct RowsBackwardArgs {
  const int64_t* offsets;  // DEVICE [E + 1]
  int E;
  int64_t K, N;
  int nx;                         // column tiles
  int64_t tiles;                  // row-tile bound × nx
  int products;                   // 1 or 2
  void* Y;                        // fp32 (kF32) or bf16 [R, N]
  const __nv_bfloat16* glu_gate;  // bf16 with the GLU backward: g [R, N]; nullptr: Y = product
  __nv_bfloat16* glu_up;          // u [R, N], overwritten by du
  GluKernelParams glu;
};

template <bool kF32>
__global__ void __launch_bounds__(pingpong::kThreads, 1)
    grouped_rows_backward_pingpong_kernel(const __grid_constant__ CUtensorMap a1_map,
                                          const __grid_constant__ CUtensorMap b1_map,
                                          const __grid_constant__ CUtensorMap a2_map,
                                          const __grid_constant__ CUtensorMap b2_map,
                                          const RowsBackwardArgs p) {
  __shared__ pingpong::Barriers barriers;
  extern __shared__ __align__(1024) uint8_t rows_backward_smem_raw[];
  const pingpong::Smem smem = pingpong::carve(rows_backward_smem_raw);
  const int warpgroup = threadIdx.x / 128;
  pingpong::start(barriers, &a1_map, &b1_map);
  const int per_product = int((p.K + kStepK - 1) / kStepK), k_steps = per_product * p.products;

  if (warpgroup == 0) {  // the producer: warp 0 walks the tiles, its lane 0 issues
    pingpong::producer_registers();
    if (threadIdx.x >= 32) return;
    pingpong::Cursor at;
    for_each_cta_row_tile(
        p.offsets, p.E, p.nx, p.tiles, 0, 1,
        [&](int64_t, const GroupedRowTile& tile, int64_t column_tile) {
          const int32_t n0 = int32_t(column_tile * kTile), row0 = int32_t(tile.row0);
          if (threadIdx.x == 0)
            for (int t = 0; t < k_steps; ++t) {
              const bool second = t >= per_product;
              const int32_t k0 = (second ? t - per_product : t) * kStepK;
              const CUtensorMap* a_map = second ? &a2_map : &a1_map;
              const CUtensorMap* b_map = second ? &b2_map : &b1_map;
              pingpong::produce(barriers, smem.ring, at, [&](uint8_t* stage, uint64_t* full) {
                tma::load_2d(stage, a_map, full, k0, row0);
                tma::load_3d(stage + kABytes, b_map, full, n0, k0, tile.expert);
                tma::load_3d(stage + kABytes + kAtomBytes, b_map, full, n0 + 64, k0, tile.expert);
              });
            }
          __syncwarp();
        });
    return;
  }

  pingpong::consumer_registers();
  const int consumer = warpgroup - 1;  // takes the CTA's tiles j ≡ consumer (mod 2)
  const int wg_thread = threadIdx.x % 128, warp = wg_thread / 32, lane = threadIdx.x % 32;
  uint8_t* staging = smem.staging(consumer);
  for_each_cta_row_tile(
      p.offsets, p.E, p.nx, p.tiles, consumer, 2,
      [&](int64_t j, const GroupedRowTile& tile, int64_t column_tile) {
        const int64_t n0 = column_tile * kTile;
        float acc[2][64];
        pingpong::zero_tile(acc);
        pingpong::consume_tile(
            barriers, smem.ring, consumer, j, j * k_steps, k_steps, [](int, uint8_t*) {},
            [&](const uint8_t* stage) {
#pragma unroll
              for (int kk = 0; kk < kStepK / 16; ++kk) {
                const uint64_t desc_b =
                    wgmma::smem_desc_sw128_mn(stage + kABytes + kk * 16 * kLineBytes, kAtomBytes);
#pragma unroll
                for (int h = 0; h < 2; ++h)  // rows 64h …: K-major lines 64h …, 8 KB further
                  wgmma::mma_m64n128k16_bf16<0, 1>(
                      acc[h], wgmma::smem_desc_sw128(stage + h * 64 * kLineBytes + kk * 32), desc_b,
                      true);
              }
            });

        if constexpr (kF32) {
          // 64 rows at a time: fragments in as float2, then warp w writes rows w + 4q, 16 bytes a
          // lane.
          float* staged = reinterpret_cast<float*>(staging);
          float* Y = static_cast<float*>(p.Y);
          const int64_t col = n0 + 4 * lane;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            pingpong::stage_half_f32(acc[h], staged, consumer);
            if (col < p.N) {
#pragma unroll 4
              for (int q = 0; q < 16; ++q) {
                const int r = warp + 4 * q;
                if (64 * h + r >= tile.rows) break;
                *reinterpret_cast<float4*>(Y + (tile.row0 + 64 * h + r) * p.N + col) =
                    *reinterpret_cast<const float4*>(staged + r * kStagedLd + 4 * lane);
              }
            }
          }
        } else {
          pingpong::stage_tile_bf16(acc, staging, consumer);
          // 16 pieces of 8 columns a row: thread t takes piece t % 16 of rows t / 16 + 8i.
          __nv_bfloat16* Y = static_cast<__nv_bfloat16*>(p.Y);
          const int piece = wg_thread % 16;
          const int64_t col = n0 + 8 * piece;
          if (col < p.N) {
            if (p.glu_gate != nullptr) {
              // The bf16 dh piece with g and u of the same 8 elements: dg over Y, du over u. Four
              // rows' g and u loads in flight before their stores (which may alias them as far as
              // the compiler knows).
              const GluInverseBetas inv = glu_inverse_betas(p.glu);
#pragma unroll 1
              for (int i0 = 0; i0 < kTile / 8; i0 += 4) {
                uint4 g[4], u[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const int r = wg_thread / 16 + 8 * (i0 + i);
                  if (r < tile.rows) {
                    const int64_t at = (tile.row0 + r) * p.N + col;
                    g[i] = *reinterpret_cast<const uint4*>(p.glu_gate + at);
                    u[i] = *reinterpret_cast<const uint4*>(p.glu_up + at);
                  }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const int r = wg_thread / 16 + 8 * (i0 + i);
                  if (r >= tile.rows) break;
                  const int64_t at = (tile.row0 + r) * p.N + col;
                  const uint4 dh =
                      *reinterpret_cast<const uint4*>(staging + r * kStagedRowBytes + piece * 16);
                  uint4 dg, du;
                  glu_backward_bf16x8(g[i], u[i], dh, p.glu, inv, dg, du);
                  *reinterpret_cast<uint4*>(Y + at) = dg;
                  *reinterpret_cast<uint4*>(p.glu_up + at) = du;
                }
              }
            } else {
              pingpong::store_staged_rows_bf16(staging, Y, tile.row0, tile.rows, n0, p.N);
            }
          }
        }
      });
}

}  // namespace

bool grouped_rows_backward_pingpong_applies(const void* A1, const void* B1, const void* A2,
                                            const void* B2, int64_t R, int64_t K, int64_t N,
                                            const void* Y) {
  auto ok = [](const void* p, int64_t stride) {
    return p == nullptr || tma_map_bf16_applies(p, uint64_t(stride));
  };
  return R > 0 && R < (int64_t(1) << 31) && A1 != nullptr && B1 != nullptr && ok(A1, K) &&
         ok(B1, N) && ok(A2, K) && ok(B2, N) && (A2 == nullptr) == (B2 == nullptr) && N % 8 == 0 &&
         reinterpret_cast<uintptr_t>(Y) % 16 == 0;
}

void launch_grouped_rows_backward_pingpong(const uint16_t* A1, const uint16_t* B1,
                                           const uint16_t* A2, const uint16_t* B2,
                                           const int64_t* offsets, int E, int64_t R, int64_t K,
                                           int64_t N, void* Y, bool y_f32, const uint16_t* gate,
                                           uint16_t* up, const GluKernelParams* glu,
                                           CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  DM_CHECK(grouped_rows_backward_pingpong_applies(A1, B1, A2, B2, R, K, N, Y),
           "launch_grouped_rows_backward_pingpong: K = ", K, ", N = ", N, ", R = ", R,
           " (K, N multiples of 8, 16-byte aligned operands and output, R < 2^31)");
  DM_CHECK(gate == nullptr || (!y_f32 && A2 == nullptr && up != nullptr && glu != nullptr &&
                               reinterpret_cast<uintptr_t>(gate) % 16 == 0 &&
                               reinterpret_cast<uintptr_t>(up) % 16 == 0),
           "launch_grouped_rows_backward_pingpong: the GLU epilogue takes one product, bf16 out, "
           "16-byte aligned g and u");
  const uint64_t e = uint64_t(E), k = uint64_t(K), n = uint64_t(N);
  const CUtensorMap a1_map = tma_map_bf16_rows(A1, uint64_t(R), k, k, kTile, kStepK);
  const CUtensorMap b1_map = tma_map_bf16_batched(B1, e, k, n, kStepK, kStepK);
  const bool two = A2 != nullptr;
  const CUtensorMap a2_map = two ? tma_map_bf16_rows(A2, uint64_t(R), k, k, kTile, kStepK) : a1_map;
  const CUtensorMap b2_map = two ? tma_map_bf16_batched(B2, e, k, n, kStepK, kStepK) : b1_map;
  RowsBackwardArgs p{};
  p.offsets = offsets;
  p.E = E;
  p.K = K;
  p.N = N;
  p.nx = int((N + kTile - 1) / kTile);
  p.tiles = int64_t(grouped_rows_grid(R, E, N).y) * p.nx;
  p.products = two ? 2 : 1;
  p.Y = Y;
  p.glu_gate = reinterpret_cast<const __nv_bfloat16*>(gate);
  p.glu_up = reinterpret_cast<__nv_bfloat16*>(up);
  if (glu != nullptr) p.glu = *glu;
  const int64_t ctas = std::min<int64_t>(p.tiles, device_multiprocessors());
  auto kernel = y_f32 ? grouped_rows_backward_pingpong_kernel<true>
                      : grouped_rows_backward_pingpong_kernel<false>;
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     pingpong::kSmemBytes));
  launch_pdl(kernel, dim3(unsigned(ctas)), pingpong::kThreads, pingpong::kSmemBytes,
             reinterpret_cast<cudaStream_t>(stream), a1_map, b1_map, a2_map, b2_map, p);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::moe_detail
