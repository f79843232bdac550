// Absorbed MLA decode over a paged latent cache (SPEC §1.2 "Decode uses weight absorption", §5).
// Per sequence s and head h, with the cache row of token j = [c_j (Dv = kv_lora) | kr_j (rope)]:
//   score_hj = scale · q_h · cache_j          (q_h = [W_kvb_keysᵀ q_nope_h | q_rope_h], Dk wide)
//   out_h    = Σ_j softmax_j(score_h) · c_j   (Dv wide; the caller applies W_kvb's value rows)
// i.e. MQA: every head reads the same 576-wide keys and 512-wide values.
//
// Grid (split, heads of the CTA, sequence). A CTA holds kGroups groups of 16 heads (two when
// H > 16: decode_heads_per_cta), four warps per group, and walks the pages [split·pps,
// (split+1)·pps) of its sequence (pps = pages per split, a page = 64 tokens = one tile), page
// tiles double-buffered by cp.async through the page table and shared by the groups. Per tile:
//   S [16 heads × 64 keys] = Q·Kᵀ per group: its warp w computes keys 16w..16w+15 over the full
//     Dk (mma), writes them to shared memory;
//   every warp of the group then reads all of its S, runs the same online softmax (identical
//   statistics in the group's warps), and accumulates its own Dv/4 columns of O += P·V from the
//   same tile (ldmatrix.trans).
// Bytes: 64·Dk·2 per tile, read once for all the CTA's heads (with one group per CTA the groups
// of one split would each pull the tile from L2: twice the L2 traffic and twice the CTAs for the
// same bytes); FLOP: 2·16·64·(Dk + Dv) per tile per group.
// With one split the CTA writes out/lse directly; otherwise it writes a normalised partial O and
// its lse, and attention_decode_combine_kernel merges the splits (log-sum-exp weights).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "ops/cuda/attention_decode.cuh"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda::attention_detail {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kDecodeHeads = 16;      // heads per CTA (the mma M dimension)
constexpr int kDecodeWarps = 4;
constexpr int kCombineMaxSplits = 256;

using bf16 = __nv_bfloat16;

template <int kDk, int kDv, int kGroups>
struct DecodeConfig {
  static_assert(kDk % 16 == 0, "key dim padded to a multiple of 16");
  static_assert(kDv % (16 * kDecodeWarps) == 0 && kDv <= kDk, "value columns per warp");
  static constexpr int kHeads = kGroups * kDecodeHeads;
  static constexpr int kThreads = kGroups * kDecodeWarps * 32;
  static constexpr int kTokens = kDecodePageTokens;  // keys per tile = one page
  static constexpr int kStride = kDk + kSmemRowPad;
  static constexpr int kDvPerWarp = kDv / kDecodeWarps;
  static constexpr int kScoreStride = kTokens + 8;  // fp32; conflict-free float2 row access
  static constexpr int kQElems = kHeads * kStride;
  static constexpr int kTileElems = kTokens * kStride;
  static constexpr size_t kSmemBytes = size_t(kQElems + 2 * kTileElems) * sizeof(bf16) +
                                       size_t(kHeads * kScoreStride) * sizeof(float);
};

