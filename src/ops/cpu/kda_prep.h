// The per-token preparation around the KDA operator (CPU, fp32). SPEC §1.1.
//   short_conv_silu_forward: depthwise causal conv (kernel Kc, no bias) + SiLU, per sequence.
//       x, y [B, T, C]; w [C, Kc] (checkpoint [C,1,Kc]); y[t,c] = SiLU(Σ_j w[c,j]·x[t−Kc+1+j, c]),
//       positions before 0 read from `tail` [B, Kc−1, C] (nullptr = zeros; decode carries it).
//   kda_gate_forward: log-decay g [N, H·K] from the raw low-rank output f [N, H·K]:
//       softplus gate: g = −exp(A_log[h]) · softplus(f + dt_bias)
//       safe gate:     g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))          (lb < 0)
#pragma once
#include <cstdint>

#include "io/config.h"

namespace dm {

void short_conv_silu_forward(const float* x, const float* w, const float* tail, float* y, int64_t B,
                             int64_t T, int64_t C, int Kc);
void kda_gate_forward(const float* f, const float* A_log, const float* dt_bias, float* g, int64_t N,
                      int64_t H, int64_t K, KdaGateKind kind, float lower_bound);

}  // namespace dm
