// Training-side kernels of the GPU residual stream (residual_ops.h): the AttnRes backward (one
// warp per row, then a fixed-order sum of the parameter partials), the embedding backward (radix
// sort by token, then one writer per row) and the deterministic sum of squares.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "ops/cuda/attnres_rows.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {
using namespace attnres_detail;
namespace {

// Blocks of the sum-of-squares first stage (fixed by n; ≤ kSumSquaresThreads so the second
// stage is one pass of one block).
constexpr int kSumSquaresThreads = 1024;
int64_t sum_squares_blocks(int64_t n) {
  return std::min<int64_t>((n + 256 * 16 - 1) / (256 * 16), kSumSquaresThreads);
}

// Grid for a grid-stride element-wise loop over n elements (n ≥ 1).
unsigned elementwise_blocks(int64_t n, int threads) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, 8192));
}

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// ---- AttnRes backward --------------------------------------------------------------------------

struct AttnResGradTargets {
  float* dsrc[kAttnResCudaMaxSources];
};

// The RMSNorm that follows the mix, whose backward the fused kernel forms per row
// (attnres_norm_backward): mixed = the mix's output [N, D], out_w its norm weight [D], dy the
// gradient of the normed rows [N, D]; dw_partial [blocks, D] the fp64 block partials of
// Σ_n dy⊙mixed·r (nullptr: the weight's gradient not wanted).
struct AttnResNormIn {
  const float* mixed = nullptr;
  const float* out_w = nullptr;
  const float* dy = nullptr;
  double* dw_partial = nullptr;
  float eps = 0.0f;
  // Deferred sources (attnres_norm_backward_deferred): sources 0 … deferred − 1 get neither their
  // dsrc update nor their share of G here; the row's dout goes to dout_keep [N, D] and their
  // fp32 coefficients to coef_keep [3, deferred, N] (a_j, then c_j, then c3_j) for the flush.
  int deferred = 0;
  float* dout_keep = nullptr;
  float* coef_keep = nullptr;
};

// Grid of the AttnRes backward row kernel, a function of (N, D, norm_in) only, so the order in
// which G adds up (hence the bits of dquery / dnorm_w) never depends on scheduling or on the
// device. `warps` rows run side by side per block: as many (≤ 8) as keep γ⊙w and, per warp, one
// fp32 partial of G (norm_in: also the row's dout and a partial of the norm weight's gradient)
// within kAttnResBackwardSmemBudget; each warp owns rows_per_warp rows, so that there are at most
// kAttnResBackwardMaxBlocks blocks, each writing one fp64 partial [D] (norm_in: two).
constexpr int kAttnResBackwardMaxWarps = 8;
constexpr int64_t kAttnResBackwardMaxBlocks = 512;
// norm_in: two blocks of four warps fit an SM at D = 2048 (shared memory), so 256 blocks are one
// wave of the H200's 132 SMs (512 left a second wave and twice the partials to sum).
constexpr int64_t kAttnResNormBackwardMaxBlocks = 256;
constexpr size_t kAttnResBackwardSmemBudget = 112 * 1024;  // half of an sm_90 SM's 228 KiB
// Chunks per lane whose loads the element pass issues together (x, dout, dsrc: 24 float4).
constexpr int kAttnResElementGroup = 8;

struct AttnResBackwardGrid {
  int warps;          // rows (warps) per block
  int rows_per_warp;  // rows each warp walks
  int64_t blocks;     // = the number of fp64 partials of G
};

// D-wide fp32 rows of shared memory a warp of the row kernel owns.
int attnres_backward_rows_per_warp(bool norm_in) { return norm_in ? 3 : 1; }

AttnResBackwardGrid attnres_backward_grid(int64_t N, int64_t D, bool norm_in) {
  AttnResBackwardGrid grid{};
  const int64_t fit =
      (int64_t(kAttnResBackwardSmemBudget / (size_t(std::max<int64_t>(D, 1)) * sizeof(float))) -
       1) /
      attnres_backward_rows_per_warp(norm_in);
  grid.warps = int(std::clamp<int64_t>(fit, 1, kAttnResBackwardMaxWarps));
  const int64_t rows = std::max<int64_t>(N, 1);
  const int64_t max_rows_per_pass =
      grid.warps * (norm_in ? kAttnResNormBackwardMaxBlocks : kAttnResBackwardMaxBlocks);
  grid.rows_per_warp = int((rows + max_rows_per_pass - 1) / max_rows_per_pass);
  const int64_t rows_per_block = int64_t(grid.warps) * grid.rows_per_warp;
  grid.blocks = (rows + rows_per_block - 1) / rows_per_block;
  return grid;
}

// Dynamic shared memory of the backward row kernel: γ⊙w [D], then (parameter gradients wanted)
// one fp32 partial of G [D] per warp, then (norm_in) each warp's dout row [D] and fp32 partial of
// the norm weight's gradient [D].
size_t attnres_backward_smem_bytes(int64_t D, int warps, bool param_grads, bool norm_in) {
  return size_t(1 + (param_grads ? warps : 0) + (norm_in ? 2 * warps : 0)) * size_t(D) *
         sizeof(float);
}

