// Stage 4 of the chunked KDA backward on tensor cores (bf16 inputs; kda_backward_detail.cuh).
// Same algebra as the reference stage 4 (kda_chunk_grad_kernel in kda_chunk_backward.cu, i.e.
// kda_piece_backward steps 1–6 of ops/cpu/kda_backward.cpp on masked chunks), reorganised so
// that every chunk-level product is an mma.sync and every operand that is computed in the kernel
// stays in shared memory. Grid: num_chunks × B·H, one chunk-head per block, 256 threads.
//
// Stages of one block (C = 64 tokens, sub-blocks of 16; s = sub-block of a row):
//   0. rows: raw q, k (bf16), Γ = cumsum g, β, 1/‖q‖, 1/‖k‖, segments; dγ = e^γ ⊙ rowsum(S⊙dS');
//      L (β-free, strictly lower, same segment): across sub-blocks t < s as one [16×16]·K product
//      per (s,t) through the first token b = 16(t+1) after sub-block t,
//        e^{Γ_i−Γ_j} = e^{Γ_i−Γ_b}·e^{Γ_b−Γ_j}   (i ≥ b > j: both exponents ≤ 0),
//      inside a sub-block one exp per pair and channel.
//   1. value side: dV' = Ke·dS' + Pᵀ·dO; dP = dO·V'ᵀ; dR = M⁻ᵀ·dV' (M = I + Diag(β)L) by blocked
//      back substitution (16×16 diagonal blocks on CUDA cores, the rest as mma); dM = −dR·V'ᵀ;
//      dβ = rowdot(dR, X) with X = V − Kd·S formed in registers; dL = β·dM; dX = β·dR; dv += dX.
//   2. key side, per warp a fixed [16 rows × KP/2 channels] tile held in registers across stages
//      2–3 (dq̂, dk̂ and dΓ accumulators): dQd = dO·Sᵀ, dKd = −dX·Sᵀ, dKe = V'·dS'ᵀ with their
//      decays applied in the epilogue.
//   3. pairwise sums of dL and dP: across sub-blocks as [16×16]·[16×KP] products of three
//      per-token matrices with every exponent ≤ 0,
//        rows    Σ_{j∈t<s} w_ij k̂_j e^{Γ_i−Γ_j} = e^{Γ_i−Γ_b} ⊙ Σ_j w_ij F_j,
//                F_j = k̂_j e^{Γ_b−Γ_j},  b = 16(t+1) (first token after j's sub-block);
//        columns Σ_{l∈u>s} w_li k̂_l e^{Γ_l−Γ_i} = e^{Γ_a−Γ_i} ⊙ Σ_l w_li G_l,
//                G_l = k̂_l e^{Γ_l−Γ_a},  a = 16u (first token of l's sub-block; i < a ≤ l),
//        (and G^q_l = q̂_l e^{Γ_l−Γ_a} for the dP column sums); inside a sub-block one exp per
//      pair and channel (≤ 15 per element).
//   4. dg: reverse cumsum of dΓ per channel (restarting at document starts) seeded with dγ,
//      plus the exclusive forward prefix of E = dKe⊙Ke (zero outside the last segment, like Ke;
//      recomputed here into a free slot: total − suffix would cancel); dq, dk through the L2
//      norm; dβ.
//
// Precision, per product (tolerance: 1e-2 relative RMS against the double CPU reference):
//   bf16 m16n8k16 where one operand is the bf16 input dO (exact in bf16, so only the other
//   operand is rounded, once): dP = dO·V'ᵀ, dQd = dO·Sᵀ;
//   tf32 m16n8k8 everywhere else: X = V − Kd·S (a residual that the delta rule drives towards
//   zero: cancellation), dV' = Ke·dS' + Pᵀ·dO and dM = −dR·V'ᵀ (roots of the triangular solve,
//   dβ and dL), dKd, dKe (both operands rounded), L (feeds the solve) and the pairwise products
//   (their contributions to dΓ sum to zero over a chunk, so dg near a chunk start is a
//   difference of large terms). Operands are fp32 in shared or global memory and converted per
//   fragment; the kernel is bound by operand traffic, not by mma throughput, so tf32's halved
//   rate costs nothing measurable.
//
// Shared memory (KP = VP = 128): Γ [64,KP+4] fp32, raw q, k [64,KP+8] bf16, dP, dM/dL, L
// [64,68] fp32, three [64, max(KP,VP)+4] fp32 slots (Kd → F → dΓ; dV'/dR/dX → G; dO → G^q) and
// vectors: ≈ 220 KB, one block per SM. Operands produced by earlier stages (S, dS', V', Ke, P)
// are read from the workspace (L2) directly into fragments, as k-adjacent pairs (one 8-byte
// load, warp_mma_pairs) wherever they are stored k-contiguous; dO is read once into slot c.
// The last phase stages dq in slot c and dk in the three [C, C] matrices (dead by then), so one
// coalesced pass adds dg, dq, dk to global memory. `bench_cuda_kda --phases` prints the cycles
// of each phase of one block (the phase clock below).
#include <algorithm>

