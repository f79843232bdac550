// Absorbed MLA decode on Hopper's warpgroup MMA, for the MLA shapes of this model family (cache
// rows Dk = 576 = kv_lora 512 + rope 64, Dv = 512): the same problem, plan and outputs as
// attention_decode.cu's mma.sync kernel (see its header for the algebra), multiplied with the
// roles of heads and keys swapped so that a handful of heads fills the instruction:
//   Sᵀ [64 keys × NH heads] = Kpage · Qᵀ         one m64nNHk16 wgmma per 16 of the 576 dims
//   Oᵀ [512 dims × NH heads] += Vpageᵀ · Pᵀ      8 m64 tiles of dims × 4 k16 steps of keys
// (NH = 32 heads a CTA when H > 16, else 16; decode_heads_per_cta). Both products read their
// operands from shared memory by descriptor, and one page tile serves both: stored as nine
// 64-dim atoms [64 keys][128 bytes] (128-byte swizzle), it is the K-major A of Sᵀ (rows = keys,
// k = dims) and, atom for atom, the MN-major A of Oᵀ (lines = keys, MN = dims): the two layouts
// put element (key r, dim d) at the same byte (wgmma.cuh). Qᵀ lives in shared memory for the
// whole split ([NH heads][576] as nine atoms), Pᵀ is written per tile ([NH heads][64 keys] bf16).
//
// Why: the mma.sync kernel reads each page once per 16-head group and re-reads the queries per
// warp through ldmatrix; with two groups (H = 32) it issued from 8 warps at 0.47 eligible a
// scheduler and streamed the cache at 2.66 TB/s (1 × 1M, ncu: 452 µs a layer) against 3.52 TB/s
// with one group. Here the tensor cores pull the operands themselves and one warpgroup's issue
// work per page is ~70 wgmma instructions plus the softmax of 16 scores a thread: 302 µs a layer
// at 1 × 1M (4.0 TB/s, DRAM 86% busy), 590 µs at 64 × 32K (H200, bench_cuda_mla --decode-only).
//
// CTA: one warpgroup (128 threads), the split's pages double-buffered by cp.async (2 × 72 KB),
// one CTA per multiprocessor. Per page:
//   wait for its copy, barrier; Sᵀ (36 wgmmas); scale, mask keys ≥ len; each head's tile max
//   over its 64 keys (registers, then shuffles over the 8 lanes sharing the head columns, then
//   the 4 warps through shared memory); new running max, correction, P = exp2(S − max) as bf16
//   into Pᵀ, Oᵀ rescaled; barrier; Oᵀ += Vᵀ·Pᵀ (32 wgmmas); barrier (the buffers are refilled).
// The running sums stay per thread (each thread's 2 keys of each of its 8 heads) until the end,
// where they meet in a fixed order; Oᵀ is normalised, staged through the free tiles as
// [head][dim] rows and written whole: bf16 out and lse with one split, else fp32 partials and
// their lse for attention_decode_combine_kernel. Deterministic: every sum has a fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_decode.cuh"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::attention_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr float kLn2 = 0.6931471805599453f;
constexpr int kThreads = 128;                            // one warpgroup
constexpr int kKeys = kDecodePageTokens;                 // 64 keys a page tile = the wgmma M
constexpr int kDk = kDecodeMaxDk, kDv = kDecodeMaxDv;    // 576, 512
constexpr int kLineBytes = 128;                          // 64 bf16: one swizzled line
constexpr int kDkAtoms = kDk / 64, kDvTiles = kDv / 64;  // 9 dim atoms; 8 m64 tiles of Oᵀ
constexpr int kKSteps = kDk / 16;                        // 36 k16 steps of Sᵀ
constexpr int kAtomBytes = kKeys * kLineBytes;           // 8 KB: [64 keys][64 dims]
constexpr int kTileBytes = kDkAtoms * kAtomBytes;        // 72 KB a page
static_assert(kDk % 64 == 0 && kDv % 64 == 0 && kDv <= kDk, "whole 64-dim atoms");
static_assert(kKeys == 64, "one page is one m64 tile of keys");