// AttnRes backward, stage 1. Warp w of block b owns rows n = (i·gridDim.x + b)·warps + w,
// i = 0 … rows_per_warp − 1 (attnres_backward_grid). Per row:
//   1. statistics, source by source, tile by tile: ss_j = Σ V², s_j = Σ V γ w, da_j = Σ dout·V
//      (fp32 within a chunk, fp64 across chunks and lanes), three shuffle reductions per source
//      into the lanes' SourceSlots;
//   2. every lane, for its slots (fp64, the CPU formulas): r_j = 1/sqrt(ss_j/D + eps),
//      a = softmax(r·s), dl_j = a_j (da_j − Σ_k a_k da_k), c_j = dl_j r_j, c3_j = dl_j s_j r_j³/D;
//   3. element pass, sources in reverse order (the last read are the likeliest still in L2):
//      dsrc[j] += a_j·dout + c_j·γ⊙w − c3_j·V_j in fp32, and the warp's fp32 partial of
//      G = Σ_j c_j V_j in shared memory (lane-owned chunks, so no two lanes touch one element and
//      no barrier is needed until the end).
// Bytes per row: 4·D·(S + 1) for the statistics, then per source 4·D re-read (L2 for the last
// few) + 4·D dsrc read + 4·D written; the dout row is re-read from L1/L2 for every source. The
// dsrc stream and the last read of a source use evict-first hints so that they do not push the
// row's remaining sources out of L2.
// At the end the block sums its warps' partials in warp order, in fp64, into
// partial[blockIdx.x, :]; partial == nullptr: no parameter gradient wanted (no partials kept).
// kNormIn: dout is not an input but the backward of the RMSNorm after the mix, formed per row
// first into the warp's shared row (norm.mixed and norm.dy read once, 8·D bytes, where the
// separate norm backward moved 20·D: x and dy twice, dx written), with the norm weight's
// gradient partial beside G's.
template <int kVec, bool kNormIn>
__global__ void __launch_bounds__(kAttnResBackwardMaxWarps * 32)
    attnres_backward_rows_kernel(AttnResSources sources, AttnResGradTargets targets, int S,
                                 const float* query, const float* norm_w, const float* dout,
                                 double* partial, int64_t N, int D, float eps, int rows_per_warp,
                                 AttnResNormIn norm) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  using Chunk = AttnResChunk<kVec>;
  constexpr int K = kAttnResChunksPerLane, kGroup = kAttnResElementGroup;
  static_assert(K % kGroup == 0, "element groups tile a tile");
  extern __shared__ float4 attnres_smem[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = D / kVec;
  Chunk* gw = reinterpret_cast<Chunk*>(attnres_smem);
  float* warp_partials = reinterpret_cast<float*>(gw + chunks);  // [warps, D] if partial
  // kNormIn: [warps, D] dout rows, then [warps, D] partials of the norm weight's gradient.
  float* dout_rows = warp_partials + (partial ? warps * D : 0);
  float* norm_partials = dout_rows + warps * D;
  const bool norm_dw = kNormIn && norm.dw_partial != nullptr;
  attnres_fill_gamma_w(gw, query, norm_w, chunks);
  if (partial || norm_dw) {
    Chunk* zero = reinterpret_cast<Chunk*>(warp_partials);
    const int rows = (partial ? warps : 0) + (norm_dw ? 2 * warps : 0);
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) zero[i] = Chunk{};
  }
  __syncthreads();
  const Chunk* gwc = gw;
  Chunk* gpart = partial ? reinterpret_cast<Chunk*>(warp_partials + warp * D) : nullptr;
  Chunk* dout_row = reinterpret_cast<Chunk*>(dout_rows + warp * D);
  Chunk* npart = norm_dw ? reinterpret_cast<Chunk*>(norm_partials + warp * D) : nullptr;

  for (int i = 0; i < rows_per_warp; ++i) {
    const int64_t n = (int64_t(i) * gridDim.x + blockIdx.x) * warps + warp;
    if (n >= N) break;  // whole warps; rows grow with i
    const Chunk* g = reinterpret_cast<const Chunk*>(kNormIn ? nullptr : dout + n * D);
    if constexpr (kNormIn) {
      // dout = r·w⊙dy − mixed·r³·(Σ dy·w·mixed)/D (RMSNorm's backward, fp64 row sums), into the
      // warp's row; the norm weight's partial += dy⊙mixed·r. Each lane reads back only chunks it
      // wrote, so the row needs no barrier. A row of one tile stays in registers between the
      // sums and the stores (a second read of it was the longest wait of the row).
      const Chunk* m = reinterpret_cast<const Chunk*>(norm.mixed + n * D);
      const Chunk* dy = reinterpret_cast<const Chunk*>(norm.dy + n * D);
      const Chunk* ow = reinterpret_cast<const Chunk*>(norm.out_w);
      float fr = 0.0f, neg_proj = 0.0f;
      auto coefficients = [&](double ss, double wdot) {
        ss = warp_sum(ss);
        wdot = warp_sum(wdot);
        const double r = 1.0 / sqrt(ss / double(D) + double(norm.eps));
        fr = float(r);
        neg_proj = float(-r * r * r * wdot / double(D));
      };
      Chunk* keep = norm.dout_keep ? reinterpret_cast<Chunk*>(norm.dout_keep + n * D) : nullptr;
      auto store = [&](int c, Chunk xc, Chunk yc) {
        const Chunk value = chunk_lincomb(fr, chunk_mul(yc, __ldg(ow + c)), neg_proj, xc);
        dout_row[c] = value;
        if (keep) __stcs(keep + c, value);
        if (npart) npart[c] = chunk_lincomb(1.0f, npart[c], fr, chunk_mul(yc, xc));
      };
      if (chunks <= 32 * K) {
        Chunk x[K], y[K];
        double ss = 0.0, wdot = 0.0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = lane + 32 * k;
          x[k] = c < chunks ? m[c] : Chunk{};
          y[k] = c < chunks ? dy[c] : Chunk{};
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = lane + 32 * k;
          if (c < chunks) {
            ss += double(chunk_dot(x[k], x[k]));
            wdot += double(chunk_dot(chunk_mul(y[k], __ldg(ow + c)), x[k]));
          }
        }
        coefficients(ss, wdot);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = lane + 32 * k;
          if (c < chunks) store(c, x[k], y[k]);
        }
      } else {
        double ss = 0.0, wdot = 0.0;
        for (int c = lane; c < chunks; c += 32) {
          const Chunk xc = m[c], yc = dy[c];
          ss += double(chunk_dot(xc, xc));
          wdot += double(chunk_dot(chunk_mul(yc, __ldg(ow + c)), xc));
        }
        coefficients(ss, wdot);
        for (int c = lane; c < chunks; c += 32) store(c, m[c], dy[c]);  // from L1 / L2
      }
      g = dout_row;
    }

    SourceSlots logit{-INFINITY, -INFINITY}, r{0.0, 0.0}, s{0.0, 0.0}, da{0.0, 0.0};
    for (int j = 0; j < S; ++j) {
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
      double ss = 0.0, dot = 0.0, gv = 0.0;
      for (int base = 0; base < chunks; base += 32 * K) {
        Chunk x[K], y[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = base + lane + 32 * k;
          x[k] = c < chunks ? __ldcg(v + c) : Chunk{};  // L2 only: L1 keeps the dout row
          y[k] = c < chunks ? g[c] : Chunk{};
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = base + lane + 32 * k;
          if (c < chunks) {
            ss += double(chunk_dot(x[k], x[k]));
            dot += double(chunk_dot(x[k], gwc[c]));
            gv += double(chunk_dot(x[k], y[k]));
          }
        }
      }
      ss = warp_sum(ss);
      dot = warp_sum(dot);
      gv = warp_sum(gv);
      const double rj = 1.0 / sqrt(ss / double(D) + double(eps));
      r.capture(j, rj, lane);
      s.capture(j, dot, lane);
      da.capture(j, gv, lane);
      logit.capture(j, rj * dot, lane);
    }

    const SourceSlots a = softmax_slots(logit);
    const double mean_da = warp_sum(a.lo * da.lo + a.hi * da.hi);
    SourceSlots c, c3;  // unused slots: a = da = r = 0, so c = c3 = 0
    {
      const double dl_lo = a.lo * (da.lo - mean_da), dl_hi = a.hi * (da.hi - mean_da);
      c.lo = dl_lo * r.lo;
      c.hi = dl_hi * r.hi;
      c3.lo = dl_lo * s.lo * r.lo * r.lo * r.lo / double(D);
      c3.hi = dl_hi * s.hi * r.hi * r.hi * r.hi / double(D);
    }
    const int deferred = kNormIn ? norm.deferred : 0;
    if (deferred > 0) {  // the deferred sources' coefficients, as the element pass rounds them
      const int64_t plane = int64_t(deferred) * N;
      for (int j = lane; j < deferred; j += 32) {
        const bool lo = j < 32;
        float* at = norm.coef_keep + int64_t(j) * N + n;
        at[0] = float(lo ? a.lo : a.hi);
        at[plane] = float(lo ? c.lo : c.hi);
        at[2 * plane] = float(lo ? c3.lo : c3.hi);
      }
    }

    for (int j = S - 1; j >= deferred; --j) {
      float* dsrc_j = targets.dsrc[j];
      if (dsrc_j == nullptr && gpart == nullptr) continue;  // warp-uniform
      Chunk* dv = dsrc_j ? reinterpret_cast<Chunk*>(dsrc_j + n * D) : nullptr;
      const float fa = a.broadcast_float(j), fc = c.broadcast_float(j),
                  neg_fc3 = -c3.broadcast_float(j);
      const Chunk* v = reinterpret_cast<const Chunk*>(sources.src[j] + n * D);
      for (int base = 0; base < chunks; base += 32 * K) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += kGroup) {
          // All of the group's loads go out before its first store: dsrc aliases nothing read
          // here, but the compiler cannot know that and would not hoist a load over a store.
          Chunk x[kGroup], y[kGroup], z[kGroup];
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            const int cc = base + lane + 32 * (k0 + k);
            x[k] = y[k] = z[k] = Chunk{};
            if (cc < chunks) {
              x[k] = __ldcs(v + cc);
              if (dv) {
                y[k] = g[cc];
                z[k] = __ldcs(dv + cc);
              }
            }
          }
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            const int cc = base + lane + 32 * (k0 + k);
            if (cc >= chunks) continue;
            if (dv) __stcs(dv + cc, chunk_update(z[k], fa, y[k], fc, gwc[cc], neg_fc3, x[k]));
            if (gpart) gpart[cc] = chunk_lincomb(1.0f, gpart[cc], fc, x[k]);
          }
        }
      }
    }
  }

  if (partial == nullptr && !norm_dw) return;  // block-uniform
  __syncthreads();
  for (int d = threadIdx.x; partial && d < D; d += blockDim.x) {
    double G = 0.0;
    for (int w = 0; w < warps; ++w) G += double(warp_partials[w * D + d]);
    partial[int64_t(blockIdx.x) * D + d] = G;
  }
  for (int d = threadIdx.x; norm_dw && d < D; d += blockDim.x) {
    double total = 0.0;
    for (int w = 0; w < warps; ++w) total += double(norm_partials[w * D + d]);
    norm.dw_partial[int64_t(blockIdx.x) * D + d] = total;
  }
}

