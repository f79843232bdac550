// The KDA layer's depthwise causal short conv + SiLU on CUDA, forward and backward (formulas in
// kda_layer_ops.h / kda_layer_backward_ops.h; CPU twins in ops/cpu/kda_prep.cpp). The forward
// kernel is templated on the activation storage: bf16 bits, or fp32 for the fp32 GPU mode (one
// body, fp32 math either way; only the loads and the store differ).
//
// Layout, both directions: a thread owns V consecutive channels (forward 4, backward 2; 1 when C
// or a tensor's alignment does not allow it) and a RUN of kConvRun consecutive tokens of one row,
// loads the run's inputs (plus a Kc−1 halo) into registers with every load issued before the
// first is used, then computes the run from registers: each input is read once and no
// per-element index division is left. Blocks are 32 lanes × 8 runs: a warp reads 32·V
// consecutive channels of one token (coalesced; with V = 1 each lane moved 2 bytes per load and
// the forward ran at ~0.5 TB/s), and the 8 runs of a block meet in shared memory for the weight
// gradient. The tap count is a template argument (1…kConvMaxTaps) so the window lives in
// registers.
//
// (The first version ran one thread per output element with three 64-bit divisions and Kc loads
// each, and the backward took three passes over [N, C] fp32: at N = 4096, C = 2048 on the H200
// the forward took 70 µs and the backward 290 µs per call; ~20 µs is the byte floor of the fused
// backward: x and dx bf16, dy fp32, each once.)
//
// Backward, fused into one pass: the thread recomputes a[t] = Σ_j w_j x[t−Kc+1+j] and
// da[t] = dy[t]·SiLU'(a[t]) for t in [t0, t1 + Kc − 1) (its run plus the Kc − 1 tokens whose conv
// reads the run's last positions; the halo is recomputed, ~Kc/kConvRun extra work), and from them
//   dw[c, j] partial  = Σ_{t in run} da[t]·x[t−Kc+1+j]   (registers, then the block's 8 runs in a
//                       fixed order, then the R block rows by a second kernel in a fixed order)
//   dx[s]             = Σ_j w_j·da[s+Kc−1−j]             (finalised once da[s+Kc−1] is known)
// Deterministic: every sum has a fixed order that depends only on the shape.
//
// σ(a) of the SiLU: for bf16 activations (the forward's bf16 instance and the backward, whose x is
// bf16) from one ex2.approx and one rcp.approx (silu_sigmoid<true>, ~2e-7 relative, far below
// the 2^-9 rounding of a bf16 output); the fp32 forward keeps the libm expf and the correctly
// rounded reciprocal (sigmoid_f32), so the fp32 GPU mode still matches the CPU to ~1e-6. ncu
// had the kernels issue-bound on that arithmetic (sixteenth session: 12.2M warp instructions for
// the forward, DRAM 9% busy).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise_storage.cuh"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/vector_access.cuh"

namespace dm::cuda {
namespace {

constexpr int kConvRun = 16;         // tokens per thread (the wide backward: kConvRunWide)
constexpr int kConvRunWide = 8;      // the 2-channel backward's run: its registers stay ≤ 128
constexpr int kConvLanes = 32;       // channels per block (one warp row)
constexpr int kConvRunsPerBlock = 8; // runs per block (block = 32 × 8 = 256 threads)
constexpr int kConvMaxTaps = 8;
constexpr int64_t kConvMaxRunGroups = 256;  // backward: bound on the dw partial rows

// σ(a): the fast form for bf16 activations, the accurate one for fp32 (file comment).
template <bool kFast>
__device__ __forceinline__ float silu_sigmoid(float a) {
  if constexpr (kFast)
    return __fdividef(1.0f, 1.0f + __expf(-a));  // e = ∞ below a ≈ −88: σ = 0
  else
    return sigmoid_f32(a);
}

// Runs of RUN tokens of a [B, T] token grid: ceil(T / RUN) per row, so a run never crosses rows.
template <int RUN>
struct ConvRuns {
  int64_t T, per_row, total;
  __host__ __device__ ConvRuns(int64_t B, int64_t T_)
      : T(T_), per_row((T_ + RUN - 1) / RUN), total(B * per_row) {}
  // Run r → flat index of its row's token 0, and its token range [t0, t1) in the row (T < 2³¹:
  // positions inside a row are 32-bit, which halves the compares of the checked path).
  __device__ void locate(int64_t r, int64_t& row_base, int& t0, int& t1) const {
    const int64_t row = r / per_row;
    row_base = row * T;
    t0 = int(r - row * per_row) * RUN;
    t1 = min(int(T), t0 + RUN);
  }
};

// Backward's grid rows R (the dw partial rows), a function of N and the run length only.
int64_t conv_run_groups(int64_t N, int run) {
  const int64_t groups = (N + run * kConvRunsPerBlock - 1) / (run * kConvRunsPerBlock);
  return std::clamp<int64_t>(groups, 1, kConvMaxRunGroups);
}

// The run's inputs, every load issued before any is used: a thread walking its tokens one load
// at a time waited on memory once per token (the first version of these kernels: 34 µs for the
// forward at N = 4096, C = 2048, ~1 TB/s). Position i of the run (first_pos + i of the row) holds
// V channels c … c+V−1 as loaded (bf16 stays packed: half the registers of floats, widened at
// each use), 0 outside [0, T); token (row_base + t)'s element c sits at src[(row_base + t)·C + c].
template <int COUNT, int V, typename Src>
struct RunInputs {
  using Raw = typename RawVector<V* int(sizeof(Src))>::type;
  Raw raw[COUNT];