template <int kHeads>
struct WgmmaDecodeConfig {
  static_assert(kHeads == 16 || kHeads == 32, "m64n16 / m64n32 instructions");
  static constexpr int kAcc = kHeads / 2;                  // accumulators a thread per m64 tile
  static constexpr int kQAtomBytes = kHeads * kLineBytes;  // [heads][64 dims]
  static constexpr int kQBytes = kDkAtoms * kQAtomBytes;
  static constexpr int kPBytes = kHeads * kLineBytes;  // Pᵀ [heads][64 keys] bf16
  static constexpr int kReduceBytes = 4 * kHeads * int(sizeof(float));  // [warp][head]
  static constexpr int kQOffset = 2 * kTileBytes;
  static constexpr int kPOffset = kQOffset + kQBytes;
  static constexpr int kReduceOffset = kPOffset + kPBytes;
  static constexpr int kSmemBytes = kReduceOffset + kReduceBytes + 1024;  // + 1 KB alignment
  // The epilogue's Oᵀ staging, [heads][kDv + 4] fp32 (the pad spreads a store's 32 lanes over
  // 32 banks), in the two page tiles.
  static constexpr int kStagedStride = kDv + 4;
  static_assert(kHeads * kStagedStride * int(sizeof(float)) <= 2 * kTileBytes, "staging fits");
  static_assert(kQAtomBytes % 1024 == 0 && kQOffset % 1024 == 0 && kPOffset % 1024 == 0,
                "swizzle atoms start on 1 KB");
};

template <int kHeads>
__device__ __forceinline__ void mma_heads(float (&d)[kHeads / 2], uint64_t desc_a, uint64_t desc_b,
                                          bool trans_a) {
  if constexpr (kHeads == 32) {
    if (trans_a)
      wgmma::mma_m64n32k16_bf16<1, 0>(d, desc_a, desc_b, true);
    else
      wgmma::mma_m64n32k16_bf16<0, 0>(d, desc_a, desc_b, true);
  } else {
    if (trans_a)
      wgmma::mma_m64n16k16_bf16<1, 0>(d, desc_a, desc_b, true);
    else
      wgmma::mma_m64n16k16_bf16<0, 0>(d, desc_a, desc_b, true);
  }
}

template <int kHeads>
__global__ void __launch_bounds__(kThreads, 1) attention_decode_wgmma_kernel(const DecodeArgs a) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  using Cfg = WgmmaDecodeConfig<kHeads>;
  constexpr int kAcc = Cfg::kAcc, kCols = kHeads / 8;  // a thread's head columns: kCols pairs
  extern __shared__ __align__(1024) uint8_t decode_smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(decode_smem_raw));
  uint8_t* const smem = decode_smem_raw + (((raw + 1023u) & ~1023u) - raw);
  uint8_t* const tiles = smem;               // [2][9 atoms][64][128 B]
  uint8_t* const sQ = smem + Cfg::kQOffset;  // [9 atoms][heads][128 B]
  uint8_t* const sP = smem + Cfg::kPOffset;  // [heads][128 B]
  float* const reduce = reinterpret_cast<float*>(smem + Cfg::kReduceOffset);  // [4][heads]

  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, seq = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int len = a.seq_len[seq];
  const int seq_pages = min((len + kKeys - 1) / kKeys, a.max_pages);
  const int page_begin = split * a.pages_per_split;
  const int page_end = min(page_begin + a.pages_per_split, seq_pages);
  const int cta_heads = min(kHeads, a.H - head0);
  const int32_t* pages = a.page_table + int64_t(seq) * a.max_pages;

  // A page into tile `buf`: thread t copies 16-byte chunk t % 8 of rows t / 8 + 16j (j < 4) of
  // each of the nine atoms. (t / 8 + 16j) mod 8 is the same for its four rows, so the swizzled
  // chunk, and with it every shared and global offset past the thread's base, is a constant.
  // Rows at or past the sequence's end are zero-filled (their scores are masked, and zeros keep
  // P·V free of NaN).
  const int copy_row = tid / 8, copy_chunk = tid % 8;
  const uint32_t copy_smem = uint32_t(copy_row * kLineBytes + ((copy_chunk ^ (copy_row & 7)) << 4));
  auto load_page = [&](int page, int32_t page_id, int buf) {
    const bf16* src = a.cache + int64_t(page_id) * kKeys * kDk + copy_row * kDk + copy_chunk * 8;
    const int rows = len - page * kKeys - copy_row;  // rows from this thread's first to the end
    uint8_t* dst = tiles + buf * kTileBytes + copy_smem;
#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      const bool valid = 16 * j < rows;
#pragma unroll
      for (int atom = 0; atom < kDkAtoms; ++atom)
        cp_async_16(dst + atom * kAtomBytes + j * 16 * kLineBytes,
                    valid ? src + j * 16 * kDk + atom * 64 : a.cache, valid);
    }
  };

  // Running state of this thread's head columns: column pair j (heads 8j + 2tq, 8j + 2tq + 1).
  float row_max[kCols][2], row_sum[kCols][2];
