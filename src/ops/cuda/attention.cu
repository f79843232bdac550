// Causal attention forward on the GPU (SPEC §1.2, expanded MLA form for prefill/training):
// a FlashAttention-2 style tiled kernel on bf16 tensor cores, and a plain one-warp-per-row kernel
// that serves as the GPU reference (and, on fp32 operands, as the fp32 GPU mode's attention).
// Layouts as ops/cpu/attention.h: q, k [B,T,H,Dqk], v, o [B,T,H,Dv] (bf16; fp32 for the simple
// kernel's fp32 instantiation), lse [B,H,T] (fp32, natural log).
//
// Tiled kernel, one CTA = one (batch, head, block of kBlockM = 16·kWarps query rows):
//   registers: each warp owns 16 query rows: its Q fragments (Dqk/16 × 4 regs), the O
//              accumulator 16 × Dv in fp32 C fragments, the running row max / sum;
//   shared:    Q tile [kBlockM, Dqk] (read once into registers), K and V tiles
//              [kBlockN = 64, D] in two buffers: cp.async fetches block j+1 while block j runs.
//   per key block: S = Q·Kᵀ (mma), scale and mask (causal + documents) only on tiles that need
//   it, online softmax in the log2 domain (fp32), P → bf16 A fragments in registers (no smem
//   round trip), O += P·V (mma, V fragments by ldmatrix.trans).
// Work per CTA: 2·kBlockM·keys·(Dqk + Dv) FLOP over (keys·(Dqk + Dv) + kBlockM·(Dqk + Dv))·2
// bytes of global traffic; query blocks are launched heaviest (last) first.
// Key blocks entirely before the smallest document start of the query block are skipped.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"

namespace dm::cuda::attention_detail {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using bf16 = __nv_bfloat16;

struct ForwardArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* o;
  float* lse;
  const int32_t* doc_start;
  int B, T, H, Dqk, Dv;
  float scale_log2;  // softmax scale · log2(e)
};

template <int kDqk, int kDv, int kWarps>
struct ForwardTiledConfig {
  static_assert(kDqk % 16 == 0 && kDv % 16 == 0, "head dims are padded to multiples of 16");
  static_assert(kDv <= kDqk, "the output tile is staged in the Q tile's shared memory");
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;  // query rows per CTA
  static constexpr int kBlockN = 64;           // keys per pipeline stage
  static constexpr int kQkStride = kDqk + kSmemRowPad;
  static constexpr int kVStride = kDv + kSmemRowPad;
  static constexpr int kQElems = kBlockM * kQkStride;
  static constexpr int kKElems = kBlockN * kQkStride;
  static constexpr int kVElems = kBlockN * kVStride;
  static constexpr size_t kSmemBytes = size_t(kQElems + 2 * kKElems + 2 * kVElems) * sizeof(bf16);
};