// ---- AttnRes deferred flush ---------------------------------------------------------------------
// The updates the deferred sites left for the J leading (sealed) sources, applied in one pass:
//   dsrc_j[n] += Σ_p (a_pj·dout_p[n] + c_pj·γ_p⊙w_p) − (Σ_p c3_pj)·V_j[n],
//   G_p += Σ_n Σ_j c_pj·V_j[n]   (the sites' parameter gradients, added by the params kernel).
// Block: kFlushThreads threads × 4 columns (512 columns) × one tile of rows; each thread keeps
// its columns' dout_p, γ_p⊙w_p and G_p (p < P ≤ kAttnResFlushMaxSites) in registers and walks
// the tile's rows in order, the coefficients staged in shared memory 16 rows at a time.
// partial [P, tiles, D] (fp64): tile t's Σ over its rows, summed by the params kernel in tile
// order (fixed: bit-identical reruns).
constexpr int kFlushThreads = 128;
constexpr int kFlushColumns = 4 * kFlushThreads;
constexpr int kFlushStageRows = 16;
constexpr int64_t kFlushMaxTiles = 256;
constexpr int kFlushSourceGroup = 4;  // sources whose loads a thread issues together

struct AttnResFlushArgs {
  const float* src[kAttnResFlushMaxSources];
  float* dsrc[kAttnResFlushMaxSources];
  const float* dout[kAttnResFlushMaxSites];
  const float* coef[kAttnResFlushMaxSites];  // [3, J, N]
  const float* query[kAttnResFlushMaxSites];
  const float* norm_w[kAttnResFlushMaxSites];
};

