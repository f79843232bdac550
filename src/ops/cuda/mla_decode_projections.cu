// The absorbed MLA decode step's two per-head products for a few rows (decode_ops.h
// decode_mla_absorb_query / decode_mla_value_projection), in place of two strided-batched
// cuBLAS GEMMs and the query RoPE kernel. At decode sizes those GEMMs stream 4 MB of W_kvb each
// and are launched without programmatic dependent launch, so each one is a full stop in a
// PDL-overlapped step; these kernels load their weights before they wait for their inputs
// (pdl.h), like the GEMV.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kChunk = 8;         // bf16 per 16-byte load
constexpr int kAbsorbGroups = 8;  // 8-column groups a block owns
constexpr int kAbsorbSlabs = 16;  // row slabs (threads per column group)
constexpr int kAbsorbThreads = kAbsorbGroups * kAbsorbSlabs;
constexpr int kAbsorbColumns = kAbsorbGroups * kChunk;  // 64 columns a block
constexpr int kAbsorbRowsInFlight = 8;                  // a thread's weight loads before the wait
constexpr int kValueWarps = 8;                          // value rows a block (a warp each)
constexpr int kValueChunksInFlight = 2;                 // 16-byte weight chunks a lane loads first

__device__ __forceinline__ void add_products(float (&acc)[kChunk], float x, const uint4& w) {
  const uint32_t wa[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = fmaf(x, __uint_as_float(wa[i] << 16), acc[2 * i]);
    acc[2 * i + 1] = fmaf(x, __uint_as_float(wa[i] & 0xffff0000u), acc[2 * i + 1]);
  }
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const uint32_t aa[4] = {a.x, a.y, a.z, a.w}, ba[4] = {b.x, b.y, b.z, b.w};
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(aa[i] << 16), __uint_as_float(ba[i] << 16), acc);
    acc = fmaf(__uint_as_float(aa[i] & 0xffff0000u), __uint_as_float(ba[i] & 0xffff0000u), acc);
  }
  return acc;
}

// Grid (ceil(kvl / 64), H, n), 128 threads: thread (group g, slab s) sums columns
// 64·bx + 8g … + 7 over key rows i = s, s + 16, … of head h (W_k,h = W_kvb rows h·(nope + dv) +
// i), the 16 slabs' sums added in slab order through shared memory. Block x = 0 also writes the
// RoPE half (decode_ops.cu query_rope_kernel's formula).
__global__ void __launch_bounds__(kAbsorbThreads)
    absorb_query_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv_b, int H,
                        int nope, int rope, int kvl, int dv, const float* __restrict__ cos,
                        const float* __restrict__ sin, const int32_t* __restrict__ positions,
                        uint16_t* __restrict__ q_abs) {
  __shared__ float sums[kAbsorbSlabs][kAbsorbColumns];
  const int g = threadIdx.x % kAbsorbGroups, slab = threadIdx.x / kAbsorbGroups;
  const int h = blockIdx.y, r = blockIdx.z;
  const int column = blockIdx.x * kAbsorbColumns + g * kChunk;
  const bool live = column < kvl;
  const uint16_t* w = kv_b + int64_t(h) * (nope + dv) * kvl + column;  // row i at w[i·kvl]
  uint4 first[kAbsorbRowsInFlight];
#pragma unroll
  for (int u = 0; u < kAbsorbRowsInFlight; ++u) {
    const int i = slab + u * kAbsorbSlabs;
    first[u] = live && i < nope ? __ldg(reinterpret_cast<const uint4*>(w + int64_t(i) * kvl))
                                : make_uint4(0u, 0u, 0u, 0u);
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): W loaded, q is the previous kernel's
  const int64_t dq = nope + rope;
  const uint16_t* qh = q + (int64_t(r) * H + h) * dq;
  float acc[kChunk] = {};
#pragma unroll
  for (int u = 0; u < kAbsorbRowsInFlight; ++u) {
    const int i = slab + u * kAbsorbSlabs;
    if (i < nope) add_products(acc, load_as_float(qh, i), first[u]);
  }
  for (int i = slab + kAbsorbRowsInFlight * kAbsorbSlabs; live && i < nope; i += kAbsorbSlabs)
    add_products(acc, load_as_float(qh, i),
                 __ldg(reinterpret_cast<const uint4*>(w + int64_t(i) * kvl)));
#pragma unroll
  for (int e = 0; e < kChunk; ++e) sums[slab][g * kChunk + e] = acc[e];
  __syncthreads();
  const int64_t out_row = (int64_t(r) * H + h) * (kvl + rope);
  if (threadIdx.x < kAbsorbColumns) {
    const int c = blockIdx.x * kAbsorbColumns + threadIdx.x;
    float total = 0.0f;
    for (int s = 0; s < kAbsorbSlabs; ++s) total += sums[s][threadIdx.x];
    if (c < kvl) store_from_float(q_abs, out_row + c, total);
  }
  if (blockIdx.x == 0) {
    const uint16_t* src = qh + nope;
    const int half = rope / 2;
    for (int e = threadIdx.x; e < rope; e += kAbsorbThreads) {
      float value = load_as_float(src, e);
      if (cos && e < 2 * half) {
        const int pair = e / 2;
        const int64_t pos = positions[r];
        const float x0 = load_as_float(src, 2 * pair), x1 = load_as_float(src, 2 * pair + 1);
        const float c = cos[pos * half + pair], s = sin[pos * half + pair];
        value = (e % 2 == 0) ? x0 * c - x1 * s : x1 * c + x0 * s;
      }
      store_from_float(q_abs, out_row + kvl + e, value);
    }
  }
}