template <int kDqk, int kDv, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    attention_forward_tiled_kernel(const ForwardArgs a) {
  using Cfg = ForwardTiledConfig<kDqk, kDv, kWarps>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kQkStride = Cfg::kQkStride, kVStride = Cfg::kVStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sQ = reinterpret_cast<bf16*>(smem_raw);  // [kBlockM][kQkStride]
  bf16* const sK = sQ + Cfg::kQElems;                   // [2][kBlockN][kQkStride]
  bf16* const sV = sK + 2 * Cfg::kKElems;               // [2][kBlockN][kVStride]
  __shared__ int block_min_doc, block_max_doc;

  const int T = a.T, H = a.H;
  const int num_query_blocks = (T + kBlockM - 1) / kBlockM;
  const int batch_heads = a.B * H;
  const int query_block = num_query_blocks - 1 - int(blockIdx.x / batch_heads);
  const int batch_head = int(blockIdx.x % batch_heads);
  const int b = batch_head / H, h = batch_head % H;
  const int query_start = query_block * kBlockM;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;

  const int64_t qk_row_stride = int64_t(H) * a.Dqk, v_row_stride = int64_t(H) * a.Dv;
  const bf16* q_base = a.q + (int64_t(b) * T * H + h) * a.Dqk;  // token 0 of (b, h)
  const bf16* k_base = a.k + (int64_t(b) * T * H + h) * a.Dqk;
  const bf16* v_base = a.v + (int64_t(b) * T * H + h) * a.Dv;
  const int32_t* doc = a.doc_start ? a.doc_start + int64_t(b) * T : nullptr;

  // Smallest / largest document start among the block's rows: skip key blocks before the first,
  // and tiles at or after the last (and below the diagonal) need no mask.
  if (threadIdx.x == 0) {
    block_min_doc = INT_MAX;
    block_max_doc = 0;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
    const int t = query_start + r;
    if (t < T) {
      const int d = doc ? doc[t] : 0;
      atomicMin(&block_min_doc, d);
      atomicMax(&block_max_doc, d);
    }
  }
  __syncthreads();
  const int min_doc = block_min_doc, max_doc = block_max_doc;
  const int first_key_block = min_doc / kBlockN;
  const int last_key_block = (min(query_start + kBlockM, T) - 1) / kBlockN;

  // This thread's two query rows (C-fragment rows g and g+8 of its warp).
  const int t_lo = query_start + warp * 16 + g, t_hi = t_lo + 8;
  const int doc_lo = (doc && t_lo < T) ? doc[t_lo] : 0;
  const int doc_hi = (doc && t_hi < T) ? doc[t_hi] : 0;

  load_rows_async<kBlockM, kDqk, kThreads>(sQ, q_base, qk_row_stride, query_start, T, a.Dqk);
  load_rows_async<kBlockN, kDqk, kThreads>(sK, k_base, qk_row_stride, first_key_block * kBlockN,
                                           T, a.Dqk);
  load_rows_async<kBlockN, kDv, kThreads>(sV, v_base, v_row_stride, first_key_block * kBlockN, T,
                                          a.Dv);
  cp_async_commit();

  const LaneOffsets lo(lane);
  uint32_t q_frag[kDqk / 16][4];
  float o_acc[kDv / 8][4];
#pragma unroll
  for (int n = 0; n < kDv / 8; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  for (int key_block = first_key_block; key_block <= last_key_block; ++key_block) {
    const int buf = (key_block - first_key_block) & 1;
    if (key_block < last_key_block) {
      const int next_start = (key_block + 1) * kBlockN;
      load_rows_async<kBlockN, kDqk, kThreads>(sK + (buf ^ 1) * Cfg::kKElems, k_base,
                                               qk_row_stride, next_start, T, a.Dqk);
      load_rows_async<kBlockN, kDv, kThreads>(sV + (buf ^ 1) * Cfg::kVElems, v_base,
                                              v_row_stride, next_start, T, a.Dv);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (key_block == first_key_block) {
#pragma unroll
      for (int kk = 0; kk < kDqk / 16; ++kk)
        ldmatrix_x4(q_frag[kk], sQ + (warp * 16 + lo.a_row) * kQkStride + kk * 16 + lo.a_col);
    }
    const bf16* k_tile = sK + buf * Cfg::kKElems;
    const bf16* v_tile = sV + buf * Cfg::kVElems;

    // S = Q·Kᵀ for this warp's 16 rows × 64 keys.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t kf[4];
        ldmatrix_x4(kf, k_tile + (np * 16 + lo.b_row) * kQkStride + kk * 16 + lo.b_col);
        mma_bf16_16x8x16(s[2 * np], q_frag[kk], kf[0], kf[1]);
        mma_bf16_16x8x16(s[2 * np + 1], q_frag[kk], kf[2], kf[3]);
      }
    }

    // Mask only tiles not wholly below the diagonal and at/after every row's document start.
    const int key_start = key_block * kBlockN;
    const bool needs_mask = !(key_start + kBlockN - 1 <= query_start && key_start >= max_doc);
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e] * a.scale_log2;
        if (needs_mask) {
          const int key = key_start + n * 8 + 2 * tq + (e & 1);
          const int t = e < 2 ? t_lo : t_hi;
          const int d = e < 2 ? doc_lo : doc_hi;
          if (key > t || key < d) x = -INFINITY;
        }
        s[n][e] = x;
      }
    }

    online_softmax_step(s, o_acc, row_max, row_sum);

    // O += P·V with P straight from the S registers.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t pa[4];
      c_tiles_to_a_fragment(s[2 * kk], s[2 * kk + 1], pa);