  __device__ __forceinline__ void load(const Src* __restrict__ src, int64_t row_base, int first_pos,
                                       int T, int64_t C, int64_t c) {
    const Src* row = src + row_base * C + c;
#pragma unroll
    for (int i = 0; i < COUNT; ++i) {
      const int t = first_pos + i;
      if (t >= 0 && t < T) {
        raw[i] = *reinterpret_cast<const Raw*>(row + int64_t(t) * C);
      } else {
        memset(&raw[i], 0, sizeof(Raw));
      }
    }
  }
  __device__ __forceinline__ float at(int i, int v) const {
    Src elements[V];
    memcpy(elements, &raw[i], sizeof(Raw));
    return load_as_float(elements, v);
  }
  // Overwrites channel v of position i (fp32 inputs only: the backward turns dy into da in place).
  __device__ __forceinline__ void set(int i, int v, float value) {
    static_assert(sizeof(Src) == sizeof(float), "set: fp32 inputs only");
    Src elements[V];
    memcpy(elements, &raw[i], sizeof(Raw));
    elements[v] = value;
    memcpy(&raw[i], elements, sizeof(Raw));
  }
};

// First readable position of each token first_pos + i (document start, or 0; 0 past T).
template <int COUNT>
__device__ __forceinline__ void load_firsts(const int32_t* __restrict__ doc_start, int64_t row_base,
                                            int first_pos, int T, int (&firsts)[COUNT]) {
#pragma unroll
  for (int i = 0; i < COUNT; ++i) {
    const int t = first_pos + i;
    firsts[i] = doc_start && t >= 0 && t < T ? max(int(doc_start[row_base + t]), 0) : 0;
  }
}

// a = Σ_j w_j·x[t−KC+1+j] over the taps whose position ≥ first, in tap order (the CPU's), with
// xs.at(o + j, v) holding position t−KC+1+j of channel v. Unchecked (kChecked false) every tap
// is summed: the same bits whenever no tap lies before its document's start, since taps before
// position 0 hold zeros and a + (±0) = a for the +0-started sum.
template <bool kChecked, int KC, class Inputs>
__device__ __forceinline__ float conv_taps(const float (&w)[KC], const Inputs& xs, int v, int o,
                                           int t, int first) {
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < KC; ++j)
    if (!kChecked || t - (KC - 1) + j >= first) a += w[j] * xs.at(o + j, v);
  return a;
}

// Whether a run's window needs no per-tap checks: every token of it inside [0, T) (`inside`) and
// no document starting inside the window (doc starts do not decrease along a row, so the last
// token's is the largest). The branch is the same for the 32 lanes of a warp (one run).
template <int COUNT>
__device__ __forceinline__ bool window_clean(const int (&firsts)[COUNT], int window_start,
                                             bool inside) {
  int latest = 0;
#pragma unroll
  for (int i = 0; i < COUNT; ++i) latest = max(latest, firsts[i]);
  return inside && latest <= max(window_start, 0);
}

// x, y [B, T, C] (Act: bf16 bits uint16_t, or float in the fp32 mode); w [C, KC]. A thread owns
// V consecutive channels (one load per position: V = 4 moves 8 or 16 bytes a lane where single
// bf16 loads moved 2); grid (ceil(C / (32·V)), ≤ 65535), block (32, 8); grid-stride over runs.
template <int KC, int V, typename Act>
__global__ void __launch_bounds__(kConvLanes* kConvRunsPerBlock)
    short_conv_silu_kernel(const Act* __restrict__ x, const float* __restrict__ w_all,
                           Act* __restrict__ y, ConvRuns<kConvRun> runs, int64_t C,
                           const int32_t* __restrict__ doc_start) {
  pdl_wait_then_launch_dependents();        // PDL (pdl.h): before any input is read
  constexpr int kSpan = KC - 1 + kConvRun;  // positions t0−KC+1 … t0+kConvRun−1
  const int64_t c = (int64_t(blockIdx.x) * kConvLanes + threadIdx.x) * V;
  if (c >= C) return;  // no barrier in this kernel; C % V == 0
  float w[V][KC];
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < KC; ++j) w[v][j] = w_all[(c + v) * KC + j];
  const int T = int(runs.T);
  for (int64_t r = int64_t(blockIdx.y) * kConvRunsPerBlock + threadIdx.y; r < runs.total;
       r += int64_t(gridDim.y) * kConvRunsPerBlock) {
    int64_t base;
    int t0, t1;
    runs.locate(r, base, t0, t1);
    RunInputs<kSpan, V, Act> xs;
    int firsts[kConvRun];
    xs.load(x, base, t0 - (KC - 1), T, C, c);
    load_firsts(doc_start, base, t0, T, firsts);
    Act* out = y + (base + t0) * C + c;
    const auto run_outputs = [&](auto checked) {
      constexpr bool kChecked = decltype(checked)::value;
#pragma unroll
      for (int i = 0; i < kConvRun; ++i) {
        if (kChecked && t0 + i >= t1) break;
        float values[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float a = conv_taps<kChecked>(w[v], xs, v, i, t0 + i, firsts[i]);
          values[v] = a * silu_sigmoid<std::is_same_v<Act, uint16_t>>(a);
        }
        store_vector_from_float<V>(out, int64_t(i) * C, values);
      }
    };
    if (window_clean(firsts, t0 - (KC - 1), t1 == t0 + kConvRun))
      run_outputs(std::false_type());
    else
      run_outputs(std::true_type());
  }
}