struct FlushGrid {
  int64_t rows_per_tile, tiles;
};
FlushGrid flush_grid(int64_t N) {
  FlushGrid g;
  g.rows_per_tile = std::max<int64_t>(kFlushStageRows, (N + kFlushMaxTiles - 1) / kFlushMaxTiles);
  g.tiles = (N + g.rows_per_tile - 1) / g.rows_per_tile;
  return g;
}

__global__ void __launch_bounds__(kFlushThreads)
    attnres_flush_kernel(AttnResFlushArgs args, int P, int J, int64_t N, int D,
                         int64_t rows_per_tile, double* partial) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr int kSites = kAttnResFlushMaxSites;
  extern __shared__ float4 flush_coef[];  // [kFlushStageRows][P·J]: (a, c, c3, 0)
  const int col = blockIdx.x * kFlushColumns + 4 * threadIdx.x;  // first of the thread's 4
  const bool active = col < D;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_tile;
  const int64_t r1 = std::min<int64_t>(r0 + rows_per_tile, N);
  float4 gw[kSites], g_acc[kSites];
#pragma unroll
  for (int p = 0; p < kSites; ++p) {
    gw[p] = g_acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p < P && active) {  // scalar loads: parameter views need not be 16-byte aligned
      const float* q = args.query[p] + col;
      const float* w = args.norm_w[p] + col;
      gw[p] = make_float4(__ldg(q) * __ldg(w), __ldg(q + 1) * __ldg(w + 1),
                          __ldg(q + 2) * __ldg(w + 2), __ldg(q + 3) * __ldg(w + 3));
    }
  }
  const int PJ = P * J;
  for (int64_t s0 = r0; s0 < r1; s0 += kFlushStageRows) {
    const int rows = int(std::min<int64_t>(kFlushStageRows, r1 - s0));
    __syncthreads();  // the previous stage's coefficients are read
    for (int idx = threadIdx.x; idx < rows * PJ; idx += kFlushThreads) {
      const int i = idx % rows, pj = idx / rows, p = pj / J, j = pj % J;  // i fastest: coalesced
      const float* cf = args.coef[p] + int64_t(j) * N + s0 + i;
      const int64_t plane = int64_t(J) * N;
      flush_coef[i * PJ + pj] = make_float4(cf[0], cf[plane], cf[2 * plane], 0.0f);
    }
    __syncthreads();
    if (!active) continue;
    for (int i = 0; i < rows; ++i) {
      const int64_t at = (s0 + i) * D + col;
      float4 dout[kSites];
#pragma unroll
      for (int p = 0; p < kSites; ++p)
        dout[p] = p < P ? __ldcs(reinterpret_cast<const float4*>(args.dout[p] + at))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
      const float4* cf = flush_coef + i * PJ;
      // Sources kFlushSourceGroup at a time, every load of a group before its first store (the
      // compiler cannot move a load over a store to dsrc, which might alias it): one source at a
      // time left two 16-byte loads in flight a thread, and the flush ran at ~65% of the copy
      // rate. Sums in the same order either way.
      for (int j0 = 0; j0 < J; j0 += kFlushSourceGroup) {
        float4 v[kFlushSourceGroup], acc[kFlushSourceGroup];
#pragma unroll
        for (int u = 0; u < kFlushSourceGroup; ++u)
          if (j0 + u < J) {
            v[u] = __ldcs(reinterpret_cast<const float4*>(args.src[j0 + u] + at));
            acc[u] = *reinterpret_cast<const float4*>(args.dsrc[j0 + u] + at);
          }
#pragma unroll
        for (int u = 0; u < kFlushSourceGroup; ++u) {
          const int j = j0 + u;
          if (j >= J) break;
          float c3_sum = 0.0f;
#pragma unroll
          for (int p = 0; p < kSites; ++p) {
            if (p >= P) break;
            const float4 k = cf[p * J + j];
            acc[u] = chunk_update(acc[u], k.x, dout[p], k.y, gw[p], 0.0f, v[u]);
            c3_sum += k.z;
            g_acc[p] = chunk_lincomb(1.0f, g_acc[p], k.y, v[u]);
          }
          *reinterpret_cast<float4*>(args.dsrc[j] + at) =
              chunk_lincomb(1.0f, acc[u], -c3_sum, v[u]);
        }
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int p = 0; p < kSites; ++p) {
    if (p >= P) break;
    double* out = partial + (int64_t(p) * gridDim.y + blockIdx.y) * D + col;
    out[0] = g_acc[p].x;
    out[1] = g_acc[p].y;
    out[2] = g_acc[p].z;
    out[3] = g_acc[p].w;
  }
}

// AttnRes backward, stage 2: G[d] = Σ_b partial[b, d], then dquery[d] += G·w_d and
// dnorm_w[d] += G·γ_d. A block of 32 columns × kAttnResParamGroups per 32-column slice of D:
// thread (x, y) sums the partials b ≡ y (mod groups) in ascending b (a warp reads 256
// contiguous bytes per b), then thread (x, 0) adds the group sums in group order: a fixed order,
// so bit-identical run to run, and 16-way parallel over the ≤ 512 partials of a column.
// partial == nullptr: no G. norm_partial (the fused norm backward's, [blocks, D]): its column sums,
// in the same order, add to d_out_w.
constexpr int kAttnResParamGroups = 16;
__device__ __forceinline__ double attnres_column_sum(const double* partial, int64_t blocks, int D,
                                                     double (*group_sum)[32]) {
  const int x = threadIdx.x, y = threadIdx.y;
  const int d = blockIdx.x * 32 + x;
  double acc = 0.0;
  if (d < D) {
#pragma unroll 4
    for (int64_t b = y; b < blocks; b += kAttnResParamGroups) acc += partial[b * D + d];
  }
  __syncthreads();  // group_sum free (a previous call's readers are done)
  group_sum[y][x] = acc;
  __syncthreads();
  double total = 0.0;
  for (int k = 0; k < kAttnResParamGroups; ++k) total += group_sum[k][x];
  return total;
}

__global__ void __launch_bounds__(32 * kAttnResParamGroups)
    attnres_backward_params_kernel(const double* partial, int64_t blocks, const float* query,
                                   const float* norm_w, float* dquery, float* dnorm_w,
                                   const double* norm_partial, float* d_out_w, int D) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  __shared__ double group_sum[kAttnResParamGroups][32];
  const int d = blockIdx.x * 32 + threadIdx.x;
  const bool writer = threadIdx.y == 0 && d < D;
  if (partial) {
    const double G = attnres_column_sum(partial, blocks, D, group_sum);
    if (writer && dquery) dquery[d] += float(G * double(norm_w[d]));
    if (writer && dnorm_w) dnorm_w[d] += float(G * double(query[d]));
  }
  if (norm_partial) {
    const double total = attnres_column_sum(norm_partial, blocks, D, group_sum);
    if (writer) d_out_w[d] += float(total);
  }
}