template <int kDk, int kDv, int kGroups>
__global__ void __launch_bounds__(kGroups * kDecodeWarps * 32, 1)
    attention_decode_kernel(const DecodeArgs a) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  using Cfg = DecodeConfig<kDk, kDv, kGroups>;
  constexpr int kThreads = Cfg::kThreads, kTokens = Cfg::kTokens, kStride = Cfg::kStride;
  constexpr int kDvPerWarp = Cfg::kDvPerWarp, kScoreStride = Cfg::kScoreStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sQ_all = reinterpret_cast<bf16*>(smem_raw);  // [kHeads][kStride]
  bf16* const sKV = sQ_all + Cfg::kQElems;                   // [2][64][kStride]
  float* const sS_all = reinterpret_cast<float*>(sKV + 2 * Cfg::kTileElems);  // [kHeads][kScoreStride]

  const int split = blockIdx.x, cta_head0 = blockIdx.y * Cfg::kHeads, seq = blockIdx.z;
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  // warp = this warp's index within its group of 16 heads.
  const int group = (threadIdx.x >> 5) / kDecodeWarps, warp = (threadIdx.x >> 5) % kDecodeWarps;
  const int head0 = cta_head0 + group * kDecodeHeads;
  bf16* const sQ = sQ_all + group * kDecodeHeads * kStride;              // [16][kStride]
  float* const sS = sS_all + group * kDecodeHeads * kScoreStride;        // [16][kScoreStride]
  const int len = a.seq_len[seq];
  // (a length beyond the page table is clamped to it rather than read out of bounds)
  const int seq_pages = min((len + kTokens - 1) / kTokens, a.max_pages);
  const int page_begin = split * a.pages_per_split;
  const int page_end = min(page_begin + a.pages_per_split, seq_pages);
  const int cta_heads = min(Cfg::kHeads, a.H - cta_head0);
  const int32_t* pages = a.page_table + int64_t(seq) * a.max_pages;

  auto load_page = [&](int page, int buf) {
    const bf16* base = a.cache + int64_t(pages[page]) * kTokens * a.Dk;
    load_rows_async<kTokens, kDk, kThreads>(sKV + buf * Cfg::kTileElems, base, a.Dk, 0,
                                            min(kTokens, len - page * kTokens), a.Dk);
  };

  float o_acc[kDvPerWarp / 8][4];
#pragma unroll
  for (int n = 0; n < kDvPerWarp / 8; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  if (page_begin < page_end) {
    load_rows_async<Cfg::kHeads, kDk, kThreads>(
        sQ_all, a.q + (int64_t(seq) * a.H + cta_head0) * a.Dk, a.Dk, 0, cta_heads, a.Dk);
    load_page(page_begin, 0);
    cp_async_commit();
  }
  const LaneOffsets lo(lane);

  for (int page = page_begin; page < page_end; ++page) {
    const int buf = (page - page_begin) & 1;
    if (page + 1 < page_end) {
      load_page(page + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* tile = sKV + buf * Cfg::kTileElems;

    // Scores of this warp's 16 keys for the 16 heads.
    float sw[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 4
    for (int kk = 0; kk < kDk / 16; ++kk) {
      uint32_t qa[4], kb[4];
      ldmatrix_x4(qa, sQ + lo.a_row * kStride + kk * 16 + lo.a_col);
      ldmatrix_x4(kb, tile + (warp * 16 + lo.b_row) * kStride + kk * 16 + lo.b_col);
      mma_bf16_16x8x16(sw[0], qa, kb[0], kb[1]);
      mma_bf16_16x8x16(sw[1], qa, kb[2], kb[3]);
    }
    const int key0 = page * kTokens;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = warp * 16 + n * 8 + 2 * tq;
        float2 v;
        v.x = key0 + col < len ? sw[n][2 * half] * a.scale_log2 : -INFINITY;
        v.y = key0 + col + 1 < len ? sw[n][2 * half + 1] * a.scale_log2 : -INFINITY;
        *reinterpret_cast<float2*>(sS + (g + 8 * half) * kScoreStride + col) = v;
      }
    }
    __syncthreads();

    // All 64 scores of rows g and g+8, then the online softmax (log2 domain; see attention.cu).
    float s[kTokens / 8][4];
#pragma unroll
    for (int n = 0; n < kTokens / 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 v =
            *reinterpret_cast<const float2*>(sS + (g + 8 * half) * kScoreStride + n * 8 + 2 * tq);
        s[n][2 * half] = v.x;
        s[n][2 * half + 1] = v.y;
      }
    }
    online_softmax_step(s, o_acc, row_max, row_sum);

    // O[:, this warp's columns] += P·V, V = the first Dv columns of the same tile.
#pragma unroll
    for (int kk = 0; kk < kTokens / 16; ++kk) {
      uint32_t pa[4];
      c_tiles_to_a_fragment(s[2 * kk], s[2 * kk + 1], pa);
#pragma unroll
      for (int dp = 0; dp < kDvPerWarp / 16; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, tile + (kk * 16 + lo.bt_row) * kStride + warp * kDvPerWarp +
                                  dp * 16 + lo.bt_col);
        mma_bf16_16x8x16(o_acc[2 * dp], pa, vf[0], vf[1]);
        mma_bf16_16x8x16(o_acc[2 * dp + 1], pa, vf[2], vf[3]);
      }
    }
    __syncthreads();  // sS and `buf` are rewritten by the next iteration
  }

  // Epilogue: normalise; an empty split (or an empty sequence) gives O = 0, lse = −inf.
  const bool direct = a.num_splits == 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(row_sum[half]);
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    const float lse = total > 0.0f ? (row_max[half] + log2f(total)) * kLn2 : -INFINITY;
    const int head = head0 + g + 8 * half;
    if (head >= a.H) continue;
    const int64_t row = direct ? int64_t(seq) * a.H + head
                               : (int64_t(seq) * a.num_splits + split) * a.H + head;
