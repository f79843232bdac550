// Stage 4 of the chunked KDA backward, split (KdaBackwardPath::TensorCoreSplit), first kernel:
// the value side, one block per (chunk, batch-head, half of V). Same algebra and precision per
// product as stage 1 of the fused kernel (kda_chunk_backward_tc.cu), restricted to the block's
// VH = VP/2 value columns e0 + [0, VH):
//   L (β-free, stored by the forward's prepare stage, ws.lower_key_key);
//   dV' = Ke·dS' + Pᵀ·dO (tf32); dP_h = dO·V'ᵀ (bf16, dO exact); dR = M⁻ᵀ·dV' (M = I + Diag(β)L,
//   independent per value column); dM_h = −dR·V'ᵀ (tf32); X = V − Kd·S (tf32, Kd = K⊙e^Γ formed
//   once per block over Γ); dX = β·dR; dv += dX.
// dP and dM are sums over V: each half writes its partial [C, C] to the split workspace, with its
// partial of dβ = rowdot(dR, X) + Σ_j L_ij·dM_ij (linear in dM, so the L term splits too), and its
// columns of dX. The key kernel sums the two halves in a fixed order (deterministic).
// At K = V = 128 dP_h is computed in phase 3 beside dM_h (one load of each V' pair for both).
//
// Why split: the fused kernel holds ~220 KB of shared memory and 252 registers per thread, one
// block per SM, and waits on L2 in its product phases with nothing to switch to. Here the
// shared memory is Γ [C, KP+4] fp32, raw k [C, KP+8] bf16, L [C, C+4], the inverted diagonal
// blocks [4][16, 20], dV'→dR [C, VH+8] and dO [C, VH+8] fp32: ~109 KB at K = V = 128, two
// blocks per SM (512 threads at 64 registers, or 256 at 128: kMaxColGroups below). Both halves
// stage k and Γ (for X's Kd) and load L.
#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_stage4_mma.cuh"

