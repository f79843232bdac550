// Row kernels of the cached GPU decode step (formulas in decode_ops.h; CPU twins in
// model/kda.cpp kda_layer_decode, ops/cpu/kda_prep.cpp, ops/cpu/norm_gated.cpp and
// model/mla_decode.cpp mla_absorbed_queries).
//
// A decode step has few rows (one per active slot), so everything here is memory-bound and tiny:
// element kernels run one thread per output element over a grid-stride loop with consecutive
// threads on consecutive channels (coalesced); norms run one warp per short row (a KDA head) or
// one block per long row (a latent vector). Own kernels rather than the prefill layer's (their
// headers were still moving when this was written); the math is the same.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/decode_ops.h"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/pdl.cuh"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowThreads = 128;                // one block per long row

int grid_blocks(int64_t count) {
  const int64_t wanted = (count + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(wanted, 65536)));
}

__device__ __forceinline__ float silu_f32(float x) { return x * sigmoid_f32(x); }
__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

__global__ void prepare_rows_kernel(const int32_t* __restrict__ slots, int32_t* lengths,
                                    const int32_t* __restrict__ page_table, int64_t P,
                                    int32_t* __restrict__ positions, int32_t* __restrict__ seq_len,
                                    int32_t* __restrict__ row_table) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t r = blockIdx.x;
  const int64_t slot = slots[r];
  for (int64_t j = threadIdx.x; j < P; j += blockDim.x) row_table[r * P + j] = page_table[slot * P + j];
  if (threadIdx.x == 0) {
    const int32_t pos = lengths[slot];
    positions[r] = pos;
    seq_len[r] = pos + 1;  // the row is written into the cache before attention reads it
    lengths[slot] = pos + 1;
  }
}

// Element i = (branch·n + r)·C + c. Each thread owns column c of its slot's tail for its branch,
// so the in-place shift needs no synchronisation (a slot appears once per step).
__global__ void conv_step_kernel(const KdaConvStepArgs a, const int32_t* __restrict__ slots,
                                 int64_t n, int64_t C, int Kc) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t total = 3 * n * C;
  const int tail_rows = Kc - 1;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int branch = int(i / (n * C));
    const int64_t rc = i % (n * C), r = rc / C, c = rc % C;
    const float* w = a.weight[branch] + c * Kc;
    const uint16_t raw_bits = a.raw[branch][rc];
    float acc = 0.0f;
    if (tail_rows > 0) {
      uint16_t* tail = a.tail[branch] + int64_t(slots[r]) * tail_rows * C + c;  // [Kc−1] × C
      // Taps in the CPU's order (oldest first); each tail row moves up one as it is read.
      for (int j = 0; j < tail_rows; ++j) {
        const uint16_t bits = tail[int64_t(j) * C];
        acc += w[j] * bf16_bits_to_float(bits);
        if (j > 0) tail[int64_t(j - 1) * C] = bits;
      }
      tail[int64_t(tail_rows - 1) * C] = raw_bits;
    }
    acc += w[Kc - 1] * bf16_bits_to_float(raw_bits);
    store_from_float(a.out[branch], rc, silu_f32(acc));
  }
}
// One block per row: the latent norm's statistic needs the whole kvl-wide vector. The row's
// position, page and rotation are read before the PDL wait (prepare_rows wrote them at the
// step's start: pdl.h's two-launches-back rule), so after it only kv_a is a round trip away.
__global__ void write_latent_kernel(const float* __restrict__ kv_a,
                                    const float* __restrict__ norm_w, int64_t kvl, int64_t rope,
                                    float eps, const float* __restrict__ cos,
                                    const float* __restrict__ sin,
                                    const int32_t* __restrict__ positions,
                                    const int32_t* __restrict__ row_table, int64_t P,
                                    int64_t page_tokens, uint16_t* __restrict__ pages) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x, W = kvl + rope, half = rope / 2;
  const int64_t pos = positions[r];
  const int64_t page = row_table[r * P + pos / page_tokens];
  // This thread's first rope element e = threadIdx.x: its pair's rotation.
  const int64_t first_pair = threadIdx.x / 2;
  const bool rotates = cos && int64_t(threadIdx.x) < 2 * half;
  const float first_cos = rotates ? cos[pos * half + first_pair] : 1.0f;
  const float first_sin = rotates ? sin[pos * half + first_pair] : 0.0f;
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before kv_a is read or the page written
  const float* row = kv_a + r * W;
  uint16_t* dst = pages + (page * page_tokens + pos % page_tokens) * W;
  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x; i < kvl; i += blockDim.x) sum_squares += row[i] * row[i];
  const float inverse_rms = rsqrtf(block_sum(sum_squares, shared) / float(kvl) + eps);
  for (int64_t i = threadIdx.x; i < kvl; i += blockDim.x)
    store_from_float(dst, i, row[i] * inverse_rms * norm_w[i]);
  for (int64_t e = threadIdx.x; e < rope; e += blockDim.x) {
    float value = row[kvl + e];
    if (cos && e < 2 * half) {
      const int64_t pair = e / 2;
      const float x0 = row[kvl + 2 * pair], x1 = row[kvl + 2 * pair + 1];
      const bool first = e == int64_t(threadIdx.x);
      const float c = first ? first_cos : cos[pos * half + pair];
      const float s = first ? first_sin : sin[pos * half + pair];
      value = (e % 2 == 0) ? x0 * c - x1 * s : x1 * c + x0 * s;
    }
    store_from_float(dst, kvl + e, value);
  }
}

