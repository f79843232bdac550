#include "ops/cpu/kda_prep.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dm {
namespace {

// First position the conv of token t of row b may read: its document start, or −(Kc−1) (the
// tail) for tokens of the row's first document.
inline int64_t short_conv_first_readable(const int32_t* doc_start, int64_t b, int64_t T,
                                         int64_t t, int Kc) {
  const int64_t start = doc_start ? doc_start[b * T + t] : 0;
  return start > 0 ? start : -int64_t(Kc - 1);
}

// Row [C] that tap j of token t reads: x at position t − (Kc−1) + j, the tail for positions
// before the row, nullptr when the position is not readable (another document, no tail).
template <typename Real>
inline const Real* short_conv_source_row(const Real* x, const Real* tail, int64_t b, int64_t T,
                                         int64_t C, int Kc, int64_t t, int j,
                                         int64_t first_readable) {
  const int64_t src = t - (Kc - 1) + j;
  if (src < first_readable) return nullptr;
  if (src >= 0) return x + (b * T + src) * C;
  return tail ? tail + (b * (Kc - 1) + (Kc - 1 + src)) * C : nullptr;
}

}  // namespace

template <typename Real>
void short_conv_silu_forward(const Real* x, const Real* w, const std::type_identity_t<Real>* tail,
                             Real* y, int64_t B, int64_t T, int64_t C, int Kc,
                             const int32_t* doc_start) {
#pragma omp parallel for collapse(2) schedule(static) if (B * T * C > 65536)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t first_readable = short_conv_first_readable(doc_start, b, T, t, Kc);
      Real* y_row = y + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) y_row[c] = Real(0);
      // Tap by tap, each a contiguous source row: the channel loop vectorises (w is read with
      // stride Kc, which is tiny).
      for (int j = 0; j < Kc; ++j) {
        const Real* x_row = short_conv_source_row(x, tail, b, T, C, Kc, t, j, first_readable);
        if (!x_row) continue;
        for (int64_t c = 0; c < C; ++c) y_row[c] += w[c * Kc + j] * x_row[c];
      }
      for (int64_t c = 0; c < C; ++c) y_row[c] = silu(y_row[c]);
    }
}

template <typename Real>
void short_conv_silu_backward(const Real* x, const Real* w, const std::type_identity_t<Real>* tail,
                              const Real* dy, Real* dx, Real* dw, int64_t B, int64_t T, int64_t C,
                              int Kc, const int32_t* doc_start) {
  // One thread per block of channels: dw[c, :] and the columns c of dx are written by one thread
  // only. Inside a block, row by row with the channel loops innermost (contiguous, vectorised);
  // every dw[c, j] and dx element still sums its terms in (b, t, j) order, as one thread per
  // channel did.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (B * T * C > 65536)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock, width = std::min(kBlock, C - c0);
    Real pre[kBlock], da[kBlock];
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t first_readable = short_conv_first_readable(doc_start, b, T, t, Kc);
        // The pre-activation of the row's block, tap by tap (the forward's order).
        for (int64_t c = 0; c < width; ++c) pre[c] = Real(0);
        for (int j = 0; j < Kc; ++j) {
          const Real* x_row = short_conv_source_row(x, tail, b, T, C, Kc, t, j, first_readable);
          if (!x_row) continue;
          for (int64_t c = 0; c < width; ++c) pre[c] += w[(c0 + c) * Kc + j] * x_row[c0 + c];
        }
        // SiLU'(a) = σ(a)·(1 + a·(1 − σ(a)))
        const Real* dy_row = dy + (b * T + t) * C + c0;
        for (int64_t c = 0; c < width; ++c) {
          const Real sig = kda_sigmoid(pre[c]);
          da[c] = dy_row[c] * sig * (Real(1) + pre[c] * (Real(1) - sig));
        }
        for (int j = 0; j < Kc; ++j) {
          const int64_t src = t - (Kc - 1) + j;
          const Real* x_row = short_conv_source_row(x, tail, b, T, C, Kc, t, j, first_readable);
          if (!x_row) continue;
          if (src >= 0) {
            Real* dx_row = dx + (b * T + src) * C + c0;
            for (int64_t c = 0; c < width; ++c) dx_row[c] += w[(c0 + c) * Kc + j] * da[c];
          }
          for (int64_t c = 0; c < width; ++c) dw[(c0 + c) * Kc + j] += da[c] * x_row[c0 + c];
        }
      }
  }
}