// Fused backward (file comment), V channels per thread as in the forward. Grid
// (ceil(C / (32·V)), R = conv_run_groups(N)), block (32, 8); partial [R, C·KC]: block row
// blockIdx.y's Σ over its runs of da·x per (c, j).
template <int KC, int V, int RUN>
__global__ void __launch_bounds__(kConvLanes* kConvRunsPerBlock, V > 1 ? 2 : 1)
    short_conv_silu_backward_kernel(const uint16_t* __restrict__ x, const float* __restrict__ w_all,
                                    const float* __restrict__ dy, uint16_t* __restrict__ dx,
                                    float* __restrict__ partial, ConvRuns<RUN> runs, int64_t C,
                                    const int32_t* __restrict__ doc_start, int64_t ld_dx) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  // da is needed at tokens t0 … t1+KC−2 (the run and the KC−1 tokens whose conv reads its last
  // positions); their pre-activations read x at t0−KC+1 … t1+KC−2.
  constexpr int kTokens = RUN + KC - 1;
  constexpr int kSpan = kTokens + KC - 1;
  __shared__ float dw_runs[kConvRunsPerBlock][KC][kConvLanes * V];
  const int64_t c = (int64_t(blockIdx.x) * kConvLanes + threadIdx.x) * V;
  const bool active = c < C;  // inactive lanes still reach the barrier; C % V == 0
  float w[V][KC], dw[V][KC];
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      w[v][j] = active ? w_all[(c + v) * KC + j] : 0.0f;
      dw[v][j] = 0.0f;
    }
  const int T = int(runs.T);
  for (int64_t r = int64_t(blockIdx.y) * kConvRunsPerBlock + threadIdx.y; active && r < runs.total;
       r += int64_t(gridDim.y) * kConvRunsPerBlock) {
    int64_t base;
    int t0, t1;
    runs.locate(r, base, t0, t1);
    RunInputs<kSpan, V, uint16_t> xs;
    RunInputs<kTokens, V, float> da;  // dy, turned into da in place below
    xs.load(x, base, t0 - (KC - 1), T, C, c);
    da.load(dy, base, t0, T, C, c);
    int firsts[kTokens];
    load_firsts(doc_start, base, t0, T, firsts);
    uint16_t* out = dx + (base + t0) * ld_dx + c;
    // Unchecked (a clean window, every token < T): the checks below all pass, so it drops them.
    const auto run_gradients = [&](auto checked) {
      constexpr bool kChecked = decltype(checked)::value;
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        const int t = t0 + i;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          if (kChecked && t >= T) continue;  // da = 0 there: dy loaded as 0 past T
          const float a = conv_taps<kChecked>(w[v], xs, v, i, t, firsts[i]);
          const float sig = silu_sigmoid<true>(a);                            // x is bf16
          const float d_a = da.at(i, v) * (sig * (1.0f + a * (1.0f - sig)));  // dy·SiLU'(a)
          da.set(i, v, d_a);
          if (kChecked ? t < t1 : i < RUN) {
#pragma unroll
            for (int j = 0; j < KC; ++j)
              if (!kChecked || t - (KC - 1) + j >= firsts[i]) dw[v][j] += d_a * xs.at(i + j, v);
          }
        }
      }
      // dx[s] = Σ_j w_j·da[s+KC−1−j] over the tokens (< T) whose document starts at or before
      // s; j ascending as on the CPU.