// Embedding backward, step 1: sort keys (token id, or V for an id outside [0, V): sorted last
// and skipped) and values (the row index n).
__global__ void embedding_backward_keys_kernel(const int64_t* tokens, int64_t N, int64_t V,
                                               uint32_t* keys, uint32_t* rows) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = tokens[n];
    keys[n] = uint32_t(t >= 0 && t < V ? t : V);
    rows[n] = uint32_t(n);
  }
}

// Embedding backward, step 3: sorted position i that starts a run of equal tokens (i = 0 or a
// different key before it) sums dp over the run in sorted (= ascending n) order, in fp64, and
// adds once to dtable[token]. Other positions do nothing; one block per position, grid-stride.
__global__ void embedding_backward_accumulate_kernel(const uint32_t* keys, const uint32_t* rows,
                                                     const float* dp, int64_t N, int64_t D,
                                                     int64_t V, float* dtable) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const uint32_t key = keys[i];
    if (int64_t(key) >= V || (i > 0 && keys[i - 1] == key)) continue;  // block-uniform branch
    float* out = dtable + int64_t(key) * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      double acc = 0.0;
      for (int64_t k = i; k < N && keys[k] == key; ++k) acc += double(dp[int64_t(rows[k]) * D + d]);
      out[d] = float(double(out[d]) + acc);
    }
  }
}