#pragma unroll
      for (int dp = 0; dp < kDv / 16; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, v_tile + (kk * 16 + lo.bt_row) * kVStride + dp * 16 + lo.bt_col);
        mma_bf16_16x8x16(o_acc[2 * dp], pa, vf[0], vf[1]);
        mma_bf16_16x8x16(o_acc[2 * dp + 1], pa, vf[2], vf[3]);
      }
    }
    __syncthreads();  // every warp is done with `buf` before iteration +1 refills it
  }

  // Epilogue: normalise, stage O in the (now unused) Q tile, write 16-byte chunks.
  bf16* const sO = sQ;  // [kBlockM][kVStride]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(row_sum[half]);
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    const int row = warp * 16 + g + 8 * half;
#pragma unroll
    for (int n = 0; n < kDv / 8; ++n)
      *reinterpret_cast<__nv_bfloat162*>(sO + row * kVStride + n * 8 + 2 * tq) =
          __floats2bfloat162_rn(o_acc[n][2 * half] * inverse, o_acc[n][2 * half + 1] * inverse);
    const int t = query_start + row;
    if (a.lse && tq == 0 && t < T)
      a.lse[(int64_t(b) * H + h) * T + t] =
          total > 0.0f ? (row_max[half] + log2f(total)) * kLn2 : -INFINITY;
  }
  __syncthreads();
  bf16* o_base = a.o + (int64_t(b) * T * H + h) * a.Dv;
  constexpr int kChunksPerRow = kDv / 8;
  for (int chunk = threadIdx.x; chunk < kBlockM * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, d = (chunk % kChunksPerRow) * 8;
    const int t = query_start + r;
    if (t < T && d < a.Dv)
      *reinterpret_cast<uint4*>(o_base + int64_t(t) * v_row_stride + d) =
          *reinterpret_cast<const uint4*>(sO + r * kVStride + d);
  }
}

template <int kDqk, int kDv>
void launch_forward_tiled_instance(const ForwardArgs& args, CUstream_st* stream) {
  constexpr int kWarps = 4;
  using Cfg = ForwardTiledConfig<kDqk, kDv, kWarps>;
  auto kernel = attention_forward_tiled_kernel<kDqk, kDv, kWarps>;
  static bool attribute_set = false;  // once per instantiation (per process)
  if (!attribute_set) {
    DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(Cfg::kSmemBytes)));
    attribute_set = true;
  }
  const int64_t blocks = int64_t(ceil_div(args.T, Cfg::kBlockM)) * args.B * args.H;
  DM_CHECK(blocks < (int64_t(1) << 31), "attention forward: grid too large (", blocks, " CTAs)");
  kernel<<<unsigned(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args);
  check_last_error("attention_forward_tiled_kernel");
}

// GPU reference: one warp per (b, t, h) row, fp32 online softmax over the visible keys one at a
// time (no tensor cores, no tiles). Dqk, Dv ≤ 256. Operands stored as S: uint16_t (bf16 bits,
// the bf16 path's reference) or float (the fp32 GPU mode); the math is fp32 either way.
constexpr int kSimpleMaxDim = 256;
constexpr int kSimpleSlots = kSimpleMaxDim / 32;

template <typename S>
struct SimpleForwardArgs {
  const S* q;  // [B, T, H, Dqk]
  const S* k;  // [B, T, H, Dqk]
  const S* v;  // [B, T, H, Dv]
  S* o;        // [B, T, H, Dv]
  float* lse;  // [B, H, T] or nullptr
  const int32_t* doc_start;
  int B, T, H, Dqk, Dv;
};