// Element i = (r·H + h)·rope + e.
__global__ void query_rope_kernel(const uint16_t* __restrict__ q, int64_t H, int64_t nope,
                                  int64_t rope, int64_t kvl, const float* __restrict__ cos,
                                  const float* __restrict__ sin,
                                  const int32_t* __restrict__ positions,
                                  uint16_t* __restrict__ q_abs, int64_t total) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t dq = nope + rope, W = kvl + rope, half = rope / 2;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i % rope, rh = i / rope, r = rh / H;
    const uint16_t* src = q + rh * dq + nope;
    float value = load_as_float(src, e);
    if (cos && e < 2 * half) {
      const int64_t pair = e / 2, pos = positions[r];
      const float x0 = load_as_float(src, 2 * pair), x1 = load_as_float(src, 2 * pair + 1);
      const float c = cos[pos * half + pair], s = sin[pos * half + pair];
      value = (e % 2 == 0) ? x0 * c - x1 * s : x1 * c + x0 * s;
    }
    store_from_float(q_abs, rh * W + kvl + e, value);
  }
}
}  // namespace

void decode_prepare_rows(const int32_t* slots, int64_t n, int32_t* lengths,
                         const int32_t* page_table, int64_t P, int32_t* positions,
                         int32_t* seq_len, int32_t* row_table, DecodeStream stream) {
  if (n == 0) return;
  launch_pdl(prepare_rows_kernel, unsigned(n), kRowThreads, 0, stream, slots, lengths, page_table,
             P, positions, seq_len, row_table);
  check_last_error("decode_prepare_rows");
}

void decode_kda_conv_step(const KdaConvStepArgs& a, const int32_t* slots, int64_t n, int64_t C,
                          int Kc, DecodeStream stream) {
  DM_CHECK(Kc >= 1, "decode_kda_conv_step: conv kernel must be ≥ 1, got ", Kc);
  if (n * C == 0) return;
  launch_pdl(conv_step_kernel, grid_blocks(3 * n * C), kThreads, 0, stream, a, slots, n, C, Kc);
  check_last_error("decode_kda_conv_step");
}
void decode_mla_write_latent(const float* kv_a, const float* norm_w, int64_t n, int64_t kvl,
                             int64_t rope, float eps, const float* cos, const float* sin,
                             const int32_t* positions, const int32_t* row_table, int64_t P,
                             int64_t page_tokens, uint16_t* pages, DecodeStream stream) {
  if (n == 0) return;
  launch_pdl(write_latent_kernel, unsigned(n), kRowThreads, 0, stream, kv_a, norm_w, kvl, rope, eps,
             cos, sin, positions, row_table, P, page_tokens, pages);
  check_last_error("decode_mla_write_latent");
}

void decode_mla_query_rope(const uint16_t* q, int64_t n, int64_t H, int64_t nope, int64_t rope,
                           int64_t kvl, const float* cos, const float* sin,
                           const int32_t* positions, uint16_t* q_abs, DecodeStream stream) {
  const int64_t total = n * H * rope;
  if (total == 0) return;
  launch_pdl(query_rope_kernel, grid_blocks(total), kThreads, 0, stream, q, H, nope, rope, kvl, cos,
             sin, positions, q_abs, total);
  check_last_error("decode_mla_query_rope");
}
}  // namespace dm::cuda