// Embedding backward, atomic variant: one block per row n (grid-stride), fp32 atomicAdd.
__global__ void embedding_backward_atomic_kernel(const int64_t* tokens, const float* dp, int64_t N,
                                                 int64_t D, float* dtable) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    float* out = dtable + tokens[n] * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(out + d, dp[n * D + d]);
  }
}

// Sum of squares, stage 1: block b writes Σ over its grid-stride share of x² (fp64).
__global__ void sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Sum of squares, stage 2: one block of kSumSquaresThreads; thread t takes partial t (count ≤
// kSumSquaresThreads), one fixed-order block reduction.
__global__ void sum_squares_final_kernel(const double* partial, int64_t count, double* result) {
  __shared__ double scratch[32];
  const double v = threadIdx.x < count ? partial[threadIdx.x] : 0.0;
  const double total = block_sum(v, scratch);
  if (threadIdx.x == 0) *result = total;
}

__global__ void scale_inplace_kernel(float* x, int64_t n, float s) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

}  // namespace

// ---- training side ---------------------------------------------------------------------------

size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S) {
  (void)S;
  if (N <= 0 || D <= 0) return 0;
  return align256(size_t(attnres_backward_grid(N, D, false).blocks) * size_t(D) * sizeof(double));
}

size_t attnres_norm_backward_workspace_bytes(int64_t N, int64_t D, int S) {
  (void)S;
  if (N <= 0 || D <= 0) return 0;
  return 2 *
         align256(size_t(attnres_backward_grid(N, D, true).blocks) * size_t(D) * sizeof(double));
}

namespace {

// attnres_backward and attnres_norm_backward (norm.mixed != nullptr).
void attnres_backward_launch(const float* const* src, int S, const float* query,
                             const float* norm_w, const float* dout, const AttnResNormIn& norm_args,
                             float* const* dsrc, float* dquery, float* dnorm_w, float* d_out_w,
                             int64_t N, int64_t D, float eps, void* workspace,
                             CUstream_st* stream) {
  const char* who = norm_args.mixed ? "attnres_norm_backward (CUDA)" : "attnres_backward (CUDA)";
  DM_CHECK(S >= 1 && S <= kAttnResCudaMaxSources, who, ": ", S, " sources (1..",
           kAttnResCudaMaxSources, " supported)");
  DM_CHECK(N >= 0 && D >= 0 && D <= kAttnResMaxWidth, who, ": bad shape N=", N, " D=", D, " (D ≤ ",
           kAttnResMaxWidth, ")");
  if (N == 0 || D == 0) return;
  const bool norm_in = norm_args.mixed != nullptr;
  const bool param_grads = dquery != nullptr || dnorm_w != nullptr;
  const bool any_params = param_grads || d_out_w != nullptr;
  DM_CHECK(!any_params || workspace != nullptr, who,
           ": a workspace is needed for the parameter gradients");
  AttnResSources sources{};
  AttnResGradTargets targets{};
  bool vec4 = D % 4 == 0 && aligned16(query) && aligned16(norm_w);
  vec4 = vec4 && (norm_in ? aligned16(norm_args.mixed) && aligned16(norm_args.out_w) &&
                                aligned16(norm_args.dy)
                          : aligned16(dout));
  bool any_dsrc = false;
  for (int j = 0; j < S; ++j) {
    sources.src[j] = src[j];
    targets.dsrc[j] = dsrc ? dsrc[j] : nullptr;
    vec4 = vec4 && aligned16(src[j]) && aligned16(targets.dsrc[j]);
    any_dsrc = any_dsrc || targets.dsrc[j] != nullptr;
  }
  if (!any_dsrc && !any_params) return;
  const AttnResBackwardGrid grid = attnres_backward_grid(N, D, norm_in);
  const size_t smem = attnres_backward_smem_bytes(D, grid.warps, param_grads, norm_in);
  const size_t partial_bytes = align256(size_t(grid.blocks) * size_t(D) * sizeof(double));
  double* partial = param_grads ? static_cast<double*>(workspace) : nullptr;
  AttnResNormIn norm = norm_args;
  norm.dw_partial = norm_in && d_out_w
                        ? reinterpret_cast<double*>(static_cast<char*>(workspace) + partial_bytes)
                        : nullptr;
  auto launch = [&](auto kernel) {
    launch_attnres_rows(kernel, grid.blocks, grid.warps * 32, smem, stream, sources, targets, S,
                        query, norm_w, dout, partial, N, int(D), eps, grid.rows_per_warp, norm);
  };
  if (norm_in)
    vec4 ? launch(attnres_backward_rows_kernel<4, true>)
         : launch(attnres_backward_rows_kernel<1, true>);
  else
    vec4 ? launch(attnres_backward_rows_kernel<4, false>)
         : launch(attnres_backward_rows_kernel<1, false>);
  check_last_error(who);
  if (!param_grads && norm.dw_partial == nullptr) return;
  launch_pdl(attnres_backward_params_kernel, unsigned((D + 31) / 32), dim3(32, kAttnResParamGroups),
             0, stream, static_cast<const double*>(partial), grid.blocks, query, norm_w, dquery,
             dnorm_w, static_cast<const double*>(norm.dw_partial), d_out_w, int(D));
  check_last_error(who);
}

// The fused norm's inputs (attnres_norm_backward*), checked.
AttnResNormIn norm_in_args(const char* who, const float* mixed, const float* out_w, const float* dy,
                           int64_t D, float norm_eps) {
  DM_CHECK(mixed != nullptr && out_w != nullptr && dy != nullptr, who,
           ": mixed, out_w and dy are needed");
  DM_CHECK(D <= kAttnResNormInMaxWidth, who, ": D=", D, " exceeds ", kAttnResNormInMaxWidth,
           " (use rmsnorm_backward, then attnres_backward)");
  AttnResNormIn norm;
  norm.mixed = mixed;
  norm.out_w = out_w;
  norm.dy = dy;
  norm.eps = norm_eps;
  return norm;
}

}  // namespace