namespace dm::cuda::kda_detail {
namespace {

// Warps per 16-row sub-block (column groups), as in the key kernel: four (512 threads) when
// VH % 32 == 0, else two (256 threads). A warp holds 16 rows × VH/groups columns of the [C, VH]
// products and 16 rows × 64/groups columns of the [C, C] ones.
constexpr int kMaxColGroups = kKdaStage4MaxColGroups;

struct ValueLayout {
  int ldk;  // Γ rows (fp32): KP + 4
  int ldr;  // raw k rows (bf16): KP + 8
  int ldh;  // dV' and dO rows (fp32): VH + 8, ≡ 8 (mod 32) floats for conflict-free pair loads
  int gamma, key_raw, lower, inverse, d_value, d_out, vectors, total;
};
constexpr int kLdInverse = kSubBlock + 4;  // row stride of the [16, 16] inverse blocks
// β, 1/‖k‖, seg, dβ partials of the column groups [kMaxColGroups, C].
constexpr int kValueVectorFloats = (3 + kMaxColGroups) * kChunk;

// Phase clock (bench_cuda_kda --phases): SM cycle stamps of thread 0 of one block (the middle
// chunk of the first batch-head, V half 0) at the phase boundaries, while enabled.
constexpr int kValueStamps = 7;
__device__ int g_value_clock_on;
__device__ long long g_value_clock[kValueStamps];
const char* const kValuePhaseNames[kValueStamps] = {
    "start", "rows, dO, L", "norms, Gamma", "dV', dP", "dR solve", "dM, X, dbeta", "dX, dv"};

__host__ __device__ inline ValueLayout value_layout(int KP, int VP) {
  ValueLayout l;
  l.ldk = KP + 4;
  l.ldr = KP + 8;
  l.ldh = VP / 2 + 8;
  auto round16 = [](int bytes) { return (bytes + 15) / 16 * 16; };
  int at = 0;
  l.gamma = at;
  at += round16(kChunk * l.ldk * 4);
  l.key_raw = at;
  at += round16(kChunk * l.ldr * 2);
  l.lower = at;
  at += round16(kChunk * kLdPair * 4);
  l.inverse = at;
  at += round16(kNumSubBlocks * kSubBlock * kLdInverse * 4);
  l.d_value = at;
  at += round16(kChunk * l.ldh * 4);
  l.d_out = at;
  at += round16(kChunk * l.ldh * 4);
  l.vectors = at;
  at += kValueVectorFloats * 4;
  l.total = at;
  return l;
}

// Stores a warp's [16, 8·n_tiles] accumulator tile (origin r0, col0) into the row-major global
// matrix dst [·, ld], times `sign`, as 8-byte pairs.
template <int kTiles>
__device__ __forceinline__ void store_tiles(const float (&acc)[kTiles][4], int n_tiles, int r0,
                                            int col0, float* dst, int ld, float sign) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
    if (j < n_tiles)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(dst + (r0 + g + 8 * half) * ld + col0 + 8 * j + 2 * tq) =
            make_float2(sign * acc[j][2 * half], sign * acc[j][2 * half + 1]);
}

// acc += A·B for one warp's 16×8 tile in 3×tf32 (a = a_hi + a_lo, likewise b; the a_lo·b_lo
// term dropped): close to fp32 products at three tf32 mma per k-step. Loaders as warp_mma's.
template <typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma_tf32x3(float (&acc)[4], int k_begin, int k_end,
                                                LoadA&& load_a, LoadB&& load_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  auto split = [](float x, uint32_t& hi, uint32_t& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
  };
  for (int k0 = k_begin; k0 < k_end; k0 += 8) {
    const float a[4] = {load_a(g, k0 + tq), load_a(g + 8, k0 + tq), load_a(g, k0 + tq + 4),
                        load_a(g + 8, k0 + tq + 4)};
    uint32_t a_hi[4], a_lo[4], b_hi[2], b_lo[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) split(a[e], a_hi[e], a_lo[e]);
    split(load_b(k0 + tq, g), b_hi[0], b_lo[0]);
    split(load_b(k0 + tq + 4, g), b_hi[1], b_lo[1]);
    mma_tf32_16x8x8(acc, a_lo, b_hi[0], b_hi[1]);
    mma_tf32_16x8x8(acc, a_hi, b_lo[0], b_lo[1]);
    mma_tf32_16x8x8(acc, a_hi, b_hi[0], b_hi[1]);
  }
}

// The inverses N_s = (M_ssᵀ)⁻¹ of the transposed 16×16 diagonal blocks of M = I + Diag(β)L into
// inverse [4][16, kLdInverse]: (M_ssᵀ)_jk = δ_jk + β_k L_kj is upper unit-triangular, so is N_s,
// column c by back substitution N_jc = −Σ_{j<k≤c} β_k L_kj N_kc. A thread per (sub-block, column):
// threads 0–63; the rest of the block goes on (the caller's next barrier publishes N).
__device__ __forceinline__ void diagonal_block_inverses(const float* lower, const float* beta_s,
                                                        float* inverse) {
  const int tid = threadIdx.x;
  if (tid >= kNumSubBlocks * kSubBlock) return;
  const int s = tid / kSubBlock, c = tid % kSubBlock, s0 = kSubBlock * s;
  float* n = inverse + s * kSubBlock * kLdInverse;  // N_s; column c is this thread's alone
  for (int j = kSubBlock - 1; j > c; --j) n[j * kLdInverse + c] = 0.0f;
  n[c * kLdInverse + c] = 1.0f;
  for (int j = c - 1; j >= 0; --j) {
    float sum = 0.0f;
    for (int k = j + 1; k <= c; ++k)
      sum += beta_s[s0 + k] * lower[(s0 + k) * kLdPair + s0 + j] * n[k * kLdInverse + c];
    n[j * kLdInverse + c] = -sum;
  }
}

// dR = M⁻ᵀ·dV' in place in d_value [C, ld] (width columns, a multiple of 8), sub-blocks bottom
// up: rhs_s = dV'_s − Σ_{i in later sub-blocks} β_i L_is dR_i (tf32, as the fused kernel), then
// dR_s = N_s·rhs_s (3×tf32). A warp owns whole 8-column tiles, so the rhs round trip through
// shared memory needs only the warp; one block barrier per sub-block. Starts after a barrier
// that published dV' and N; ends with one.
template <int kBlockWarps>
__device__ __forceinline__ void solve_with_inverses(float* d_value, int ld, int width,
                                                    const float* beta_s, const float* lower,
                                                    const float* inverse) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  for (int s = kNumSubBlocks - 1; s >= 0; --s) {
    const int s0 = kSubBlock * s;
    const float* n = inverse + s * kSubBlock * kLdInverse;
    for (int tile = warp; tile < width / 8; tile += kBlockWarps) {
      float* cols = d_value + 8 * tile;
      if (s < kNumSubBlocks - 1) {
        float acc[1][4];
        zero_tiles(acc);
        warp_mma<MmaPrecision::Tf32>(
            acc, 1, s0 + kSubBlock, kChunk,
            [&](int r, int i) { return beta_s[i] * lower[i * kLdPair + s0 + r]; },
            [&](int i, int nn) { return cols[i * ld + nn]; });
        for_each_element<1>(1, s0, 0,
                            [&](int, int e4, int j, int e) { cols[j * ld + e] -= acc[0][e4]; });
        __syncwarp();
      }
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      warp_mma_tf32x3(
          acc, 0, kSubBlock, [&](int r, int k) { return n[r * kLdInverse + k]; },
          [&](int k, int nn) { return cols[(s0 + k) * ld + nn]; });
      __syncwarp();  // every lane has read the rhs before any lane overwrites it
      *reinterpret_cast<float2*>(cols + (s0 + g) * ld + 2 * tq) = make_float2(acc[0], acc[1]);
      *reinterpret_cast<float2*>(cols + (s0 + g + 8) * ld + 2 * tq) = make_float2(acc[2], acc[3]);
    }
    __syncthreads();
  }
}

