// Tensor-core (wmma, bf16 operands, fp32 accumulation) output stage of the chunked KDA forward,
// used for bf16 inputs (kda_chunk.cu runs the prepare stage on CUDA cores in fp32, and the state
// stage is kda_chunk_state_tf32.cu). Same algebra and workspace as the fp32 kernel of kda_chunk.cu:
//   output: O = Qd·S + P·V'  (S, V' rounded to bf16 operands here; they stay fp32 in ws).
// Tiles: 16×16×16 fragments; 8 warps.
// Shared-memory rows are padded (+8 bf16 / +4 fp32 elements) against bank conflicts; every
// fragment pointer stays 32-byte aligned (rows and columns start at multiples of 16).
#include <mma.h>

#include <cstdlib>
#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_common.cuh"

namespace dm::cuda {
namespace kda_detail {
namespace {

namespace wmma = nvcuda::wmma;
using FragmentA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using FragmentAColumnMajor =
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using FragmentB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using FragmentAccumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kPadBf16 = 8, kPadF32 = 4;
constexpr int kTileLdBf16 = kTileV + kPadBf16;  // 40
constexpr int kTileLdF32 = kTileV + kPadF32;    // 36

__host__ __device__ inline int tc_ld_key_bf16(const KdaDims& d) { return d.KP + kPadBf16; }

// Byte offsets of the shared buffers, each rounded up to 128 bytes (keeps fragments aligned).
__host__ __device__ inline int tc_round(int bytes) { return (bytes + 127) / 128 * 128; }

struct TcOutputLayout {
  int query_decay, state_bf16, lower_query_key, value_new_bf16, out_f32, total;
};
__host__ __device__ inline TcOutputLayout tc_output_layout(const KdaDims& d) {
  TcOutputLayout l;
  const int ldk = tc_ld_key_bf16(d);
  int at = 0;
  l.query_decay = at;     at += tc_round(kChunk * ldk * 2);
  l.state_bf16 = at;      at += tc_round(d.KP * kTileLdBf16 * 2);
  l.lower_query_key = at; at += tc_round(kChunk * (kChunk + kPadBf16) * 2);
  l.value_new_bf16 = at;  at += tc_round(kChunk * kTileLdBf16 * 2);
  l.out_f32 = at;         at += tc_round(kChunk * kTileLdF32 * 4);
  l.total = at;
  return l;
}

// Grid: num_chunks × B·H × ceil(VP/32). O = Qd·S + P·V', 4 × 2 fragments, one per warp.
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_output_tc_kernel(Storage* o, KdaDims d, KdaForwardWorkspace ws) {
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const TcOutputLayout l = tc_output_layout(d);
  __nv_bfloat16* query_decay = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.query_decay);
  __nv_bfloat16* state_bf16 = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.state_bf16);
  __nv_bfloat16* lower_query_key = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.lower_query_key);
  __nv_bfloat16* value_new_bf16 = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.value_new_bf16);
  float* out = reinterpret_cast<float*>(shared_bytes + l.out_f32);

  const int tid = threadIdx.x, warp = tid / 32, tx = tid % kTileV, ty = tid / kTileV;
  constexpr int kRowLanes = kThreads / kTileV;
  constexpr int kLdLower = kChunk + kPadBf16;
  const int ldk = tc_ld_key_bf16(d);
  const int64_t n = blockIdx.x, bh = blockIdx.y;
  const int64_t ch = bh * d.num_chunks + n;
  const int e = blockIdx.z * kTileV + tx;
  const bool column_padded = e < d.VP;

  for (int idx = tid; idx < kChunk * d.KP; idx += kThreads) {
    const int i = idx / d.KP, col = idx % d.KP;
    query_decay[i * ldk + col] = __float2bfloat16_rn(ws.query_decay[ch * kChunk * d.KP + idx]);
  }
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    lower_query_key[i * kLdLower + j] = __float2bfloat16_rn(ws.lower_query_key[ch * kChunk * kChunk + idx]);
  }
  for (int row = ty; row < d.KP; row += kRowLanes)
    state_bf16[row * kTileLdBf16 + tx] =
        __float2bfloat16_rn(column_padded ? ws.states[(ch * d.KP + row) * d.VP + e] : 0.0f);
  for (int i = ty; i < kChunk; i += kRowLanes)
    value_new_bf16[i * kTileLdBf16 + tx] =
        __float2bfloat16_rn(column_padded ? ws.value_new[(ch * kChunk + i) * d.VP + e] : 0.0f);
  __syncthreads();

  {
    const int mi = warp / 2, ni = warp % 2;
    FragmentAccumulator acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < d.KP / 16; ++kk) {
      FragmentA a;
      FragmentB b;
      wmma::load_matrix_sync(a, query_decay + mi * 16 * ldk + kk * 16, ldk);
      wmma::load_matrix_sync(b, state_bf16 + kk * 16 * kTileLdBf16 + ni * 16, kTileLdBf16);
      wmma::mma_sync(acc, a, b, acc);
    }
    // P is lower triangular: row block mi needs column blocks 0..mi only.
    for (int kk = 0; kk <= mi; ++kk) {
      FragmentA a;
      FragmentB b;
      wmma::load_matrix_sync(a, lower_query_key + mi * 16 * kLdLower + kk * 16, kLdLower);
      wmma::load_matrix_sync(b, value_new_bf16 + kk * 16 * kTileLdBf16 + ni * 16, kTileLdBf16);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(out + mi * 16 * kTileLdF32 + ni * 16, acc, kTileLdF32,
                            wmma::mem_row_major);
  }
  __syncthreads();

  const int64_t b = bh / d.H, h = bh % d.H;
  const int c = kda_chunk_length(d, n);
  if (e < d.V)
    for (int i = ty; i < c; i += kRowLanes)
      store_from_float(o, kda_token_row(d, b, h, n * kChunk + i) * d.V + e, out[i * kTileLdF32 + tx]);
}