void attnres_backward(const float* const* src, int S, const float* query, const float* norm_w,
                      const float* dout, float* const* dsrc, float* dquery, float* dnorm_w,
                      int64_t N, int64_t D, float eps, void* workspace, CUstream_st* stream) {
  attnres_backward_launch(src, S, query, norm_w, dout, AttnResNormIn{}, dsrc, dquery, dnorm_w,
                          nullptr, N, D, eps, workspace, stream);
}

void attnres_norm_backward_deferred(const float* const* src, int S, int deferred,
                                    const float* query, const float* norm_w, const float* mixed,
                                    const float* out_w, const float* dy, float* const* dsrc,
                                    float* dquery, float* dnorm_w, float* d_out_w, int64_t N,
                                    int64_t D, float eps, float norm_eps, float* dout_keep,
                                    float* coef_keep, void* workspace, CUstream_st* stream) {
  DM_CHECK(deferred >= 1 && deferred < S && dout_keep != nullptr && coef_keep != nullptr,
           "attnres_norm_backward_deferred (CUDA): ", deferred, " deferred of ", S,
           " sources (1..S−1), dout_keep and coef_keep needed");
  AttnResNormIn norm =
      norm_in_args("attnres_norm_backward_deferred (CUDA)", mixed, out_w, dy, D, norm_eps);
  norm.deferred = deferred;
  norm.dout_keep = dout_keep;
  norm.coef_keep = coef_keep;
  attnres_backward_launch(src, S, query, norm_w, nullptr, norm, dsrc, dquery, dnorm_w, d_out_w, N,
                          D, eps, workspace, stream);
}

void attnres_norm_backward(const float* const* src, int S, const float* query, const float* norm_w,
                           const float* mixed, const float* out_w, const float* dy,
                           float* const* dsrc, float* dquery, float* dnorm_w, float* d_out_w,
                           int64_t N, int64_t D, float eps, float norm_eps, void* workspace,
                           CUstream_st* stream) {
  const AttnResNormIn norm =
      norm_in_args("attnres_norm_backward (CUDA)", mixed, out_w, dy, D, norm_eps);
  attnres_backward_launch(src, S, query, norm_w, nullptr, norm, dsrc, dquery, dnorm_w, d_out_w, N,
                          D, eps, workspace, stream);
}

size_t attnres_flush_workspace_bytes(int64_t N, int64_t D, int P) {
  if (N <= 0 || D <= 0 || P <= 0) return 0;
  return align256(size_t(P) * size_t(flush_grid(N).tiles) * size_t(D) * sizeof(double));
}

void attnres_flush(const AttnResFlushSite* sites, int P, const float* const* src,
                   float* const* dsrc, int J, int64_t N, int64_t D, void* workspace,
                   CUstream_st* stream) {
  DM_CHECK(P >= 1 && P <= kAttnResFlushMaxSites && J >= 1 && J <= kAttnResFlushMaxSources,
           "attnres_flush (CUDA): ", P, " sites and ", J, " sources (1..", kAttnResFlushMaxSites,
           ", 1..", kAttnResFlushMaxSources, ")");
  DM_CHECK(N >= 0 && D > 0 && D % 4 == 0, "attnres_flush (CUDA): bad shape N=", N, " D=", D,
           " (D a multiple of 4)");
  DM_CHECK(workspace != nullptr, "attnres_flush (CUDA): a workspace is needed");
  if (N == 0) return;
  AttnResFlushArgs args{};
  bool aligned = true;
  for (int j = 0; j < J; ++j) {
    args.src[j] = src[j];
    args.dsrc[j] = dsrc[j];
    aligned = aligned && aligned16(src[j]) && aligned16(dsrc[j]);
  }
  for (int p = 0; p < P; ++p) {
    DM_CHECK(sites[p].deferred == J, "attnres_flush (CUDA): site ", p, " deferred ",
             sites[p].deferred, " sources, the flush takes ", J);
    args.dout[p] = sites[p].dout;
    args.coef[p] = sites[p].coef;
    args.query[p] = sites[p].query;
    args.norm_w[p] = sites[p].norm_w;
    aligned = aligned && aligned16(sites[p].dout);
  }
  DM_CHECK(aligned, "attnres_flush (CUDA): the rows of src, dsrc and dout must be 16-byte aligned");
  const FlushGrid grid = flush_grid(N);
  const size_t smem = size_t(kFlushStageRows) * size_t(P * J) * sizeof(float4);
  double* partial = static_cast<double*>(workspace);
  if (smem > 48 * 1024)
    DM_CUDA_CHECK(cudaFuncSetAttribute(attnres_flush_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_pdl(attnres_flush_kernel,
             dim3(unsigned((D + kFlushColumns - 1) / kFlushColumns), unsigned(grid.tiles)),
             dim3(kFlushThreads), smem, stream, args, P, J, N, int(D), grid.rows_per_tile, partial);
  check_last_error("attnres_flush");
  for (int p = 0; p < P; ++p) {
    if (sites[p].dquery == nullptr && sites[p].dnorm_w == nullptr) continue;
    launch_pdl(attnres_backward_params_kernel, unsigned((D + 31) / 32),
               dim3(32, kAttnResParamGroups), 0, stream,
               static_cast<const double*>(partial + int64_t(p) * grid.tiles * D), grid.tiles,
               sites[p].query, sites[p].norm_w, sites[p].dquery, sites[p].dnorm_w,
               static_cast<const double*>(nullptr), static_cast<float*>(nullptr), int(D));
  }
  check_last_error("attnres_flush (params)");
}

namespace {
// Radix-sort key bits: enough for every id in [0, V] (V itself is the "invalid id" key).
int embedding_key_bits(int64_t V) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= V) ++bits;
  return bits;
}
// cub's scratch for sorting N (uint32 key, uint32 value) pairs on `bits` key bits; the query
// launches nothing.
size_t embedding_sort_temp_bytes(int64_t N, int bits) {
  size_t bytes = 0;
  DM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), int(N), 0, bits));
  return bytes;
}
}  // namespace