// Grid (ceil(H·dv / 8), n), 8 warps: warp w computes o[r, hd] (hd = 8·bx + w, head h = hd / dv,
// d = hd mod dv) = W_v,h[d, :]·latent[r, h, :] (W_v,h = W_kvb rows h·(nope + dv) + nope + d),
// its lanes taking 16-byte chunks of the row, the first ones loaded before the wait.
__global__ void __launch_bounds__(kValueWarps * 32)
    value_projection_kernel(const uint16_t* __restrict__ latent, const uint16_t* __restrict__ kv_b,
                            int H, int nope, int kvl, int dv, uint16_t* __restrict__ o) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = blockIdx.y;
  const int64_t hd = int64_t(blockIdx.x) * kValueWarps + warp;
  const bool live = hd < int64_t(H) * dv;
  const int64_t h = live ? hd / dv : 0, d = live ? hd % dv : 0;
  const uint4* w =
      reinterpret_cast<const uint4*>(kv_b + (h * (nope + dv) + nope + d) * int64_t(kvl));
  const int chunks = kvl / kChunk;
  uint4 first[kValueChunksInFlight];
#pragma unroll
  for (int u = 0; u < kValueChunksInFlight; ++u) {
    const int c = lane + 32 * u;
    first[u] = live && c < chunks ? __ldg(w + c) : make_uint4(0u, 0u, 0u, 0u);
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): W loaded, the latent is the attention's
  if (!live) return;
  const uint4* x = reinterpret_cast<const uint4*>(latent + (int64_t(r) * H + h) * kvl);
  float acc = 0.0f;
#pragma unroll
  for (int u = 0; u < kValueChunksInFlight; ++u) {
    const int c = lane + 32 * u;
    if (c < chunks) acc += dot8(x[c], first[u]);
  }
  for (int c = lane + 32 * kValueChunksInFlight; c < chunks; c += 32)
    acc += dot8(x[c], __ldg(w + c));
  acc = warp_sum(acc);
  if (lane == 0) store_from_float(o, int64_t(r) * H * dv + hd, acc);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool decode_mla_projections_apply(int64_t n, int64_t kvl, const uint16_t* kv_b,
                                  const uint16_t* latent) {
  return n >= 0 && n <= kMlaDecodeProjectionMaxRows && kvl > 0 && kvl % kChunk == 0 &&
         aligned16(kv_b) && aligned16(latent);
}

void decode_mla_absorb_query(const uint16_t* q, const uint16_t* kv_b, int64_t n, int64_t H,
                             int64_t nope, int64_t rope, int64_t kvl, int64_t dv, const float* cos,
                             const float* sin, const int32_t* positions, uint16_t* q_abs,
                             DecodeStream stream) {
  DM_CHECK(decode_mla_projections_apply(n, kvl, kv_b, nullptr) && H > 0 && H < 65536 && nope >= 0 &&
               rope >= 0,
           "decode_mla_absorb_query: unsupported n=", n, " H=", H, " kvl=", kvl);
  if (n == 0) return;
  const dim3 grid(unsigned(ceil_div(kvl, kAbsorbColumns)), unsigned(H), unsigned(n));
  launch_pdl(absorb_query_kernel, grid, kAbsorbThreads, 0, stream, q, kv_b, int(H), int(nope),
             int(rope), int(kvl), int(dv), cos, sin, positions, q_abs);
  check_last_error("decode_mla_absorb_query");
}

void decode_mla_value_projection(const uint16_t* latent, const uint16_t* kv_b, int64_t n, int64_t H,
                                 int64_t nope, int64_t kvl, int64_t dv, uint16_t* o,
                                 DecodeStream stream) {
  DM_CHECK(decode_mla_projections_apply(n, kvl, kv_b, latent) && H > 0 && dv > 0,
           "decode_mla_value_projection: unsupported n=", n, " H=", H, " kvl=", kvl);
  if (n == 0) return;
  const dim3 grid(unsigned(ceil_div(H * dv, kValueWarps)), unsigned(n));
  launch_pdl(value_projection_kernel, grid, kValueWarps * 32, 0, stream, latent, kv_b, int(H),
             int(nope), int(kvl), int(dv), o);
  check_last_error("decode_mla_value_projection");
}

}  // namespace dm::cuda