// ---- One block per chunk-head over all VP columns (the default; DM_KDA_OUTPUT=tiles selects the
// tiled kernel above, which runs VP/32 blocks per chunk-head, each converting the whole Qd
// [C, KP] and P [C, C] again: 4× the reads of those two at V = 128, for one 16×16 fragment per
// warp). Here Qd, P, S and V' are read once (16-byte loads, all of a thread's loads in flight
// before any conversion), and each warp computes a 16-row block × half the fragments of the VP
// columns. The fp32 output tile reuses the operands' shared memory once the products are done.
// ~77 KB at K = V = 128.
struct WholeOutputLayout {
  int ld_key, ld_value;  // bf16 row strides: KP + 8, VP + 8
  int query_decay, state, lower_query_key, value_new, out, total;
};
__host__ __device__ inline WholeOutputLayout whole_output_layout(int KP, int VP) {
  WholeOutputLayout l;
  l.ld_key = KP + kPadBf16;
  l.ld_value = VP + kPadBf16;
  int at = 0;
  l.query_decay = at;
  at += tc_round(kChunk * l.ld_key * 2);
  l.state = at;
  at += tc_round(KP * l.ld_value * 2);
  l.lower_query_key = at;
  at += tc_round(kChunk * (kChunk + kPadBf16) * 2);
  l.value_new = at;
  at += tc_round(kChunk * l.ld_value * 2);
  l.out = 0;  // [C, VP + 4] fp32 over the operands, once the products are done
  const int out_bytes = tc_round(kChunk * (VP + kPadF32) * 4);
  l.total = at > out_bytes ? at : out_bytes;
  return l;
}
constexpr int kWholeMaxFragments = kKdaCudaMaxHeadDim / 16 / 2;  // per warp: half of VP/16

// rows × cols fp32 (cols % 4 == 0, 16-byte aligned rows of stride src_ld) into a bf16 tile of
// row stride dst_ld, by the whole block, in two steps so that loads of several tiles can be in
// flight together: issue() puts every 16-byte load of the thread in flight, store() converts
// and writes them.
template <int kMaxPerThread>
struct RowsAsBf16 {
  float4 v[kMaxPerThread];
  int per_row, count;
  __device__ __forceinline__ void issue(const float* src, int64_t src_ld, int rows, int cols) {
    per_row = cols / 4, count = rows * per_row;
#pragma unroll
    for (int u = 0; u < kMaxPerThread; ++u) {
      const int idx = threadIdx.x + u * kThreads;
      if (idx < count)
        v[u] = *reinterpret_cast<const float4*>(src + (idx / per_row) * src_ld + idx % per_row * 4);
    }
  }
  __device__ __forceinline__ void store(__nv_bfloat16* dst, int dst_ld) const {
#pragma unroll
    for (int u = 0; u < kMaxPerThread; ++u) {
      const int idx = threadIdx.x + u * kThreads;
      if (idx < count) {
        __nv_bfloat162* out =
            reinterpret_cast<__nv_bfloat162*>(dst + (idx / per_row) * dst_ld + idx % per_row * 4);
        out[0] = __floats2bfloat162_rn(v[u].x, v[u].y);
        out[1] = __floats2bfloat162_rn(v[u].z, v[u].w);
      }
    }
  }
};