#pragma unroll
      for (int i = 0; i < RUN; ++i) {
        const int s_pos = t0 + i;
        if (kChecked && s_pos >= t1) break;
        float acc[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc[v] = 0.0f;
#pragma unroll
          for (int j = 0; j < KC; ++j) {
            const int u = i + KC - 1 - j;  // token s + KC − 1 − j
            if (!kChecked || (t0 + u < T && s_pos >= firsts[u])) acc[v] += w[v][j] * da.at(u, v);
          }
        }
        store_vector_from_float<V>(out, int64_t(i) * ld_dx, acc);
      }
    };
    if (window_clean(firsts, t0 - (KC - 1), t0 + kTokens <= T))
      run_gradients(std::false_type());
    else
      run_gradients(std::true_type());
  }
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < KC; ++j) dw_runs[threadIdx.y][j][threadIdx.x * V + v] = dw[v][j];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        float sum = 0.0f;
        for (int q = 0; q < kConvRunsPerBlock; ++q)
          sum += dw_runs[q][j][threadIdx.x * V + v];  // fixed order
        partial[int64_t(blockIdx.y) * C * KC + (c + v) * KC + j] = sum;
      }
  }
}

// dw[m] += Σ_{g<R} partial[g, m] in g order; one thread per m of C·Kc (reads coalesced over m).
__global__ void conv_weight_grad_reduce_kernel(const float* __restrict__ partial, int64_t R,
                                               int64_t M, float* __restrict__ dw) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  const int64_t m = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= M) return;
  float sum = 0.0f;
  for (int64_t g = 0; g < R; ++g) sum += partial[g * M + m];
  dw[m] += sum;
}

// Whether V channels per thread fit (vector_access.cuh's vectors_fit over the channels: C a
// multiple of V, every base aligned to V of its elements). The environment's
// DM_SHORT_CONV_WIDE=0 (read once) keeps one channel per thread, to compare.
bool conv_vectors_fit(int64_t C, int V,
                      std::initializer_list<std::pair<const void*, size_t>> tensors) {
  static const bool wide_allowed = env_flag("DM_SHORT_CONV_WIDE", true);
  return wide_allowed && vectors_fit(C, V, tensors);
}

// Calls f(std::integral_constant<int, Kc>) for Kc in 1…kConvMaxTaps.
template <class F>
void with_taps(int Kc, F&& f) {
  switch (Kc) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    case 8: return f(std::integral_constant<int, 8>());
    default:
      throw Error(str_cat("cuda short conv: ", Kc, " taps (supported: 1…", kConvMaxTaps, ")"));
  }
}