#pragma unroll
    for (int n = 0; n < kDvPerWarp / 8; ++n) {
      const int d = warp * kDvPerWarp + n * 8 + 2 * tq;
      if (d >= a.Dv) continue;
      const float x = o_acc[n][2 * half] * inverse, y = o_acc[n][2 * half + 1] * inverse;
      if (direct)
        *reinterpret_cast<__nv_bfloat162*>(a.out + row * a.Dv + d) = __floats2bfloat162_rn(x, y);
      else
        *reinterpret_cast<float2*>(a.partial_o + row * a.Dv + d) = make_float2(x, y);
    }
    if (warp == 0 && tq == 0) {
      if (direct) {
        if (a.lse) a.lse[row] = lse;
      } else {
        a.partial_lse[row] = lse;
      }
    }
  }
}

// out[s,h,:] = Σ_i w_i·O_i / Σ_i w_i with w_i = exp(lse_i − max lse). Grid (h, s, column
// block of kCombineColumns); 4 warps. The statistics are block reductions over the splits; each
// warp then sums every 4th split over the block's columns (one float4 per lane, kCombineUnroll
// splits' loads in flight) and the warps' sums meet in shared memory. (A first version walked the
// splits serially per column: 175 µs per layer at 103 splits, a fifth of a 32K decode step.)
constexpr int kCombineWarps = 4, kCombineColumns = 128, kCombineUnroll = 4;
static_assert(kCombineColumns == 32 * 4, "one float4 per lane");

__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_decode_combine_kernel(const DecodeArgs a) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ float weights[kCombineMaxSplits];
  __shared__ float reduce_scratch[32];
  __shared__ float4 warp_sums[kCombineWarps][32];
  const int h = blockIdx.x, seq = blockIdx.y, splits = a.num_splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* split_lse = a.partial_lse + int64_t(seq) * splits * a.H + h;  // stride H
  float m = -INFINITY;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) m = fmaxf(m, split_lse[int64_t(i) * a.H]);
  m = warp_max(m);
  if (lane == 0) reduce_scratch[warp] = m;
  __syncthreads();
  m = reduce_scratch[0];
  for (int w = 1; w < kCombineWarps; ++w) m = fmaxf(m, reduce_scratch[w]);
  __syncthreads();  // reduce_scratch is reused by block_sum
  float part = 0.0f;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    const float w = m == -INFINITY ? 0.0f : expf(split_lse[int64_t(i) * a.H] - m);
    weights[i] = w;
    part += w;
  }
  const float total = block_sum(part, reduce_scratch);  // its barrier also publishes weights[]
  if (threadIdx.x == 0 && blockIdx.z == 0 && a.lse)
    a.lse[int64_t(seq) * a.H + h] = total > 0.0f ? m + logf(total) : -INFINITY;

  const int d = blockIdx.z * kCombineColumns + 4 * lane;
  const bool live = d < a.Dv;  // Dv is a multiple of 8 (mla_decode_absorbed checks it)
  const int64_t split_stride = int64_t(a.H) * a.Dv;
  const float* o = a.partial_o + (int64_t(seq) * splits * a.H + h) * a.Dv + (live ? d : 0);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int i = warp;
  for (; i + (kCombineUnroll - 1) * kCombineWarps < splits; i += kCombineUnroll * kCombineWarps) {
    float4 v[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
      v[u] = *reinterpret_cast<const float4*>(o + (i + u * kCombineWarps) * split_stride);
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const float w = weights[i + u * kCombineWarps];
      acc.x = fmaf(w, v[u].x, acc.x);
      acc.y = fmaf(w, v[u].y, acc.y);
      acc.z = fmaf(w, v[u].z, acc.z);
      acc.w = fmaf(w, v[u].w, acc.w);
    }
  }
  for (; i < splits; i += kCombineWarps) {
    const float4 v = *reinterpret_cast<const float4*>(o + i * split_stride);
    const float w = weights[i];
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  warp_sums[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || !live) return;
  for (int w = 1; w < kCombineWarps; ++w) {
    const float4 v = warp_sums[w][lane];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  bf16* out = a.out + (int64_t(seq) * a.H + h) * a.Dv + d;
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(acc.x * inverse, acc.y * inverse);
  *reinterpret_cast<__nv_bfloat162*>(out + 2) =
      __floats2bfloat162_rn(acc.z * inverse, acc.w * inverse);
}

template <int kDk, int kDv, int kGroups>
void launch_decode_groups(const DecodeArgs& args, CUstream_st* stream) {
  using Cfg = DecodeConfig<kDk, kDv, kGroups>;
  static bool attribute_set = false;
  if (!attribute_set) {
    DM_CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel<kDk, kDv, kGroups>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(Cfg::kSmemBytes)));
    attribute_set = true;
  }
  const dim3 grid(unsigned(args.num_splits), unsigned(ceil_div(args.H, Cfg::kHeads)),
                  unsigned(args.S));
  launch_pdl(attention_decode_kernel<kDk, kDv, kGroups>, grid, Cfg::kThreads, Cfg::kSmemBytes,
             stream, args);
  check_last_error("attention_decode_kernel");
}