template <typename Real>
void kda_gate_forward(const Real* f, const Real* A_log, const Real* dt_bias, Real* g, int64_t N,
                      int64_t H, int64_t K, KdaGateKind kind, float lower_bound) {
  // The kind is tested outside the channel loop: a select inside keeps it scalar.
  const bool softplus = kind == KdaGateKind::Softplus;
  const Real lb = Real(lower_bound);
#pragma omp parallel for schedule(static) if (N * H * K > 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const Real a = std::exp(A_log[h]);
      const Real* f_row = f + n * H * K + h * K;
      const Real* bias = dt_bias + h * K;
      Real* g_row = g + n * H * K + h * K;
      if (softplus)
        for (int64_t i = 0; i < K; ++i) g_row[i] = -a * kda_softplus(f_row[i] + bias[i]);
      else
        for (int64_t i = 0; i < K; ++i) g_row[i] = lb * kda_sigmoid(a * (f_row[i] + bias[i]));
    }
}

template <typename Real>
void kda_gate_backward(const Real* f, const Real* A_log, const Real* dt_bias, const Real* dg,
                       Real* df, Real* dA_log, Real* ddt_bias, int64_t N, int64_t H, int64_t K,
                       KdaGateKind kind, float lower_bound) {
  const int64_t HK = H * K;
  const bool softplus = kind == KdaGateKind::Softplus;
  const Real lb = Real(lower_bound);
  // One thread per head: dA_log[h] and ddt_bias[h·K..] are then written by one thread only.
  // Tokens outer, channels inner (contiguous, vectorised); each channel's dt_bias sum still runs
  // over the tokens in order, dA_log sums per channel first. Per-channel sums on the stack.
  constexpr int64_t kMaxChannels = 512;
  DM_CHECK(K <= kMaxChannels, "kda_gate_backward: head dim ", K, " above ", kMaxChannels);
#pragma omp parallel for schedule(static) if (N * HK > 65536)
  for (int64_t h = 0; h < H; ++h) {
    const Real a = std::exp(A_log[h]);
    Real d_bias[kMaxChannels], d_a_log[kMaxChannels];
    for (int64_t i = 0; i < K; ++i) d_bias[i] = d_a_log[i] = Real(0);
    const Real* bias = dt_bias + h * K;
    for (int64_t n = 0; n < N; ++n) {
      const Real* f_row = f + n * HK + h * K;
      const Real* dg_row = dg + n * HK + h * K;
      Real* df_row = df + n * HK + h * K;
      if (softplus) {
        // g = −a·softplus(z): ∂g/∂z = −a·σ(z) (−a above the threshold), ∂g/∂A_log = g.
        for (int64_t i = 0; i < K; ++i) {
          const Real z = f_row[i] + bias[i];
          const Real softplus_slope = z > Real(20) ? Real(1) : kda_sigmoid(z);
          const Real dz = -dg_row[i] * a * softplus_slope;
          d_a_log[i] += -dg_row[i] * a * kda_softplus(z);
          df_row[i] += dz;
          d_bias[i] += dz;
        }
      } else {
        // g = lb·σ(a·z): ∂g/∂z = lb·a·σ(1−σ), ∂g/∂A_log = lb·σ(1−σ)·a·z.
        for (int64_t i = 0; i < K; ++i) {
          const Real z = f_row[i] + bias[i];
          const Real sig = kda_sigmoid(a * z);
          const Real slope = lb * sig * (Real(1) - sig);
          const Real dz = dg_row[i] * slope * a;
          d_a_log[i] += dg_row[i] * slope * a * z;
          df_row[i] += dz;
          d_bias[i] += dz;
        }
      }
    }
    Real total = 0;
    for (int64_t i = 0; i < K; ++i) {
      ddt_bias[h * K + i] += d_bias[i];
      total += d_a_log[i];
    }
    dA_log[h] += total;
  }
}

#define DM_KDA_PREP_INSTANTIATE(Real)                                                           \
  template void short_conv_silu_forward<Real>(const Real*, const Real*, const Real*, Real*,     \
                                              int64_t, int64_t, int64_t, int, const int32_t*);  \
  template void short_conv_silu_backward<Real>(const Real*, const Real*, const Real*,           \
                                               const Real*, Real*, Real*, int64_t, int64_t,     \
                                               int64_t, int, const int32_t*);                   \
  template void kda_gate_forward<Real>(const Real*, const Real*, const Real*, Real*, int64_t,   \
                                       int64_t, int64_t, KdaGateKind, float);                   \
  template void kda_gate_backward<Real>(const Real*, const Real*, const Real*, const Real*,     \
                                        Real*, Real*, Real*, int64_t, int64_t, int64_t,         \
                                        KdaGateKind, float);
DM_KDA_PREP_INSTANTIATE(float)
DM_KDA_PREP_INSTANTIATE(double)
#undef DM_KDA_PREP_INSTANTIATE

}  // namespace dm