#pragma unroll
  for (int j = 0; j < kCols; ++j)
    row_max[j][0] = row_max[j][1] = -INFINITY, row_sum[j][0] = row_sum[j][1] = 0.0f;
  float o[kDvTiles][kAcc];
#pragma unroll
  for (int m = 0; m < kDvTiles; ++m)
#pragma unroll
    for (int e = 0; e < kAcc; ++e) o[m][e] = 0.0f;

  if (page_begin < page_end) {
    // The queries the same way: rows t / 8 + 16j, j < kHeads / 16.
    const bf16* q = a.q + (int64_t(seq) * a.H + head0 + copy_row) * kDk + copy_chunk * 8;
#pragma unroll
    for (int j = 0; j < kHeads / 16; ++j) {
      const bool valid = copy_row + 16 * j < cta_heads;
#pragma unroll
      for (int atom = 0; atom < kDkAtoms; ++atom)
        cp_async_16(sQ + copy_smem + atom * Cfg::kQAtomBytes + j * 16 * kLineBytes,
                    valid ? q + j * 16 * kDk + atom * 64 : a.q, valid);
    }
    load_page(page_begin, pages[page_begin], 0);
    cp_async_commit();
  }
  // The page ids one page ahead of their copies: the id's load is in flight while a page is
  // multiplied, instead of stalling the next copy's issue for a global load's latency.
  int32_t next_id = page_begin + 1 < page_end ? pages[page_begin + 1] : 0;

  // Descriptors built once; each product steps through atoms and k slices by adding offsets.
  const uint64_t desc_q = wgmma::smem_desc_sw128(sQ), desc_p = wgmma::smem_desc_sw128(sP);
  const uint64_t desc_tile0 = wgmma::smem_desc_sw128(tiles);
  const uint64_t desc_tile0_mn = wgmma::smem_desc_sw128_mn(tiles, kAtomBytes);

  for (int page = page_begin; page < page_end; ++page) {
    const int buf = (page - page_begin) & 1;
    const uint64_t desc_tile = wgmma::desc_advance(desc_tile0, buf * kTileBytes);
    const uint64_t desc_tile_mn = wgmma::desc_advance(desc_tile0_mn, buf * kTileBytes);
    if (page + 1 < page_end) {
      load_page(page + 1, next_id, buf ^ 1);
      cp_async_commit();
      if (page + 2 < page_end) next_id = pages[page + 2];
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    wgmma::fence_proxy_async();
    __syncthreads();  // the page (and the queries) visible to the tensor cores

    // Sᵀ = K·Qᵀ: s[e] is key 16·warp + g + 8·((e / 2) mod 2), head 8·(e / 4) + 2·tq + (e mod 2).
    float s[kAcc];
#pragma unroll
    for (int e = 0; e < kAcc; ++e) s[e] = 0.0f;
    wgmma::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      mma_heads<kHeads>(s, wgmma::desc_advance(desc_tile, (ks / 4) * kAtomBytes + (ks % 4) * 32),
                        wgmma::desc_advance(desc_q, (ks / 4) * Cfg::kQAtomBytes + (ks % 4) * 32),
                        false);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<0>();

    // Scale (log2 domain), mask, and each head's max over the page's 64 keys.
    const int key_lo = page * kKeys + 16 * warp + g;
    const bool live_lo = key_lo < len, live_hi = key_lo + 8 < len;
    float tile_max[kCols][2];
#pragma unroll
    for (int j = 0; j < kCols; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        float& lo = s[4 * j + b];
        float& hi = s[4 * j + 2 + b];
        lo = live_lo ? lo * a.scale_log2 : -INFINITY;
        hi = live_hi ? hi * a.scale_log2 : -INFINITY;
        float m = fmaxf(lo, hi);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        tile_max[j][b] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      }
    if (g == 0)
#pragma unroll
      for (int j = 0; j < kCols; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) reduce[warp * kHeads + 8 * j + 2 * tq + b] = tile_max[j][b];
    __syncthreads();

    // New running max, the correction of what came before, P = exp2(S − max) into Pᵀ (bf16,
    // [head][key] K-major for the second product's B).
    const int key_local = 16 * warp + g;
    float corrections[kCols][2];
    bool rescale = false;
#pragma unroll
    for (int j = 0; j < kCols; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int head = 8 * j + 2 * tq + b;
        const float m = fmaxf(fmaxf(reduce[head], reduce[kHeads + head]),
                              fmaxf(reduce[2 * kHeads + head], reduce[3 * kHeads + head]));
        const float new_max = fmaxf(row_max[j][b], m);
        // A head that has seen no live key keeps −inf; 0 then serves as the reference.
        const float reference = new_max == -INFINITY ? 0.0f : new_max;
        const float correction = fast_exp2(row_max[j][b] - reference);
        row_max[j][b] = new_max;
        const float p_lo = fast_exp2(s[4 * j + b] - reference);
        const float p_hi = fast_exp2(s[4 * j + 2 + b] - reference);
        row_sum[j][b] = row_sum[j][b] * correction + p_lo + p_hi;
        const int chunk_lo = key_local / 8, chunk_hi = chunk_lo + 1;
        uint8_t* row = sP + head * kLineBytes + (key_local % 8) * 2;
        *reinterpret_cast<bf16*>(row + ((chunk_lo ^ (head & 7)) << 4)) = __float2bfloat16_rn(p_lo);
        *reinterpret_cast<bf16*>(row + ((chunk_hi ^ (head & 7)) << 4)) = __float2bfloat16_rn(p_hi);
        corrections[j][b] = correction;
        rescale |= correction != 1.0f;
      }
    // Oᵀ rescaled, unless no head of the warp's lanes moved its max (the common case once the
    // running maxima settle: 128 multiplies a thread saved).
    if (__any_sync(0xffffffffu, rescale))
#pragma unroll
      for (int m_tile = 0; m_tile < kDvTiles; ++m_tile)
#pragma unroll
        for (int e = 0; e < kAcc; ++e) o[m_tile][e] *= corrections[e / 4][e % 2];
    wgmma::fence_proxy_async();
    __syncthreads();  // Pᵀ visible to the tensor cores

    // Oᵀ += Vᵀ·Pᵀ: m64 tile t of dims is atom t of the page read MN-major; k16 step kk = keys
    // 16kk … 16kk + 15 (16 lines further on in the atom, 32 bytes further on in Pᵀ's rows).
    wgmma::wgmma_fence();
#pragma unroll
    for (int m_tile = 0; m_tile < kDvTiles; ++m_tile)
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        mma_heads<kHeads>(
            o[m_tile],
            wgmma::desc_advance(desc_tile_mn, m_tile * kAtomBytes + kk * 16 * kLineBytes),
            wgmma::desc_advance(desc_p, kk * 32), true);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<0>();
    __syncthreads();  // the page, Pᵀ and the maxima are rewritten by the next page
  }

  // Totals: a thread's partial sums over its 8 lanes, then the 4 warps, in a fixed order.
  float inverse[kCols][2];
#pragma unroll
  for (int j = 0; j < kCols; ++j)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float l = row_sum[j][b];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) reduce[warp * kHeads + 8 * j + 2 * tq + b] = l;
    }
  __syncthreads();
  const bool direct = a.num_splits == 1;
