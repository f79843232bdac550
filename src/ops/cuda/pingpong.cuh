// The skeleton shared by the persistent "pingpong" expert products (moe_grouped_gemm_pingpong.cu,
// moe_grouped_weight_grad_pingpong.cu): one CTA per SM walks its tiles j = 0, 1, 2, … (the grid's
// tiles blockIdx.x + j·gridDim.x); warpgroup 0 is the producer, whose one lane streams every
// tile's k steps through a ring of kPingpongStages TMA stages in tile order (ring position p =
// the steps of the CTA's tiles before, + t); warpgroups 1 and 2 are consumers that take tiles
// j ≡ 0 and j ≡ 1 (mod 2), each with a whole 128 × 128 fp32 tile in registers (two m64n128
// accumulators) and its own epilogue, so one stores its tile while the other multiplies.
//
// Barriers (tma.cuh): full / empty per stage as in tma_pipeline.cuh, but a stage is consumed by
// one warpgroup, so empty counts 4 warps. A full barrier tells phases apart only by parity: a
// consumer that waited for position p before position p − kPingpongStages had been waited for
// could take that older phase's completion for p's. So the consumers' K loops take turns in tile
// order: done[c] completes one phase per tile of consumer c once its waits are all behind it, and
// consumer c waits for the other's phase of tile j − 1 before its tile j's first wait.
//
// Registers: the producer gives its warpgroup's back (setmaxnreg 40), the consumers take them
// (232): 128·40 + 256·232 ≤ 64K, the CTA's 384 threads launched at 168.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/pdl.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::pingpong {

constexpr int kStages = 4;
constexpr int kStageBytes = 32 * 1024;               // 128 × 64 bf16 of each operand
constexpr int kThreads = 384;                        // producer warpgroup, two consumer warpgroups
constexpr int kStagedBf16RowBytes = 128 * 2 + 16;    // bf16 staging rows, 16 bytes apart (banks)
constexpr int kStagedF32Ld = 128 + 8;  // fp32 staging rows (64 at a time; fragment stores in
                                       // two conflict-free wavefronts)
constexpr int kStagingBytes = 128 * kStagedBf16RowBytes;  // a consumer's epilogue buffer: 34,816
static_assert(64 * kStagedF32Ld * 4 <= kStagingBytes, "64 fp32 rows fit the staging");
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kStagingBytes;  // + 1 KB alignment

__device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
}
__device__ __forceinline__ void consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
}

struct Barriers {
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t done[2];

  // One thread, before a CTA barrier.
  __device__ __forceinline__ void init() {
    for (int s = 0; s < kStages; ++s) {
      tma::barrier_init(&full[s], 1);
      tma::barrier_init(&empty[s], 4);
    }
    tma::barrier_init(&done[0], 4);
    tma::barrier_init(&done[1], 4);
    tma::barrier_init_fence();
  }
};

// Every pingpong kernel's start: thread 0 asks for the tensor maps' descriptors and initialises
// the barriers, the CTA waits for that, then for its inputs (PDL, pdl.h: before any is read).
template <typename... Maps>
__device__ __forceinline__ void start(Barriers& barriers, const Maps*... maps) {
  if (threadIdx.x == 0) {
    (tma::prefetch_map(maps), ...);
    barriers.init();
  }
  __syncthreads();
  pdl_wait_then_launch_dependents();
}

// The shared memory of a pingpong CTA: the ring (1 KB aligned, for the swizzle atoms), then the
// two consumers' staging buffers.
struct Smem {
  uint8_t* ring;
  __device__ __forceinline__ uint8_t* staging(int consumer) const {
    return ring + kStages * kStageBytes + consumer * kStagingBytes;
  }
};
__device__ __forceinline__ Smem carve(uint8_t* raw_bytes) {
  const uint32_t raw = tma::shared_address(raw_bytes);
  return Smem{raw_bytes + (((raw + 1023u) & ~1023u) - raw)};
}

// A named barrier over one consumer warpgroup (ids 1 and 2; 0 is the CTA's).
__device__ __forceinline__ void consumer_sync(int consumer) {
  tma::named_barrier_sync(1 + consumer, 128);
}

// The producer's next ring position.
struct Cursor {
  int slot = 0, round = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kStages) slot = 0, ++round;
  }
};

// The producer thread, one step: waits until the cursor's stage is free, announces kStageBytes
// and calls issue(stage, &full[slot]), which issues loads summing to kStageBytes.
template <class Issue>
__device__ __forceinline__ void produce(Barriers& b, uint8_t* ring, Cursor& at, Issue&& issue) {
  tma::barrier_wait(&b.empty[at.slot], (at.round & 1) ^ 1);
  tma::barrier_arrive_expect_bytes(&b.full[at.slot], kStageBytes);
  issue(ring + at.slot * kStageBytes, &b.full[at.slot]);
  at.advance();
}