template <int kDk, int kDv>
void launch_decode_instance(const DecodeArgs& args, CUstream_st* stream) {
  static_assert(kDecodeHeads == 16, "decode_heads_per_cta assumes groups of 16 heads");
  if (decode_heads_per_cta(args.H) == 2 * kDecodeHeads)
    launch_decode_groups<kDk, kDv, 2>(args, stream);
  else
    launch_decode_groups<kDk, kDv, 1>(args, stream);
}

}  // namespace

void launch_attention_decode(const DecodeProblem& p, const uint16_t* q, const uint16_t* cache,
                             const int32_t* page_table, const int32_t* seq_len, uint16_t* out,
                             float* lse, float* partial_o, float* partial_lse,
                             CUstream_st* stream) {
  if (p.S == 0 || p.H == 0) return;
  DM_CHECK(p.num_splits >= 1 && p.num_splits <= kCombineMaxSplits && p.pages_per_split >= 1,
           "mla decode: bad plan (", p.num_splits, " splits of ", p.pages_per_split, " pages)");
  DM_CHECK(p.S <= 65535, "mla decode: at most 65535 sequences per call, got ", p.S);
  DecodeArgs a{};
  a.q = reinterpret_cast<const bf16*>(q);
  a.cache = reinterpret_cast<const bf16*>(cache);
  a.page_table = page_table;
  a.seq_len = seq_len;
  a.out = reinterpret_cast<bf16*>(out);
  a.lse = lse;
  a.partial_o = partial_o;
  a.partial_lse = partial_lse;
  a.S = p.S;
  a.H = p.H;
  a.Dk = p.Dk;
  a.Dv = p.Dv;
  a.max_pages = p.max_pages;
  a.num_splits = p.num_splits;
  a.pages_per_split = p.pages_per_split;
  a.scale_log2 = p.scale * kLog2e;
  if (launch_attention_decode_wgmma(a, stream)) {
    // the MLA shapes on warpgroup MMA (attention_decode_wgmma.cu)
  } else if (p.Dk <= 64 && p.Dv <= 64)
    launch_decode_instance<64, 64>(a, stream);
  else if (p.Dk <= 128 && p.Dv <= 128)
    launch_decode_instance<128, 128>(a, stream);
  else if (p.Dk <= kDecodeMaxDk && p.Dv <= kDecodeMaxDv)
    launch_decode_instance<kDecodeMaxDk, kDecodeMaxDv>(a, stream);
  else
    throw Error(str_cat("mla decode: key/value dims ", p.Dk, "/", p.Dv, " exceed ", kDecodeMaxDk,
                        "/", kDecodeMaxDv));
  if (p.num_splits > 1) {
    const dim3 grid(unsigned(p.H), unsigned(p.S), unsigned(ceil_div(p.Dv, kCombineColumns)));
    launch_pdl(attention_decode_combine_kernel, grid, kCombineWarps * 32, 0, stream, a);
    check_last_error("attention_decode_combine_kernel");
  }
}

}  // namespace dm::cuda::attention_detail