template <typename S>
__global__ void attention_forward_simple_kernel(const SimpleForwardArgs<S> a, float scale) {
  const int warps_per_block = blockDim.x / 32;
  const int64_t row = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t rows = int64_t(a.B) * a.T * a.H;
  if (row >= rows) return;
  const int h = int(row % a.H);
  const int t = int((row / a.H) % a.T);
  const int b = int(row / (int64_t(a.H) * a.T));
  const int first_key = a.doc_start ? a.doc_start[int64_t(b) * a.T + t] : 0;

  float qv[kSimpleSlots], ov[kSimpleSlots];
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.Dqk ? load_as_float(a.q, row * a.Dqk + d) : 0.0f;
    ov[i] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int j = first_key; j <= t; ++j) {
    const int64_t key_row = (int64_t(b) * a.T + j) * a.H + h;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      if (d < a.Dqk) dot += qv[i] * load_as_float(a.k, key_row * a.Dqk + d);
    }
    const float score = warp_sum(dot) * scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // exp(−inf) = 0 on the first key
    const float p = expf(score - new_max);
    running_sum = running_sum * correction + p;
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      const float vd = d < a.Dv ? load_as_float(a.v, key_row * a.Dv + d) : 0.0f;
      ov[i] = ov[i] * correction + p * vd;
    }
    running_max = new_max;
  }
  const float inverse = 1.0f / running_sum;  // ≥ 1 term: key t is always visible
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    if (d < a.Dv) store_from_float(a.o, row * a.Dv + d, ov[i] * inverse);
  }
  if (a.lse && lane == 0)
    a.lse[(int64_t(b) * a.H + h) * a.T + t] = running_max + logf(running_sum);
}

template <typename S>
void launch_forward_simple(const AttentionProblem& p, const S* q, const S* k, const S* v, S* o,
                           float* lse, CUstream_st* stream) {
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  DM_CHECK(p.Dqk <= kSimpleMaxDim && p.Dv <= kSimpleMaxDim,
           "attention forward (simple): head dims ", p.Dqk, "/", p.Dv, " exceed ", kSimpleMaxDim);
  const SimpleForwardArgs<S> args{q, k, v, o, lse, p.doc_start, p.B, p.T, p.H, p.Dqk, p.Dv};
  const int64_t rows = int64_t(p.B) * p.T * p.H;
  const int warps_per_block = 4;
  attention_forward_simple_kernel<S>
      <<<ceil_div(rows, warps_per_block), warps_per_block * 32, 0, stream>>>(args, p.scale);
  check_last_error("attention_forward_simple_kernel");
}

ForwardArgs make_forward_args(const AttentionProblem& p, const uint16_t* q, const uint16_t* k,
                              const uint16_t* v, uint16_t* o, float* lse) {
  ForwardArgs a{};
  a.q = reinterpret_cast<const bf16*>(q);
  a.k = reinterpret_cast<const bf16*>(k);
  a.v = reinterpret_cast<const bf16*>(v);
  a.o = reinterpret_cast<bf16*>(o);
  a.lse = lse;
  a.doc_start = p.doc_start;
  a.B = p.B;
  a.T = p.T;
  a.H = p.H;
  a.Dqk = p.Dqk;
  a.Dv = p.Dv;
  a.scale_log2 = p.scale * kLog2e;
  return a;
}

}  // namespace

void launch_attention_forward_tiled(const AttentionProblem& p, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, uint16_t* o, float* lse,
                                    CUstream_st* stream) {
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  const ForwardArgs args = make_forward_args(p, q, k, v, o, lse);
  // Smallest instantiation that holds the head dims (padding columns are zero-filled).
  if (p.Dqk <= 32 && p.Dv <= 32)
    launch_forward_tiled_instance<32, 32>(args, stream);
  else if (p.Dqk <= 96 && p.Dv <= 64)
    launch_forward_tiled_instance<96, 64>(args, stream);
  else if (p.Dqk <= kTiledMaxDqk && p.Dv <= kTiledMaxDv)
    launch_forward_tiled_instance<kTiledMaxDqk, kTiledMaxDv>(args, stream);
  else
    throw Error(str_cat("attention forward (tiled): head dims Dqk=", p.Dqk, " Dv=", p.Dv,
                        " exceed the instantiated maximum ", kTiledMaxDqk, "/", kTiledMaxDv));
}

void launch_attention_forward_simple(const AttentionProblem& p, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, uint16_t* o,
                                     float* lse, CUstream_st* stream) {
  launch_forward_simple(p, q, k, v, o, lse, stream);
}

void launch_attention_forward_simple(const AttentionProblem& p, const float* q, const float* k,
                                     const float* v, float* o, float* lse, CUstream_st* stream) {
  launch_forward_simple(p, q, k, v, o, lse, stream);
}

}  // namespace dm::cuda::attention_detail