#pragma unroll
  for (int j = 0; j < kCols; ++j)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int head = 8 * j + 2 * tq + b;
      const float total = ((reduce[head] + reduce[kHeads + head]) + reduce[2 * kHeads + head]) +
                          reduce[3 * kHeads + head];
      inverse[j][b] = total > 0.0f ? 1.0f / total : 0.0f;
      if (warp == 0 && g == 0 && head < cta_heads) {
        const float lse = total > 0.0f ? (row_max[j][b] + log2f(total)) * kLn2 : -INFINITY;
        if (direct) {
          if (a.lse) a.lse[int64_t(seq) * a.H + head0 + head] = lse;
        } else {
          a.partial_lse[(int64_t(seq) * a.num_splits + split) * a.H + head0 + head] = lse;
        }
      }
    }

  // Oᵀ normalised into [head][dim] rows (the tiles are free: the loop ended on a barrier), then
  // written row by row, 4 dims a thread.
  float* staged = reinterpret_cast<float*>(tiles);
#pragma unroll
  for (int m_tile = 0; m_tile < kDvTiles; ++m_tile)
#pragma unroll
    for (int e = 0; e < kAcc; ++e) {
      const int dim = 64 * m_tile + 16 * warp + g + 8 * ((e / 2) % 2);
      const int j = e / 4, b = e % 2, head = 8 * j + 2 * tq + b;
      staged[head * Cfg::kStagedStride + dim] = o[m_tile][e] * inverse[j][b];
    }
  __syncthreads();
  for (int i = tid; i < cta_heads * (kDv / 4); i += kThreads) {
    const int head = i / (kDv / 4), dim = 4 * (i % (kDv / 4));
    const float4 v = *reinterpret_cast<const float4*>(staged + head * Cfg::kStagedStride + dim);
    if (direct) {
      bf16* out = a.out + (int64_t(seq) * a.H + head0 + head) * kDv + dim;
      *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v.x, v.y);
      *reinterpret_cast<__nv_bfloat162*>(out + 2) = __floats2bfloat162_rn(v.z, v.w);
    } else {
      const int64_t row = (int64_t(seq) * a.num_splits + split) * a.H + head0 + head;
      *reinterpret_cast<float4*>(a.partial_o + row * kDv + dim) = v;
    }
  }
}

template <int kHeads>
void launch_wgmma_decode(const DecodeArgs& a, CUstream_st* stream) {
  using Cfg = WgmmaDecodeConfig<kHeads>;
  static bool attribute_set = false;
  if (!attribute_set) {
    DM_CUDA_CHECK(cudaFuncSetAttribute(attention_decode_wgmma_kernel<kHeads>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Cfg::kSmemBytes));
    attribute_set = true;
  }
  const dim3 grid(unsigned(a.num_splits), unsigned(ceil_div(a.H, kHeads)), unsigned(a.S));
  launch_pdl(attention_decode_wgmma_kernel<kHeads>, grid, kThreads, Cfg::kSmemBytes,
             reinterpret_cast<cudaStream_t>(stream), a);
  check_last_error("attention_decode_wgmma_kernel");
}

}  // namespace

bool launch_attention_decode_wgmma(const DecodeArgs& a, CUstream_st* stream) {
  if (!mla_decode_uses_wgmma(a.Dk, a.Dv)) return false;
  if (decode_heads_per_cta(a.H) == 32)
    launch_wgmma_decode<32>(a, stream);
  else
    launch_wgmma_decode<16>(a, stream);
  return true;
}

}  // namespace dm::cuda::attention_detail