template <int kColGroups, int kStaticDims>
__global__ void __launch_bounds__(kNumSubBlocks* kColGroups * 32, 2)
    kda_chunk_grad_value_kernel(const uint16_t* k, const uint16_t* v, const uint16_t* g_in,
                                const uint16_t* beta_in, const uint16_t* d_o,
                                const int32_t* doc_start, float* dv, KdaDims d,
                                KdaForwardWorkspace ws, const float* d_states,
                                KdaSplitWorkspace split) {
  constexpr int kBlockWarps = kNumSubBlocks * kColGroups, kBlockThreads = 32 * kBlockWarps;
  constexpr int kTiles = 8 / kColGroups;  // 8-column tiles per warp: VH/groups/8, 64/groups/8
  // At K = V = 128 (and four column groups) dP_h moves from phase 1 to phase 3, beside dM_h:
  // both read V' as their right operand, so its pairs are loaded once (dO stays until then).
  constexpr bool kMixWithQueryKey = kStaticDims == 128 && kColGroups == 4;
  static_assert(!kMixWithQueryKey || 2 * kSlab * (64 + 4) * 4 <= kChunk * (128 + 8) * 2,
                "two S slabs in raw k's rows");
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // K = V = kStaticDims when > 0 (the common 128): the layout and every stride fold to
  // constants, which frees the registers that would hold them.
  const int KP = kStaticDims > 0 ? kStaticDims : d.KP, VP = kStaticDims > 0 ? kStaticDims : d.VP;
  const ValueLayout l = value_layout(KP, VP);
  const int ldk = l.ldk, ldr = l.ldr, ldh = l.ldh;
  float* gam = reinterpret_cast<float*>(shared_bytes + l.gamma);              // [C, ldk] Γ
  uint16_t* key_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.key_raw);  // [C, ldr]
  float* lower = reinterpret_cast<float*>(shared_bytes + l.lower);            // [C, kLdPair] L
  float* inverse = reinterpret_cast<float*>(shared_bytes + l.inverse);        // [4][16, 20] N_s
  float* d_value = reinterpret_cast<float*>(shared_bytes + l.d_value);        // [C, ldh] dV'→dR
  float* d_out_s = reinterpret_cast<float*>(shared_bytes + l.d_out);          // [C, ldh] dO
  float* beta_s = reinterpret_cast<float*>(shared_bytes + l.vectors);         // [C]
  float* key_inv = beta_s + kChunk;                                           // [C]
  int* seg = reinterpret_cast<int*>(key_inv + kChunk);                        // [C]
  float* beta_dots = key_inv + 2 * kChunk;  // [groups, C] dβ partials by column group

  const int tid = threadIdx.x, warp = tid >> 5;
  const int VH = VP / 2;
  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
  const int64_t ch = bh * d.num_chunks + n;
  const int half = blockIdx.z, e0 = half * VH;
  const int c_len = kda_chunk_length(d, n);
  const float* state = ws.states + ch * KP * VP;                      // [KP, VP] S
  const float* d_state = d_states + ch * KP * VP;                     // [KP, VP] dS'
  const float* value_new = ws.value_new + ch * kChunk * VP;           // [C, VP]  V'
  const float* key_to_end = ws.key_to_end + ch * kChunk * KP;         // [C, KP]  Ke
  const float* lower_qk = ws.lower_query_key + ch * kChunk * kChunk;  // [C, C]   P
  float* d_query_key_part = split.d_query_key + (2 * ch + half) * kChunk * kChunk;
  float* d_mix_part = split.d_mix + (2 * ch + half) * kChunk * kChunk;
  float* d_x = split.d_x + ch * kChunk * VP;
  auto token_row = [&](int i) { return kda_token_row(d, b, h, t0 + i); };
  const bool stamping = g_value_clock_on && blockIdx.y == 0 && blockIdx.z == 0 &&
                        blockIdx.x == gridDim.x / 2 && tid == 0;
  auto stamp = [&](int phase) {
    if (stamping) g_value_clock[phase] = clock64();
  };
  stamp(0);

  // ---- 0. L from the forward's workspace (cp.async, in flight during the rest); raw k (bf16
  // bits), g, β, segments, the block's half of dO (fp32, zero past the chunk end and V).
  {
    const float* lower_key_key = ws.lower_key_key + ch * kChunk * kChunk;
    for (int idx = tid; idx < kChunk * kChunk / 4; idx += kBlockThreads) {
      const int i = idx / (kChunk / 4), j = idx % (kChunk / 4) * 4;
      attention_detail::cp_async_16(lower + i * kLdPair + j, lower_key_key + i * kChunk + j, true);
    }
    attention_detail::cp_async_commit();
  }
  const bool rows_by_8 = kda_rows_by_8(d, k, k, g_in, d_o);
  // At K = V = 128 with 16-byte rows: every k, g and dO load of the thread issued before any
  // store (one round trip; the shared loaders' loops store after each load), and the half warp
  // that loads a k row reduces its squares for the inverse norm (no warp-per-row pass).
  const bool norms_in_rows = kStaticDims == 128 && rows_by_8;
  if (norms_in_rows) {
    constexpr int kHead = kStaticDims > 0 ? kStaticDims : 128;
    constexpr int kPerRow = kHead / 8, kPerRowOut = kHead / 2 / 8;  // 16-byte pieces
    constexpr int kRowSteps = kChunk * kPerRow / kBlockThreads;
    constexpr int kOutSteps = kChunk * kPerRowOut / kBlockThreads;
    static_assert(kChunk * kPerRowOut % kBlockThreads == 0 && kRowSteps >= 1);
    uint4 key_bits[kRowSteps], gate_bits[kRowSteps], out_bits[kOutSteps];
#pragma unroll
    for (int u = 0; u < kRowSteps; ++u) {
      const int idx = tid + u * kBlockThreads, i = idx / kPerRow, col = idx % kPerRow * 8;
      key_bits[u] = gate_bits[u] = make_uint4(0, 0, 0, 0);
      if (i < c_len && col < d.K) {
        const int64_t at = token_row(i) * d.K + col;
        key_bits[u] = *reinterpret_cast<const uint4*>(k + at);
        gate_bits[u] = *reinterpret_cast<const uint4*>(g_in + at);
      }
    }
#pragma unroll
    for (int u = 0; u < kOutSteps; ++u) {
      const int idx = tid + u * kBlockThreads, i = idx / kPerRowOut, e = idx % kPerRowOut * 8;
      out_bits[u] = make_uint4(0, 0, 0, 0);
      if (i < c_len && e0 + e < d.V)
        out_bits[u] = *reinterpret_cast<const uint4*>(d_o + token_row(i) * d.V + e0 + e);
    }
    if (tid < kChunk) beta_s[tid] = tid < c_len ? load_as_float(beta_in, token_row(tid)) : 0.0f;
    kda_chunk_segments(doc_start, d, b, t0, c_len, seg);
#pragma unroll
    for (int u = 0; u < kRowSteps; ++u) {
      const int idx = tid + u * kBlockThreads, i = idx / kPerRow, col = idx % kPerRow * 8;
      *reinterpret_cast<uint4*>(key_raw + i * ldr + col) = key_bits[u];
      kda_store_8_bf16_as_float(gam + i * ldk + col, gate_bits[u]);
      const uint32_t w[4] = {key_bits[u].x, key_bits[u].y, key_bits[u].z, key_bits[u].w};
      float sum = 0.0f;
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float lo = __uint_as_float(w[x] << 16), hi = __uint_as_float(w[x] & 0xffff0000u);
        sum += lo * lo + hi * hi;
      }
#pragma unroll
      for (int offset = kPerRow / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (col == 0) key_inv[i] = 1.0f / sqrtf(sum + kL2NormEps);
    }
#pragma unroll
    for (int u = 0; u < kOutSteps; ++u) {
      const int idx = tid + u * kBlockThreads, i = idx / kPerRowOut, e = idx % kPerRowOut * 8;
      kda_store_8_bf16_as_float(d_out_s + i * ldh + e, out_bits[u]);
    }
  } else {
    kda_stage_rows_bf16<kBlockThreads>(nullptr, k, g_in, d, b, h, t0, c_len, rows_by_8, nullptr,
                                       key_raw, ldr, gam, ldk);
    if (tid < kChunk) beta_s[tid] = tid < c_len ? load_as_float(beta_in, token_row(tid)) : 0.0f;
    kda_chunk_segments(doc_start, d, b, t0, c_len, seg);
    kda_stage_d_out_f32<kBlockThreads>(d_o, d, b, h, t0, c_len, rows_by_8, e0, VH, d_out_s, ldh);
  }
  attention_detail::cp_async_wait<0>();
  __syncthreads();
  stamp(1);
  // Inverse norms of k (warp per row), and Γ = cumsum g by kParts threads per column with its
  // rows in registers (a thread per column was a chain of 64 dependent shared round trips, with
  // three quarters of the block idle); the parts' totals pass through dV's buffer (free until
  // phase 1). Then Kd = K⊙e^Γ (segment 0, else 0) from the same registers, over Γ in place:
  // phase 3's A operand, which every column-group warp of a row block formed again per element.
  // Γ has no other reader here.
  if (!norms_in_rows)
    kda_inverse_norms_and_cumsum<kBlockThreads>(nullptr, key_raw, ldr, nullptr, ldk, d, nullptr,
                                                key_inv);
  {
    constexpr int kParts = kBlockThreads / kKdaCudaMaxHeadDim, kRows = kChunk / kParts;
    const int col = tid % KP, part = tid / KP;
    const bool scans = tid < kParts * KP;
    float* totals = d_value;  // [kParts, KP]
    float run[kRows];
    if (scans) {
      const float* column = gam + part * kRows * ldk + col;
#pragma unroll
      for (int r = 0; r < kRows; ++r) run[r] = column[r * ldk];
#pragma unroll
      for (int r = 1; r < kRows; ++r) run[r] += run[r - 1];
      totals[part * KP + col] = run[kRows - 1];
    }
    __syncthreads();  // totals; key_inv from the norms
    if (scans) {
      float offset = 0.0f;
      for (int p = 0; p < part; ++p) offset += totals[p * KP + col];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = part * kRows + r;
        gam[i * ldk + col] =
            seg[i] == 0 ? bf16_bits_to_float(key_raw[i * ldr + col]) * key_inv[i] *
                              __expf(run[r] + offset)
                        : 0.0f;
      }
    }
    __syncthreads();  // the totals are read before phase 1 writes dV' over them
  }
  stamp(2);
  diagonal_block_inverses(lower, beta_s, inverse);  // threads 0–63; phase 1's barrier publishes N

  // Warp tiles: rows 16·(warp/groups); [C, VH] outputs take the warp's group of the VH columns,
  // [C, C] outputs its group of the 64 columns.
  const int group = warp % kColGroups, r0 = 16 * (warp / kColGroups);
  const int tiles_v = VH / (8 * kColGroups), col0_v = group * tiles_v * 8;
  constexpr int tiles_c = kChunk / (8 * kColGroups);
  const int col0_c = group * tiles_c * 8;

  // ---- 1. dV' = Ke·dS' + Pᵀ·dO (tf32; Pᵀ is upper triangular: k from r0). dP_h = dO·V'ᵀ (bf16).
  // dS' [KP, VH] comes through shared memory in slabs, staged in dV's buffer (free until the
  // product's end); at K = 128, Ke [C, KP] with it in raw k's rows (dead since the norms and Γ;
  // too small for two [C, 32] slabs at smaller K).
  {
    float acc[kTiles][4];
    zero_tiles(acc);
    auto key_to_end_pair = [&](int r, int c) { return load_pair(key_to_end + (r0 + r) * KP + c); };
    if constexpr (kStaticDims == 128) {
      static_assert(2 * kChunk * kSlab * 4 <= kChunk * (128 + 8) * 2, "two Ke slabs in raw k's");
      row_slab_product<MmaPrecision::Tf32, kTiles, kBlockThreads, true>(
          acc, tiles_v, col0_v, KP, d_state + e0, VP, VH, d_value, key_to_end_pair, key_to_end, KP,
          r0, reinterpret_cast<float*>(key_raw));
    } else {
      row_slab_product<MmaPrecision::Tf32, kTiles, kBlockThreads>(
          acc, tiles_v, col0_v, KP, d_state + e0, VP, VH, d_value, key_to_end_pair);
    }
    warp_mma<MmaPrecision::Tf32>(
        acc, tiles_v, r0, kChunk, [&](int r, int j) { return lower_qk[j * kChunk + r0 + r]; },
        [&](int j, int nn) { return d_out_s[j * ldh + col0_v + nn]; });
    for_each_element<kTiles>(tiles_v, r0, col0_v, [&](int j, int e4, int i, int e) {
      d_value[i * ldh + e] = acc[j][e4];
    });
  }
  if constexpr (!kMixWithQueryKey) {
    float acc[tiles_c][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Bf16>(
        acc, tiles_c, 0, VH, [&](int r, int e) { return load_pair(d_out_s + (r0 + r) * ldh + e); },
        [&](int e, int nn) { return load_pair(value_new + (col0_c + nn) * VP + e0 + e); });
    store_tiles(acc, tiles_c, r0, col0_c, d_query_key_part, kChunk, 1.0f);
  }
  __syncthreads();
  stamp(3);

  // ---- 2. dR = M⁻ᵀ·dV' over the block's columns (solve_with_inverses).
  solve_with_inverses<kBlockWarps>(d_value, ldh, VH, beta_s, lower, inverse);
  stamp(4);

  // ---- 3. dM_h = −dR·V'ᵀ (tf32) and its Σ_j L_ij·dM_ij; rowdot(dR, X) with X = V − Kd·S.
  float beta_dot[2] = {0.0f, 0.0f};  // this lane's rows r0 + g, r0 + g + 8
  {
    float acc[tiles_c][4];
    zero_tiles(acc);
    if constexpr (kMixWithQueryKey) {
      // dP_h = dO·V'ᵀ (bf16) beside dM_h, both against V' [C, VP] from global memory: each pair
      // of V' is loaded once for the bf16 k16 step and the two tf32 k8 steps it spans.
      float acc_query_key[tiles_c][4];
      zero_tiles(acc_query_key);
      const int lane = tid & 31, g = lane >> 2, tq = lane & 3;
      for (int k0 = 0; k0 < VH; k0 += 16) {
        const int k = k0 + 2 * tq;
        const float* o_top = d_out_s + (r0 + g) * ldh + k;
        const float* r_top = d_value + (r0 + g) * ldh + k;
        const float2 o0 = load_pair(o_top), o1 = load_pair(o_top + 8 * ldh),
                     o2 = load_pair(o_top + 8), o3 = load_pair(o_top + 8 * ldh + 8);
        const float2 r0v = load_pair(r_top), r1v = load_pair(r_top + 8 * ldh),
                     r2v = load_pair(r_top + 8), r3v = load_pair(r_top + 8 * ldh + 8);
        const uint32_t a_out[4] = {pack_bf16(o0.x, o0.y), pack_bf16(o1.x, o1.y),
                                   pack_bf16(o2.x, o2.y), pack_bf16(o3.x, o3.y)};
        const uint32_t a_r0[4] = {to_tf32(r0v.x), to_tf32(r1v.x), to_tf32(r0v.y), to_tf32(r1v.y)};
        const uint32_t a_r1[4] = {to_tf32(r2v.x), to_tf32(r3v.x), to_tf32(r2v.y), to_tf32(r3v.y)};
#pragma unroll
        for (int j = 0; j < tiles_c; ++j) {
          const float* b = value_new + (col0_c + 8 * j + g) * VP + e0 + k;
          const float2 b0 = load_pair(b), b1 = load_pair(b + 8);
          mma_bf16_16x8x16(acc_query_key[j], a_out, pack_bf16(b0.x, b0.y), pack_bf16(b1.x, b1.y));
          mma_tf32_16x8x8(acc[j], a_r0, to_tf32(b0.x), to_tf32(b0.y));
          mma_tf32_16x8x8(acc[j], a_r1, to_tf32(b1.x), to_tf32(b1.y));
        }
      }
      store_tiles(acc_query_key, tiles_c, r0, col0_c, d_query_key_part, kChunk, 1.0f);
    } else {
      warp_mma_pairs<MmaPrecision::Tf32>(
          acc, tiles_c, 0, VH,
          [&](int r, int e) { return load_pair(d_value + (r0 + r) * ldh + e); },
          [&](int e, int nn) { return load_pair(value_new + (col0_c + nn) * VP + e0 + e); });
    }
    store_tiles(acc, tiles_c, r0, col0_c, d_mix_part, kChunk, -1.0f);
    for_each_element<tiles_c>(tiles_c, r0, col0_c, [&](int j, int e4, int i, int jj) {
      if (jj < i && seg[i] == seg[jj]) beta_dot[e4 >> 1] -= lower[i * kLdPair + jj] * acc[j][e4];
    });
  }
  {
    // S [KP, VH] through shared memory in slabs, staged in raw k's rows (dead since phase 1;
    // [C, 136] bf16 holds two [32, 68] fp32 slabs at K = V = 128) when dO is still read just
    // above, else in dO's buffer (dead since phase 1).
    float acc[kTiles][4];
    zero_tiles(acc);
    row_slab_product<MmaPrecision::Tf32, kTiles, kBlockThreads>(
        acc, tiles_v, col0_v, KP, state + e0, VP, VH,
        kMixWithQueryKey ? reinterpret_cast<float*>(key_raw) : d_out_s,
        [&](int r, int c) { return load_pair(gam + (r0 + r) * ldk + c); });  // Kd
    for_each_element<kTiles>(tiles_v, r0, col0_v, [&](int j, int e4, int i, int e) {
      const int column = e0 + e;
      const float value =
          (i < c_len && column < d.V) ? load_as_float(v, token_row(i) * d.V + column) : 0.0f;
      beta_dot[e4 >> 1] += (value - acc[j][e4]) * d_value[i * ldh + e];
    });
  }
  store_row_dots(beta_dot, r0, beta_dots + group * kChunk);
  __syncthreads();
  stamp(5);

  // ---- 4. dβ partial; dX = β·dR to the workspace (the key kernel's dKd) and into dv.
  if (tid < kChunk) {
    float sum = beta_dots[tid];
#pragma unroll
    for (int p = 1; p < kColGroups; ++p) sum += beta_dots[p * kChunk + tid];
    split.d_beta[(2 * ch + half) * kChunk + tid] = sum;
  }
  if (d.V % 4 == 0 && (reinterpret_cast<uintptr_t>(dv) & 15) == 0) {
    // 16 bytes a thread and step (VH % 4 == 0; dX rows VP floats, dv rows V floats).
    const int per_row = VH / 4;
    for (int idx = tid; idx < kChunk * per_row; idx += kBlockThreads) {
      const int i = idx / per_row, e = idx % per_row * 4;
      const float beta_i = beta_s[i];
      float4 x = *reinterpret_cast<const float4*>(d_value + i * ldh + e);
      x = make_float4(beta_i * x.x, beta_i * x.y, beta_i * x.z, beta_i * x.w);
      *reinterpret_cast<float4*>(d_x + i * VP + e0 + e) = x;
      if (i < c_len && e0 + e < d.V) {
        float4* out = reinterpret_cast<float4*>(dv + token_row(i) * d.V + e0 + e);
        if (split.accumulate) {
          const float4 y = *out;
          x = make_float4(y.x + x.x, y.y + x.y, y.z + x.z, y.w + x.w);
        }
        *out = x;
      }
    }
  } else {
    for (int idx = tid; idx < kChunk * VH; idx += kBlockThreads) {
      const int i = idx / VH, e = idx % VH;
      const float d_x_value = beta_s[i] * d_value[i * ldh + e];
      d_x[i * VP + e0 + e] = d_x_value;
      if (i < c_len && e0 + e < d.V) {
        float* out = dv + token_row(i) * d.V + e0 + e;
        *out = split.accumulate ? *out + d_x_value : d_x_value;
      }
    }
  }
  stamp(6);
}

}  // namespace