size_t embedding_backward_workspace_bytes(int64_t N, int64_t V) {
  DM_CHECK(N >= 0 && N < (int64_t(1) << 31) && V > 0 && V < (int64_t(1) << 31),
           "embedding_backward (CUDA): N=", N, " V=", V, " out of range");
  if (N == 0) return 0;
  // keys in/out, rows in/out (uint32 [N] each), then cub's scratch.
  return 4 * align256(size_t(N) * sizeof(uint32_t)) +
         align256(embedding_sort_temp_bytes(N, embedding_key_bits(V)));
}

void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D, int64_t V,
                        float* dtable, void* workspace, CUstream_st* stream) {
  DM_CHECK(N >= 0 && N < (int64_t(1) << 31) && V > 0 && V < (int64_t(1) << 31) && D >= 0,
           "embedding_backward (CUDA): N=", N, " D=", D, " V=", V, " out of range");
  if (N == 0 || D == 0) return;
  DM_CHECK(workspace != nullptr, "embedding_backward (CUDA): workspace is null");
  const int bits = embedding_key_bits(V);
  const size_t slot = align256(size_t(N) * sizeof(uint32_t));
  char* base = static_cast<char*>(workspace);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + slot);
  uint32_t* rows_in = reinterpret_cast<uint32_t*>(base + 2 * slot);
  uint32_t* rows_out = reinterpret_cast<uint32_t*>(base + 3 * slot);
  void* sort_temp = base + 4 * slot;
  size_t sort_temp_bytes = embedding_sort_temp_bytes(N, bits);
  launch_pdl(embedding_backward_keys_kernel, elementwise_blocks(N, 256), 256, 0, stream, tokens, N,
             V, keys_in, rows_in);
  check_last_error("embedding_backward (keys)");
  // LSD radix sort is stable: equal tokens keep ascending n, so the per-token sum order is fixed.
  DM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_temp_bytes, keys_in, keys_out,
                                                rows_in, rows_out, int(N), 0, bits, stream));
  launch_pdl(embedding_backward_accumulate_kernel, unsigned(std::min<int64_t>(N, 65536)),
             kRowThreads, 0, stream, keys_out, rows_out, dp, N, D, V, dtable);
  check_last_error("embedding_backward (accumulate)");
}

void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D,
                        float* dtable, CUstream_st* stream) {
  DM_CHECK(N >= 0 && D >= 0, "embedding_backward (CUDA): N=", N, " D=", D);
  if (N == 0 || D == 0) return;
  launch_pdl(embedding_backward_atomic_kernel, unsigned(std::min<int64_t>(N, 65536)), kRowThreads,
             0, stream, tokens, dp, N, D, dtable);
  check_last_error("embedding_backward (atomic)");
}

size_t sum_squares_workspace_bytes(int64_t n) {
  return align256(size_t(std::max<int64_t>(sum_squares_blocks(n), 1)) * sizeof(double));
}

void sum_squares(const float* x, int64_t n, double* result_device, void* workspace,
                 CUstream_st* stream) {
  DM_CHECK(n >= 0 && workspace != nullptr && result_device != nullptr,
           "sum_squares (CUDA): n=", n, ", workspace and result must be set");
  double* partial = static_cast<double*>(workspace);
  const int64_t blocks = sum_squares_blocks(n);
  if (blocks > 0) {
    sum_squares_partial_kernel<<<unsigned(blocks), 256, 0, stream>>>(x, n, partial);
    check_last_error("sum_squares (partial)");
  }
  sum_squares_final_kernel<<<1, kSumSquaresThreads, 0, stream>>>(partial, blocks, result_device);
  check_last_error("sum_squares (final)");
}

void scale_inplace(float* x, int64_t n, float s, CUstream_st* stream) {
  DM_CHECK(n >= 0, "scale_inplace (CUDA): n=", n);
  if (n == 0) return;
  scale_inplace_kernel<<<elementwise_blocks(n, 256), 256, 0, stream>>>(x, n, s);
  check_last_error("scale_inplace");
}

}  // namespace dm::cuda