// Consumer `consumer`'s K loop of its tile j (every thread of the warpgroup): after the other
// consumer's tile j − 1 has been through its waits, for each of the tile's k_steps steps (ring
// positions first, first + 1, …) waits for the stage, calls landed(t, stage) (work on the landed
// tile before the MMAs, uniform over the warpgroup), then multiply(stage) between wgmma_fence and
// wgmma_commit, keeping that batch in flight while releasing the previous step's stage. On return
// every batch has completed and every stage of the tile is released.
template <class Landed, class Multiply>
__device__ __forceinline__ void consume_tile(Barriers& b, uint8_t* ring, int consumer, int64_t j,
                                             int64_t first, int k_steps, Landed&& landed,
                                             Multiply&& multiply) {
  const bool lane0 = threadIdx.x % 32 == 0;
  if (j > 0) tma::barrier_wait(&b.done[1 - consumer], uint32_t((j - 1) / 2) & 1u);
  int slot = int(first % kStages), round = int(first / kStages), previous = 0;
  for (int t = 0; t < k_steps; ++t) {
    tma::barrier_wait(&b.full[slot], round & 1);
    uint8_t* stage = ring + slot * kStageBytes;
    landed(t, stage);
    wgmma::wgmma_fence();
    multiply(stage);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<1>();  // step t − 1's batch has read its stage
    if (t > 0 && lane0) tma::barrier_arrive(&b.empty[previous]);
    previous = slot;
    if (++slot == kStages) slot = 0, ++round;
  }
  __syncwarp();
  if (lane0) tma::barrier_arrive(&b.done[consumer]);  // the other consumer may start its tile
  wgmma::wgmma_wait<0>();
  if (k_steps > 0 && lane0) tma::barrier_arrive(&b.empty[previous]);
}

__device__ __forceinline__ void zero_tile(float (&acc)[2][64]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
}

// The epilogues: acc[h][i] of consumer thread t (warp w = (t mod 128) / 32, lane l) is tile row
// 64h + 16w + l/4 + 8·((i/2) mod 2), column 8·(i/4) + 2·(l mod 4) + (i mod 2) (wgmma.cuh);
// adjacent columns go in as pairs.

// The consumer's tile as bf16 into its staging (rows kStagedBf16RowBytes apart), between two
// barriers of the consumer: the first waits until every thread of it has read the last tile's.
__device__ __forceinline__ void stage_tile_bf16(const float (&acc)[2][64], uint8_t* staging,
                                                int consumer) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  consumer_sync(consumer);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      const int r = 64 * h + 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
      const int c = 8 * (i / 4) + 2 * (lane % 4);
      *reinterpret_cast<__nv_bfloat162*>(staging + r * kStagedBf16RowBytes + c * 2) =
          __floats2bfloat162_rn(acc[h][i], acc[h][i + 1]);
    }
  consumer_sync(consumer);
}

// Staged bf16 tile rows r < rows to Y [·, N] from row0, columns n0 … (n0 + c < N, N a multiple of
// 8): thread t takes 16-byte piece t % 16 of rows t / 16 + 8i (a warp writes two whole rows).
__device__ __forceinline__ void store_staged_rows_bf16(const uint8_t* staging, __nv_bfloat16* Y,
                                                       int64_t row0, int rows, int64_t n0,
                                                       int64_t N) {
  const int wg_thread = threadIdx.x % 128, piece = wg_thread % 16;
  const int64_t col = n0 + 8 * piece;
  if (col >= N) return;
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int r = wg_thread / 16 + 8 * i;
    if (r >= rows) break;
    *reinterpret_cast<uint4*>(Y + (row0 + r) * N + col) =
        *reinterpret_cast<const uint4*>(staging + r * kStagedBf16RowBytes + piece * 16);
  }
}

// Half h of the tile (acc = acc[h], rows 64h …) as fp32 into the staging ([64][kStagedF32Ld]),
// between two barriers of the consumer, as stage_tile_bf16.
__device__ __forceinline__ void stage_half_f32(const float (&acc)[64], float* staged,
                                               int consumer) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  consumer_sync(consumer);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int r = 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
    const int c = 8 * (i / 4) + 2 * (lane % 4);
    *reinterpret_cast<float2*>(staged + r * kStagedF32Ld + c) = make_float2(acc[i], acc[i + 1]);
  }
  consumer_sync(consumer);
}

}  // namespace dm::cuda::pingpong