// 8 fp32 values (16-byte aligned) to 8 adjacent outputs (16-byte aligned for bf16, 32 for fp32).
__device__ __forceinline__ void store8_from_float(uint16_t* dst, const float* src) {
  const float4 lo = *reinterpret_cast<const float4*>(src),
               hi = *reinterpret_cast<const float4*>(src + 4);
  const __nv_bfloat162 packed[4] = {
      __floats2bfloat162_rn(lo.x, lo.y), __floats2bfloat162_rn(lo.z, lo.w),
      __floats2bfloat162_rn(hi.x, hi.y), __floats2bfloat162_rn(hi.z, hi.w)};
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
}
__device__ __forceinline__ void store8_from_float(float* dst, const float* src) {
  reinterpret_cast<float4*>(dst)[0] = reinterpret_cast<const float4*>(src)[0];
  reinterpret_cast<float4*>(dst)[1] = reinterpret_cast<const float4*>(src)[1];
}

// K = V = kStaticDims when > 0 (kda_static_dims): the row loaders' divisions by the row width
// and every stride fold to constants (the runtime divisions were a large part of the
// instructions).
template <typename Storage, int kStaticDims>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_output_whole_kernel(Storage* o, KdaDims d, KdaForwardWorkspace ws) {
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const int KP = kStaticDims > 0 ? kStaticDims : d.KP, VP = kStaticDims > 0 ? kStaticDims : d.VP;
  const WholeOutputLayout l = whole_output_layout(KP, VP);
  __nv_bfloat16* query_decay = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.query_decay);
  __nv_bfloat16* state = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.state);
  __nv_bfloat16* lower_query_key =
      reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.lower_query_key);
  __nv_bfloat16* value_new = reinterpret_cast<__nv_bfloat16*>(shared_bytes + l.value_new);
  float* out = reinterpret_cast<float*>(shared_bytes + l.out);
  constexpr int kLdLower = kChunk + kPadBf16;
  const int ld_key = l.ld_key, ld_value = l.ld_value, ld_out = VP + kPadF32;
  const int tid = threadIdx.x, warp = tid / 32;
  const int64_t n = blockIdx.x, bh = blockIdx.y, ch = bh * d.num_chunks + n;

  // Per thread at KP = VP = 128: Qd 8, S 16, V' 8, P 4 float4 loads, in three overlapping
  // batches (Qd, P and S's first half; then S's second half; then V'), at most 20 float4 live:
  // issued one tile at a time the four round trips did not overlap.
  constexpr int kMaxHead = kKdaCudaMaxHeadDim;
  constexpr int kRowTile = kChunk * kMaxHead / 4 / kThreads;  // [C, 128] or [64, 128]: 8
  const int state_half = KP / 2;                              // KP is a multiple of 16
  {
    RowsAsBf16<kRowTile> query_rows, state_top;
    RowsAsBf16<kChunk * kChunk / 4 / kThreads> lower_rows;
    query_rows.issue(ws.query_decay + ch * kChunk * KP, KP, kChunk, KP);
    lower_rows.issue(ws.lower_query_key + ch * kChunk * kChunk, kChunk, kChunk, kChunk);
    state_top.issue(ws.states + ch * KP * VP, VP, state_half, VP);
    query_rows.store(query_decay, ld_key);
    lower_rows.store(lower_query_key, kLdLower);
    RowsAsBf16<kRowTile> state_bottom;
    state_bottom.issue(ws.states + ch * KP * VP + state_half * VP, VP, KP - state_half, VP);
    state_top.store(state, ld_value);
    RowsAsBf16<kRowTile> value_rows;
    value_rows.issue(ws.value_new + ch * kChunk * VP, VP, kChunk, VP);
    state_bottom.store(state + state_half * ld_value, ld_value);
    value_rows.store(value_new, ld_value);
  }
  __syncthreads();

  // Warp: row block mi = warp / 2, fragments f = ni, ni + 2, … of the VP / 16 columns.
  const int mi = warp / 2, ni = warp % 2, fragments = VP / 16;
  FragmentAccumulator acc[kWholeMaxFragments];