size_t kda_chunk_grad_value_shared_bytes(const KdaDims& d) {
  return size_t(value_layout(d.KP, d.VP).total);
}

void kda_value_phase_clock(bool enable) { phase_clock_enable(g_value_clock_on, enable); }
int kda_value_phase_cycles(long long* cycles, const char** names, int max_phases) {
  return phase_clock_read(g_value_clock, kValuePhaseNames, cycles, names, max_phases);
}

void kda_chunk_grad_value_launch(const uint16_t* k, const uint16_t* v, const uint16_t* g,
                                 const uint16_t* beta, const uint16_t* d_o,
                                 const int32_t* doc_start, float* dv, const KdaDims& d,
                                 const KdaForwardWorkspace& ws, const float* d_states,
                                 const KdaSplitWorkspace& split, cudaStream_t stream) {
  DM_CHECK(kda_split_supported(d),
           "kda stage 4 (split): needs KP % 32 == 0, KP <= 128 and VP % 32 == 0");
  const int shared = value_layout(d.KP, d.VP).total;
  launch_stage4_split_kernel(kda_chunk_grad_value_kernel<2, 0>,
                             kda_chunk_grad_value_kernel<4, kKdaStaticDims>,
                             kda_chunk_grad_value_kernel<4, 0>, d.VP / 2, d, shared, stream, k, v,
                             g, beta, d_o, doc_start, dv, d, ws, d_states, split);
  check_last_error("cuda kda_chunk_backward (stage 4, value kernel)");
}

}  // namespace dm::cuda::kda_detail