#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_common.cuh"
#include "ops/cuda/kda_mma.cuh"
#include "ops/cuda/kda_stage4_mma.cuh"

namespace dm::cuda {
namespace kda_detail {
namespace {

constexpr int kMaxTiles = 8;         // 8-column mma tiles per warp (64 columns)

// Byte offsets of the shared buffers (each a multiple of 16 bytes).
struct TcGradLayout {
  int ldk;   // fp32 [C, KP] rows: KP + 4
  int ldr;   // bf16 raw q, k rows: KP + 8
  int ldw;   // fp32 slot rows: max(KP, VP) + 4
  int gamma, query_raw, key_raw, d_lower_query_key, d_lower_key_key, lower_key_key;
  int slot_a, slot_b, slot_c, vectors, total;
};
constexpr int kVectorFloats = 8 * kChunk + 2 * kKdaCudaMaxHeadDim;

// Phase clock (diagnostics, bench_cuda_kda --phases): SM cycle stamps at the phase boundaries,
// taken by thread 0 of one block (the middle chunk of the first batch-head) while enabled.
constexpr int kPhaseStamps = 15;
__device__ int g_phase_clock_on;
__device__ long long g_phase_clock[kPhaseStamps];
const char* const kPhaseNames[kPhaseStamps] = {
    "start", "rows, dO, dgamma", "norms, Gamma cumsum", "L, Kd", "dV', dP", "dR solve",
    "dM, X, dbeta", "dL, dX, dv", "dQd, dKd, dKe", "F, G, Gq", "pairwise sums", "dGamma, dots",
    "E", "dg scans", "dg, dq, dk writes"};

__host__ __device__ inline TcGradLayout tc_grad_layout(const KdaDims& d) {
  TcGradLayout l;
  l.ldk = d.KP + 4;
  l.ldr = d.KP + 8;
  l.ldw = (d.KP > d.VP ? d.KP : d.VP) + 4;
  auto round16 = [](int bytes) { return (bytes + 15) / 16 * 16; };
  int at = 0;
  l.gamma = at;             at += round16(kChunk * l.ldk * 4);
  l.query_raw = at;         at += round16(kChunk * l.ldr * 2);
  l.key_raw = at;           at += round16(kChunk * l.ldr * 2);
  l.d_lower_query_key = at; at += round16(kChunk * kLdPair * 4);
  l.d_lower_key_key = at;   at += round16(kChunk * kLdPair * 4);
  l.lower_key_key = at;     at += round16(kChunk * kLdPair * 4);
  l.slot_a = at;            at += round16(kChunk * l.ldw * 4);
  l.slot_b = at;            at += round16(kChunk * l.ldw * 4);
  l.slot_c = at;            at += round16(kChunk * l.ldw * 4);
  l.vectors = at;           at += kVectorFloats * 4;
  l.total = at;
  return l;
}

__global__ void __launch_bounds__(kThreads, 1)
    kda_chunk_grad_tc_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const uint16_t* g_in, const uint16_t* beta_in, const uint16_t* d_o,
                             const int32_t* doc_start, float* dq, float* dk, float* dv,
                             float* dg, float* dbeta, KdaDims d, KdaForwardWorkspace ws,
                             const float* d_states) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const TcGradLayout l = tc_grad_layout(d);
  const int ldk = l.ldk, ldr = l.ldr, ldw = l.ldw;
  float* gam = reinterpret_cast<float*>(shared_bytes + l.gamma);                  // [C, ldk] Γ
  uint16_t* query_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.query_raw);  // [C, ldr]
  uint16_t* key_raw = reinterpret_cast<uint16_t*>(shared_bytes + l.key_raw);      // [C, ldr]
  float* d_pqk = reinterpret_cast<float*>(shared_bytes + l.d_lower_query_key);    // [C, 68] dP
  float* d_lkk = reinterpret_cast<float*>(shared_bytes + l.d_lower_key_key);      // [C, 68] dM→dL
  float* lower = reinterpret_cast<float*>(shared_bytes + l.lower_key_key);        // [C, 68] L
  float* slot_a = reinterpret_cast<float*>(shared_bytes + l.slot_a);  // [C, ldw] Kd → F → dΓ
  float* slot_b = reinterpret_cast<float*>(shared_bytes + l.slot_b);  // [C, ldw] dV'/dR/dX → G
  float* slot_c = reinterpret_cast<float*>(shared_bytes + l.slot_c);  // [C, ldw] G^q
  float* vec = reinterpret_cast<float*>(shared_bytes + l.vectors);
  float* beta_s = vec;                       // [C]
  float* query_inv = beta_s + kChunk;        // [C]
  float* key_inv = query_inv + kChunk;       // [C]
  int* seg = reinterpret_cast<int*>(key_inv + kChunk);  // [C]
  float* diag_pqk = key_inv + 2 * kChunk;    // [C]  diagonal of dP
  float* d_beta_s = diag_pqk + kChunk;       // [C]
  float* dot_query = d_beta_s + kChunk;      // [C]  q·dq̂ per row
  float* dot_key = dot_query + kChunk;       // [C]
  float* d_gamma_last = dot_key + kChunk;    // [KP] e^γ ⊙ rowsum(S ⊙ dS')

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KP = d.KP, VP = d.VP;
  const int64_t n = blockIdx.x, bh = blockIdx.y, b = bh / d.H, h = bh % d.H, t0 = n * kChunk;
  const int64_t ch = bh * d.num_chunks + n;
  const int c_len = kda_chunk_length(d, n);
  const bool stamping = g_phase_clock_on && blockIdx.y == 0 && blockIdx.x == gridDim.x / 2 && tid == 0;
  auto stamp = [&](int phase) {
    if (stamping) g_phase_clock[phase] = clock64();
  };
  stamp(0);
  const float* state = ws.states + ch * KP * VP;            // [KP, VP] S
  const float* d_state = d_states + ch * KP * VP;           // [KP, VP] dS'
  const float* value_new = ws.value_new + ch * kChunk * VP; // [C, VP]  V'
  const float* key_to_end = ws.key_to_end + ch * kChunk * KP;  // [C, KP] Ke
  const float* lower_qk = ws.lower_query_key + ch * kChunk * kChunk;  // [C, C] P
  const float* decay_whole = ws.decay_whole + ch * KP;