#pragma unroll
  for (int u = 0; u < kWholeMaxFragments; ++u) wmma::fill_fragment(acc[u], 0.0f);
  // acc[u] += A[row block mi, k blocks < k_blocks]·B[those k blocks, fragment f].
  auto accumulate = [&](const __nv_bfloat16* a_rows, int ld_a, const __nv_bfloat16* b_rows,
                        int k_blocks) {
    for (int kk = 0; kk < k_blocks; ++kk) {
      FragmentA a;
      wmma::load_matrix_sync(a, a_rows + mi * 16 * ld_a + kk * 16, ld_a);
#pragma unroll
      for (int u = 0; u < kWholeMaxFragments; ++u) {
        const int f = ni + 2 * u;
        if (f < fragments) {
          FragmentB b;
          wmma::load_matrix_sync(b, b_rows + kk * 16 * ld_value + f * 16, ld_value);
          wmma::mma_sync(acc[u], a, b, acc[u]);
        }
      }
    }
  };
  accumulate(query_decay, ld_key, state, KP / 16);
  // P is lower triangular: row block mi needs column blocks 0..mi only.
  accumulate(lower_query_key, kLdLower, value_new, mi + 1);
  __syncthreads();  // Qd and S are dead: the fp32 tile goes over them
#pragma unroll
  for (int u = 0; u < kWholeMaxFragments; ++u) {
    const int f = ni + 2 * u;
    if (f < fragments)
      wmma::store_matrix_sync(out + mi * 16 * ld_out + f * 16, acc[u], ld_out, wmma::mem_row_major);
  }
  __syncthreads();

  // Token i's output row is H·V elements after token i−1's. With V % 8 == 0 a thread stores 8
  // adjacent outputs at once (one 16-byte store in bf16): the element-by-element loop, with a
  // division and a 64-bit row index per element, was most of the kernel's instructions.
  const int64_t b = bh / d.H, h = bh % d.H;
  const int c = kda_chunk_length(d, n);
  Storage* o_rows = o + kda_token_row(d, b, h, n * kChunk) * d.V;
  const int64_t o_stride = d.H * d.V;
  if (d.V % 8 == 0) {
    const int per_row = (kStaticDims > 0 ? kStaticDims : d.V) / 8;  // V = VP when static
    for (int idx = tid; idx < c * per_row; idx += kThreads) {
      const int i = idx / per_row, e = idx % per_row * 8;
      store8_from_float(o_rows + i * o_stride + e, out + i * ld_out + e);
    }
  } else {
    for (int idx = tid; idx < c * d.V; idx += kThreads) {
      const int i = idx / d.V, e = idx % d.V;
      store_from_float(o_rows, i * o_stride + e, out[i * ld_out + e]);
    }
  }
}

// The whole-chunk-head kernel unless DM_KDA_OUTPUT=tiles (read once).
bool output_whole_selected() {
  static const bool tiles = [] { return env_choice("DM_KDA_OUTPUT", {"whole", "tiles"}) == 1; }();
  return !tiles;
}

}  // namespace

template <typename Storage>
void kda_chunk_output_tensor_cores(Storage* o, const KdaDims& d, const KdaForwardWorkspace& ws,
                                   cudaStream_t stream) {
  if (d.num_chunks == 0) return;
  if (output_whole_selected()) {
    const int shared = whole_output_layout(d.KP, d.VP).total;
    auto launch = [&](auto kernel) {
      DM_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
      kernel<<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H)), kThreads, size_t(shared),
               stream>>>(o, d, ws);
    };
    // K = V = 128 exactly (V = VP is what the static store loop assumes).
    if (kda_static_dims(d) == kKdaStaticDims && d.K == kKdaStaticDims && d.V == kKdaStaticDims)
      launch(kda_chunk_output_whole_kernel<Storage, kKdaStaticDims>);
    else
      launch(kda_chunk_output_whole_kernel<Storage, 0>);
    check_last_error("cuda kda_chunk_forward (output, tensor cores, whole chunk-head)");
    return;
  }
  const int shared = tc_output_layout(d).total;
  DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_output_tc_kernel<Storage>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  kda_chunk_output_tc_kernel<Storage>
      <<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H), unsigned(ceil_div(d.VP, kTileV))),
         kThreads, size_t(shared), stream>>>(o, d, ws);
  check_last_error("cuda kda_chunk_forward (output, tensor cores)");
}
template void kda_chunk_output_tensor_cores<float>(float*, const KdaDims&,
                                                   const KdaForwardWorkspace&, cudaStream_t);
template void kda_chunk_output_tensor_cores<uint16_t>(uint16_t*, const KdaDims&,
                                                      const KdaForwardWorkspace&, cudaStream_t);

}  // namespace kda_detail
}  // namespace dm::cuda