// The forward launch for either activation type (bf16 bits or fp32): same grid either way.
template <typename Act>
void short_conv_silu_forward_launch(const Act* x, const float* w, Act* y, int64_t B, int64_t T,
                                    int64_t C, int Kc, const int32_t* doc_start,
                                    KdaLayerStream stream) {
  DM_CHECK(B >= 0 && T >= 0 && C > 0 && Kc > 0, "cuda kda_short_conv_silu_forward: bad shape B=",
           B, " T=", T, " C=", C, " Kc=", Kc);
  if (B * T == 0) return;
  const ConvRuns<kConvRun> runs(B, T);
  const unsigned run_blocks =
      unsigned(std::min<int64_t>(ceil_div(runs.total, kConvRunsPerBlock), 65535));
  const bool wide = conv_vectors_fit(C, 4, {{x, sizeof(Act)}, {y, sizeof(Act)}});
  with_taps(Kc, [&](auto taps) {
    constexpr int KC = decltype(taps)::value;
    if (wide)
      launch_pdl(short_conv_silu_kernel<KC, 4, Act>,
                 dim3(unsigned(ceil_div(C, 4 * kConvLanes)), run_blocks),
                 dim3(kConvLanes, kConvRunsPerBlock), 0, stream, x, w, y, runs, C, doc_start);
    else
      launch_pdl(short_conv_silu_kernel<KC, 1, Act>,
                 dim3(unsigned(ceil_div(C, kConvLanes)), run_blocks),
                 dim3(kConvLanes, kConvRunsPerBlock), 0, stream, x, w, y, runs, C, doc_start);
  });
  check_last_error("cuda kda_short_conv_silu_forward");
}

}  // namespace

void kda_short_conv_silu_forward(const uint16_t* x, const float* w, uint16_t* y, int64_t B,
                                 int64_t T, int64_t C, int Kc, const int32_t* doc_start,
                                 KdaLayerStream stream) {
  short_conv_silu_forward_launch(x, w, y, B, T, C, Kc, doc_start, stream);
}

void kda_short_conv_silu_forward(const float* x, const float* w, float* y, int64_t B, int64_t T,
                                 int64_t C, int Kc, const int32_t* doc_start,
                                 KdaLayerStream stream) {
  short_conv_silu_forward_launch(x, w, y, B, T, C, Kc, doc_start, stream);
}

size_t kda_short_conv_silu_backward_partial_floats(int64_t N, int64_t C, int Kc) {
  // The shorter run gives at least as many partial rows: enough for either kernel.
  return size_t(conv_run_groups(N, std::min(kConvRun, kConvRunWide)) * C * Kc);
}

void kda_short_conv_silu_backward(const uint16_t* x, const float* w, const float* dy, uint16_t* dx,
                                  float* dw, float* partial, int64_t B, int64_t T, int64_t C,
                                  int Kc, const int32_t* doc_start, CUstream_st* stream,
                                  int64_t ld_dx) {
  DM_CHECK(B >= 0 && T >= 0 && C > 0 && Kc > 0,
           "cuda kda_short_conv_silu_backward: bad shape B=", B, " T=", T, " C=", C, " Kc=", Kc);
  if (ld_dx == 0) ld_dx = C;
  DM_CHECK(ld_dx >= C, "cuda kda_short_conv_silu_backward: dx row stride ", ld_dx, " < C=", C);
  const int64_t N = B * T;
  if (N == 0) return;
  // Two channels a thread store bf16 pairs: every row of dx must start 4-byte aligned.
  const bool wide = ld_dx % 2 == 0 && conv_vectors_fit(C, 2, {{x, 2}, {dy, 4}, {dx, 2}});
  const int64_t R = conv_run_groups(N, wide ? kConvRunWide : kConvRun), M = C * Kc;
  const dim3 block(kConvLanes, kConvRunsPerBlock);
  with_taps(Kc, [&](auto taps) {
    constexpr int KC = decltype(taps)::value;
    if (wide)
      launch_pdl(short_conv_silu_backward_kernel<KC, 2, kConvRunWide>,
                 dim3(unsigned(ceil_div(C, 2 * kConvLanes)), unsigned(R)), block, 0, stream, x, w,
                 dy, dx, partial, ConvRuns<kConvRunWide>(B, T), C, doc_start, ld_dx);
    else
      launch_pdl(short_conv_silu_backward_kernel<KC, 1, kConvRun>,
                 dim3(unsigned(ceil_div(C, kConvLanes)), unsigned(R)), block, 0, stream, x, w, dy,
                 dx, partial, ConvRuns<kConvRun>(B, T), C, doc_start, ld_dx);
  });
  check_last_error("cuda kda_short_conv_silu_backward");
  launch_pdl(conv_weight_grad_reduce_kernel, unsigned(ceil_div(M, 256)), 256, 0, stream, partial, R,
             M, dw);
  check_last_error("cuda kda_short_conv_silu_backward (dw)");
}

}  // namespace dm::cuda