  auto token_row = [&](int i) { return kda_token_row(d, b, h, t0 + i); };
  auto key_hat = [&](int i, int c) { return bf16_bits_to_float(key_raw[i * ldr + c]) * key_inv[i]; };
  auto query_hat = [&](int i, int c) {
    return bf16_bits_to_float(query_raw[i * ldr + c]) * query_inv[i] * d.scale;
  };
  auto gamma_at = [&](int i, int c) { return gam[i * ldk + c]; };
  // Adjacent channel pairs (c even): (k̂[i][c], k̂[i][c+1]) from one 4-byte load, and Γ likewise.
  auto key_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(key_raw + i * ldr + c);
    const float inv = key_inv[i];
    return make_float2(__uint_as_float(bits << 16) * inv, __uint_as_float(bits & 0xffff0000u) * inv);
  };
  auto gamma2 = [&](int i, int c) { return load_pair(gam + i * ldk + c); };
  auto query_hat2 = [&](int i, int c) {
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(query_raw + i * ldr + c);
    const float inv = query_inv[i] * d.scale;
    return make_float2(__uint_as_float(bits << 16) * inv, __uint_as_float(bits & 0xffff0000u) * inv);
  };
  // dO of the chunk, fp32 in slot c (free until stage 3), zero past the chunk end and V.
  float* d_out_s = slot_c;
  auto d_out = [&](int i, int e) { return d_out_s[i * ldw + e]; };

  // ---- 0. Raw q, k (bf16 bits), raw g and β, block-wide and coalesced (one round trip for the
  // chunk); zero past the chunk end and K. The inverse norms follow after the barrier. Rows go
  // 8 elements (16 bytes) per load when K, V and the pointers allow it (the usual case).
  const bool rows_by_8 = kda_rows_by_8(d, q, k, g_in, d_o);
  kda_stage_rows_bf16(q, k, g_in, d, b, h, t0, c_len, rows_by_8, query_raw, key_raw, ldr, gam, ldk);
  if (tid < kChunk) {
    beta_s[tid] = tid < c_len ? load_as_float(beta_in, token_row(tid)) : 0.0f;
    d_beta_s[tid] = 0.0f;
    dot_query[tid] = 0.0f;
    dot_key[tid] = 0.0f;
  }
  kda_chunk_segments(doc_start, d, b, t0, c_len, seg);
  // dO read once, row-coalesced (the products below read it from shared memory).
  kda_stage_d_out_f32(d_o, d, b, h, t0, c_len, rows_by_8, 0, VP, d_out_s, ldw);
  // L: the diagonal and above are zero (the lower part is written below, disjointly).
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    if (j >= i) lower[i * kLdPair + j] = 0.0f;
  }
  // dγ = e^γ ⊙ rowsum(S ⊙ dS') (warp per state row, 16-byte loads over the columns; VP is a
  // multiple of 16 and the workspace rows are 16-byte aligned). Unrolled over rows so that
  // several rows' loads are in flight at once.
#pragma unroll 4
  for (int col = warp; col < KP; col += kWarps) {
    float dot = 0.0f;
    for (int e = 4 * lane; e < VP; e += 128) {
      const float4 a = *reinterpret_cast<const float4*>(state + col * VP + e);
      const float4 b4 = *reinterpret_cast<const float4*>(d_state + col * VP + e);
      dot += a.x * b4.x + a.y * b4.y + a.z * b4.z + a.w * b4.w;
    }
    dot = warp_sum(dot);
    if (lane == 0) d_gamma_last[col] = decay_whole[col] * dot;
  }
  __syncthreads();
  stamp(1);

  // Inverse L2 norms (warp per row, from the staged bf16 rows) and Γ = cumsum g (by column).
  kda_inverse_norms_and_cumsum(query_raw, key_raw, ldr, gam, ldk, d, query_inv, key_inv);
  __syncthreads();
  stamp(2);
  const int last_segment = seg[kChunk - 1];

  // ---- 0'. L (kda_stage4_mma.cuh).
  kda_stage4_lower(key_raw, ldr, key_inv, gam, ldk, seg, KP, lower);
  // Kd = K⊙e^Γ for segment 0 (slot a).
  float* key_decay = slot_a;
  for (int idx = tid; idx < kChunk * KP; idx += kThreads) {
    const int i = idx / KP, c = idx % KP;
    key_decay[i * ldw + c] = seg[i] == 0 ? key_hat(i, c) * __expf(gamma_at(i, c)) : 0.0f;
  }
  __syncthreads();
  stamp(3);

  // Warp tiles over [C, VP] and [C, C] outputs: rows 16·(warp/2), the warp's half of the columns.
  const int row_block = warp >> 1, r0 = 16 * row_block;
  const int tiles_v = VP / 16, col0_v = (warp & 1) * tiles_v * 8;
  const int col0_c = (warp & 1) * 32;
  float* d_value = slot_b;  // [C, ldw] dV', then dR, then dX

  // ---- 1. dV' = Ke·dS' + Pᵀ·dO (tf32; Pᵀ is upper triangular: k from r0). dP = dO·V'ᵀ (bf16).
  {
    float acc[kMaxTiles][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Tf32>(
        acc, tiles_v, 0, KP, [&](int r, int c) { return load_pair(key_to_end + (r0 + r) * KP + c); },
        [&](int c, int nn) {
          return make_float2(d_state[c * VP + col0_v + nn], d_state[(c + 1) * VP + col0_v + nn]);
        });
    warp_mma<MmaPrecision::Tf32>(
        acc, tiles_v, r0, kChunk, [&](int r, int j) { return lower_qk[j * kChunk + r0 + r]; },
        [&](int j, int nn) { return d_out(j, col0_v + nn); });
    for_each_element<kMaxTiles>(tiles_v, r0, col0_v, [&](int j, int e4, int i, int e) {
      d_value[i * ldw + e] = acc[j][e4];
    });
  }
  {
    float acc[4][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Bf16>(
        acc, 4, 0, VP, [&](int r, int e) { return load_pair(d_out_s + (r0 + r) * ldw + e); },
        [&](int e, int nn) { return load_pair(value_new + (col0_c + nn) * VP + e); });
    for_each_element<4>(4, r0, col0_c, [&](int j, int e4, int i, int jj) {
      d_pqk[i * kLdPair + jj] = acc[j][e4];
    });
  }
  __syncthreads();
  stamp(4);
  // dP keeps its strictly lower same-segment part; the diagonal enters dq̂, dk̂ only.
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    if (i == j) diag_pqk[i] = d_pqk[i * kLdPair + j];
    if (!(j < i && seg[i] == seg[j])) d_pqk[i * kLdPair + j] = 0.0f;
  }

  // dR = M⁻ᵀ·dV', M = I + Diag(β)L (kda_stage4_mma.cuh; the masking pass above touches dP only).
  kda_stage4_solve(d_value, ldw, VP, beta_s, lower);
  stamp(5);

  // dM = −dR·V'ᵀ (tf32); dβ_i = dR_i·X_i with X = V − Kd·S (tf32) formed in registers.
  {
    float acc[4][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Tf32>(
        acc, 4, 0, VP, [&](int r, int e) { return load_pair(d_value + (r0 + r) * ldw + e); },
        [&](int e, int nn) { return load_pair(value_new + (col0_c + nn) * VP + e); });
    for_each_element<4>(4, r0, col0_c, [&](int j, int e4, int i, int jj) {
      d_lkk[i * kLdPair + jj] = -acc[j][e4];
    });
  }
  {
    float acc[kMaxTiles][4];
    zero_tiles(acc);
    warp_mma_pairs<MmaPrecision::Tf32>(
        acc, tiles_v, 0, KP, [&](int r, int c) { return load_pair(key_decay + (r0 + r) * ldw + c); },
        [&](int c, int nn) {
          return make_float2(state[c * VP + col0_v + nn], state[(c + 1) * VP + col0_v + nn]);
        });
    float row_dot[2] = {0.0f, 0.0f};
    for_each_element<kMaxTiles>(tiles_v, r0, col0_v, [&](int j, int e4, int i, int e) {
      const float value = (i < c_len && e < d.V) ? load_as_float(v, token_row(i) * d.V + e) : 0.0f;
      row_dot[e4 >> 1] += (value - acc[j][e4]) * d_value[i * ldw + e];
    });
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float x = row_dot[half];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      if (tq == 0) atomicAdd(&d_beta_s[r0 + g + 8 * half], x);
    }
  }
  __syncthreads();
  stamp(6);

  // dβ_i += Σ_j L_ij·dM_ij; dL_ij = β_i·dM_ij (j < i, same segment); dX = β·dR; dv += dX.
  for (int i = warp; i < kChunk; i += kWarps) {
    float dot = 0.0f;
    for (int j = lane; j < kChunk; j += 32) {
      const float d_m = d_lkk[i * kLdPair + j];
      const bool structural = j < i && seg[i] == seg[j];
      dot += structural ? lower[i * kLdPair + j] * d_m : 0.0f;
      d_lkk[i * kLdPair + j] = structural ? beta_s[i] * d_m : 0.0f;
    }
    dot = warp_sum(dot);
    if (lane == 0) d_beta_s[i] += dot;
    const int64_t row = token_row(i);
    for (int e = lane; e < VP; e += 32) {
      const float d_x = beta_s[i] * d_value[i * ldw + e];
      d_value[i * ldw + e] = d_x;
      if (i < c_len && e < d.V) dv[row * d.V + e] += d_x;
    }
  }
  __syncthreads();
  stamp(7);

  // ---- 2. Key side. Warp tile: rows r0..r0+15, channels col0_k + [0, 8·tiles_k), kept in
  // registers through stage 3: dq̂ (acc_q), dk̂ (acc_k), dΓ (acc_gamma).
  const int tiles_k = KP / 16, col0_k = (warp & 1) * tiles_k * 8;
  float acc_q[kMaxTiles][4], acc_k[kMaxTiles][4], acc_gamma[kMaxTiles][4];
  zero_tiles(acc_q);
  zero_tiles(acc_k);
  zero_tiles(acc_gamma);
  {
    float acc[kMaxTiles][4];
    // L (lower) and Kd (slot a) are dead since stage 1, and F is written only after this
    // stage: the two contiguous buffers hold the slabs of S and dS' (key_side_product).
    float* slabs = nullptr;
    if (VP % kSlab == 0 && 2 * KP * kSlabLd * 4 <= l.slot_b - l.lower_key_key)
      slabs = reinterpret_cast<float*>(shared_bytes + l.lower_key_key);
    // dQd = dO·Sᵀ (bf16: dO exact).
    zero_tiles(acc);
    key_side_product<MmaPrecision::Bf16>(
        acc, tiles_k, col0_k, 0, KP, VP, state, slabs,
        [&](int r, int e) { return load_pair(d_out_s + (r0 + r) * ldw + e); });
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_from_start = seg[i] == 0 ? __expf(gamma_at(i, c)) : 0.0f;
      const float value = acc[j][e4] * decay_from_start;
      acc_q[j][e4] += value;
      acc_gamma[j][e4] += value * query_hat(i, c);
    });
    // dKd = −dX·Sᵀ (tf32).
    zero_tiles(acc);
    key_side_product<MmaPrecision::Tf32>(
        acc, tiles_k, col0_k, 0, KP, VP, state, slabs,
        [&](int r, int e) { return load_pair(d_value + (r0 + r) * ldw + e); });
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_from_start = seg[i] == 0 ? __expf(gamma_at(i, c)) : 0.0f;
      const float value = -acc[j][e4] * decay_from_start;
      acc_k[j][e4] += value;
      acc_gamma[j][e4] += value * key_hat(i, c);
    });
    // dKe = V'·dS'ᵀ (tf32): dk̂ += dKe ⊙ e^{γ−Γ} (last segment). E = dKe ⊙ Ke enters dg as an
    // exclusive FORWARD prefix (the reference's); it is recomputed in stage 4, because folding it
    // into the reverse cumsum as total − suffix cancels: under strong decay E is O(1) at the
    // chunk end while dg there is tiny (that form was off by 0.36 relative in the test).
    zero_tiles(acc);
    key_side_product<MmaPrecision::Tf32>(
        acc, tiles_k, col0_k, 0, KP, VP, d_state, slabs,
        [&](int r, int e) { return load_pair(value_new + (r0 + r) * VP + e); });
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_to_end =
          seg[i] == last_segment ? __expf(gamma_at(kChunk - 1, c) - gamma_at(i, c)) : 0.0f;
      acc_k[j][e4] += acc[j][e4] * decay_to_end;
    });
  }
  __syncthreads();  // Kd and dX are dead: slots a, b, c take F, G, G^q
  stamp(8);

  // ---- 3. Pairwise sums of dL and dP.
  float* f_key = slot_a;    // F_j = k̂_j e^{Γ_b − Γ_j}, b = first token after j's sub-block
  float* g_key = slot_b;    // G_l = k̂_l e^{Γ_l − Γ_a}, a = first token of l's sub-block
  float* g_query = slot_c;  // G^q_l = q̂_l e^{Γ_l − Γ_a}
  for (int idx = tid; idx < kChunk * KP; idx += kThreads) {
    const int i = idx / KP, c = idx % KP, t = i / kSubBlock;
    const float gamma_i = gamma_at(i, c);
    const int after = kSubBlock * (t + 1), start = kSubBlock * t;
    f_key[i * ldw + c] = t < kNumSubBlocks - 1 ? key_hat(i, c) * __expf(gamma_at(after, c) - gamma_i) : 0.0f;
    const float from_start = t > 0 ? __expf(gamma_i - gamma_at(start, c)) : 0.0f;
    g_key[i * ldw + c] = key_hat(i, c) * from_start;
    g_query[i * ldw + c] = query_hat(i, c) * from_start;
  }
  __syncthreads();
  stamp(9);
  {
    // Diagonal of dP: dq̂_i += dP_ii k̂_i, dk̂_i += dP_ii q̂_i (its dΓ terms cancel).
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      acc_q[j][e4] += diag_pqk[i] * key_hat(i, c);
      acc_k[j][e4] += diag_pqk[i] * query_hat(i, c);
    });
    float acc[kMaxTiles][4];
    // Rows: earlier sub-blocks t < s.
    for (int t = 0; t < row_block; ++t) {
      const int j0 = kSubBlock * t, after = kSubBlock * (t + 1);
      zero_tiles(acc);
      warp_mma<MmaPrecision::Tf32>(
          acc, tiles_k, j0, j0 + kSubBlock, [&](int r, int j) { return d_lkk[(r0 + r) * kLdPair + j]; },
          [&](int j, int nn) { return f_key[j * ldw + col0_k + nn]; });
      for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
        const float row_lower = acc[j][e4] * __expf(gamma_at(i, c) - gamma_at(after, c));
        acc_k[j][e4] += row_lower;
        acc_gamma[j][e4] += key_hat(i, c) * row_lower;
      });
      zero_tiles(acc);
      warp_mma<MmaPrecision::Tf32>(
          acc, tiles_k, j0, j0 + kSubBlock, [&](int r, int j) { return d_pqk[(r0 + r) * kLdPair + j]; },
          [&](int j, int nn) { return f_key[j * ldw + col0_k + nn]; });
      for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
        const float row_query_key = acc[j][e4] * __expf(gamma_at(i, c) - gamma_at(after, c));
        acc_q[j][e4] += row_query_key;
        acc_gamma[j][e4] += query_hat(i, c) * row_query_key;
      });
    }
    // Columns: later sub-blocks u > s (dL with G, dP with G^q share the factor e^{Γ_a − Γ_i}).
    for (int u = row_block + 1; u < kNumSubBlocks; ++u) {
      const int start = kSubBlock * u;
      zero_tiles(acc);
      warp_mma<MmaPrecision::Tf32>(
          acc, tiles_k, start, start + kSubBlock,
          [&](int r, int l) { return d_lkk[l * kLdPair + r0 + r]; },
          [&](int l, int nn) { return g_key[l * ldw + col0_k + nn]; });
      warp_mma<MmaPrecision::Tf32>(
          acc, tiles_k, start, start + kSubBlock,
          [&](int r, int l) { return d_pqk[l * kLdPair + r0 + r]; },
          [&](int l, int nn) { return g_query[l * ldw + col0_k + nn]; });
      for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
        const float cols = acc[j][e4] * __expf(gamma_at(start, c) - gamma_at(i, c));
        acc_k[j][e4] += cols;
        acc_gamma[j][e4] -= key_hat(i, c) * cols;
      });
    }
    // Inside the sub-block (kda_stage4_mma.cuh).
    pairwise_inside_sub_block(acc_q, acc_k, tiles_k, r0, col0_k, d_lkk, d_pqk, key_hat2, query_hat2,
                              gamma2, [&](int j, int hh, int, int, float2 value) {
                                acc_gamma[j][2 * hh] += value.x;
                                acc_gamma[j][2 * hh + 1] += value.y;
                              });
  }
  __syncthreads();  // F is dead: slot a takes dΓ
  stamp(10);

  // ---- 4. dΓ to shared memory; row dots q·dq̂, k·dk̂ for the L2-norm backward.
  float* d_gamma = slot_a;
  {
    float row_q[2] = {0.0f, 0.0f}, row_k[2] = {0.0f, 0.0f};
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      d_gamma[i * ldw + c] = acc_gamma[j][e4];
      row_q[e4 >> 1] += bf16_bits_to_float(query_raw[i * ldr + c]) * acc_q[j][e4];
      row_k[e4 >> 1] += bf16_bits_to_float(key_raw[i * ldr + c]) * acc_k[j][e4];
    });
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float xq = row_q[half], xk = row_k[half];
      xq += __shfl_xor_sync(0xffffffffu, xq, 1);
      xq += __shfl_xor_sync(0xffffffffu, xq, 2);
      xk += __shfl_xor_sync(0xffffffffu, xk, 1);
      xk += __shfl_xor_sync(0xffffffffu, xk, 2);
      if (tq == 0) {
        atomicAdd(&dot_query[r0 + g + 8 * half], xq);
        atomicAdd(&dot_key[r0 + g + 8 * half], xk);
      }
    }
  }
  __syncthreads();
  stamp(11);

  // E_i = dKe_i ⊙ Ke_i again (the stage-2 product; G is dead, slot b takes E), with dS' staged
  // slab by slab in the three [C, C] matrices (dead since stage 3, contiguous) as in stage 2.
  // Then dq, dk through the L2 norm (u = x·inv: dx = inv·(dû − u·(u·dû))) go from the
  // registers to shared memory (slot c, dead since stage 3, and the same three matrices once
  // the product is done), so that one block-wide coalesced pass adds dg, dq and dk to global
  // memory at the end.
  float* key_end_terms = slot_b;
  float* d_query_s = slot_c;                                                  // [C, ldw]
  float* d_key_s = reinterpret_cast<float*>(shared_bytes + l.d_lower_query_key);  // [C, ldw]
  {
    float* slabs = nullptr;
    if (VP % kSlab == 0 && 2 * KP * kSlabLd * 4 <= l.slot_a - l.d_lower_query_key) slabs = d_key_s;
    float acc[kMaxTiles][4];
    zero_tiles(acc);
    key_side_product<MmaPrecision::Tf32>(
        acc, tiles_k, col0_k, 0, KP, VP, d_state, slabs,
        [&](int r, int e) { return load_pair(value_new + (r0 + r) * VP + e); });
    for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
      const float decay_to_end =
          seg[i] == last_segment ? __expf(gamma_at(kChunk - 1, c) - gamma_at(i, c)) : 0.0f;
      key_end_terms[i * ldw + c] = acc[j][e4] * decay_to_end * key_hat(i, c);
    });
  }
  // (key_side_product ends with a barrier when it staged: the slabs are free for d_key_s.)
  for_each_element<kMaxTiles>(tiles_k, r0, col0_k, [&](int j, int e4, int i, int c) {
    const float q_inv = query_inv[i], k_inv = key_inv[i];
    const float q_raw = bf16_bits_to_float(query_raw[i * ldr + c]);
    const float k_raw = bf16_bits_to_float(key_raw[i * ldr + c]);
    d_query_s[i * ldw + c] =
        d.scale * q_inv * (acc_q[j][e4] - q_raw * q_inv * (dot_query[i] * q_inv));
    d_key_s[i * ldw + c] = k_inv * (acc_k[j][e4] - k_raw * k_inv * (dot_key[i] * k_inv));
  });
  __syncthreads();
  stamp(12);

  // dg = the exclusive forward prefix of E (zero outside the last segment, where Ke is) + the
  // reverse cumsum of dΓ restarting at document starts, seeded (last segment) with dγ.
  for (int col = tid; col < d.K; col += kThreads) {
    float prefix = 0.0f;
    for (int i = 0; i < kChunk; ++i) {
      const float e = key_end_terms[i * ldw + col];
      key_end_terms[i * ldw + col] = prefix;
      prefix += e;
    }
    float running = d_gamma_last[col];
    for (int i = kChunk - 1; i >= 0; --i) {
      if (i < kChunk - 1 && seg[i] != seg[i + 1]) running = 0.0f;
      running += d_gamma[i * ldw + col];
      d_gamma[i * ldw + col] = running + key_end_terms[i * ldw + col];
    }
  }
  __syncthreads();
  stamp(13);
  // dg, dq, dk += those, row-coalesced by the whole block (the sequential scans above stay in
  // shared memory: a global read-modify-write per step would put 64 dependent round trips on
  // them).
  // 16-byte accesses when K and the gradient pointers allow (the usual case), unrolled so that
  // several rows' loads are in flight.
  auto add4 = [](float* dst, const float* src) {
    float4 x = *reinterpret_cast<float4*>(dst);
    const float4 y = *reinterpret_cast<const float4*>(src);
    x.x += y.x; x.y += y.y; x.z += y.z; x.w += y.w;
    *reinterpret_cast<float4*>(dst) = x;
  };
  if (d.K % 4 == 0 && ((reinterpret_cast<uintptr_t>(dg) | reinterpret_cast<uintptr_t>(dq) |
                        reinterpret_cast<uintptr_t>(dk)) & 15) == 0) {
    const int per_row = d.K / 4;
#pragma unroll 4
    for (int idx = tid; idx < c_len * per_row; idx += kThreads) {
      const int i = idx / per_row, col = idx % per_row * 4;
      const int64_t at = token_row(i) * d.K + col;
      add4(dg + at, d_gamma + i * ldw + col);
      add4(dq + at, d_query_s + i * ldw + col);
      add4(dk + at, d_key_s + i * ldw + col);
    }
  } else {
    for (int idx = tid; idx < c_len * d.K; idx += kThreads) {
      const int i = idx / d.K, col = idx % d.K;
      const int64_t at = token_row(i) * d.K + col;
      dg[at] += d_gamma[i * ldw + col];
      dq[at] += d_query_s[i * ldw + col];
      dk[at] += d_key_s[i * ldw + col];
    }
  }
  if (tid < c_len) dbeta[token_row(tid)] += d_beta_s[tid];
  stamp(14);
}

}  // namespace

size_t kda_chunk_grad_tensor_cores_shared_bytes(const KdaDims& d) {
  return size_t(tc_grad_layout(d).total);
}

}  // namespace kda_detail

void kda_stage4_phase_clock(bool enable) {
  kda_detail::phase_clock_enable(kda_detail::g_phase_clock_on, enable);
}

int kda_stage4_phase_cycles(long long* cycles, const char** names, int max_phases) {
  return kda_detail::phase_clock_read(kda_detail::g_phase_clock, kda_detail::kPhaseNames, cycles,
                                      names, max_phases);
}

namespace kda_detail {

void kda_chunk_grad_tensor_cores(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const uint16_t* g, const uint16_t* beta, const uint16_t* d_o,
                                 const int32_t* doc_start, float* dq, float* dk, float* dv,
                                 float* dg, float* dbeta, const KdaDims& d,
                                 const KdaForwardWorkspace& ws, const float* d_states,
                                 cudaStream_t stream) {
  if (d.num_chunks == 0 || d.B * d.H == 0) return;
  const TcGradLayout layout = tc_grad_layout(d);
  const int shared = layout.total;
  // The kernel's last phase keeps dk [C, ldw] fp32 in the three [C, C] matrices (contiguous).
  DM_CHECK(layout.slot_a - layout.d_lower_query_key >= kChunk * layout.ldw * 4,
           "kda stage 4: the [C, C] matrices cannot hold dk");
  DM_CUDA_CHECK(cudaFuncSetAttribute(kda_chunk_grad_tc_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  kda_chunk_grad_tc_kernel<<<dim3(unsigned(d.num_chunks), unsigned(d.B * d.H)), kThreads,
                             size_t(shared), stream>>>(q, k, v, g, beta, d_o, doc_start, dq, dk,
                                                       dv, dg, dbeta, d, ws, d_states);
  check_last_error("cuda kda_chunk_backward (chunk gradients, tensor cores)");
}

}  // namespace kda_detail
}  // namespace dm::cuda
