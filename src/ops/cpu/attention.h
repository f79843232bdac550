// Causal softmax attention for MLA prefill/training (expanded form), CPU, fp32. SPEC §1.2.
//   q : [B, T, H, Dqk]   k : [B, T, H, Dqk]   v : [B, T, H, Dv]   o : [B, T, H, Dv]
//   lse (optional) : [B, H, T]  log-sum-exp of the scaled scores per query row (for backward)
// attention_causal_forward is flash-style: key blocks of `block` rows, online softmax in fp32,
// no T×T buffer. attention_causal_reference forms the full score row (tests only).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/arena.h"

namespace dm {

struct AttnShape {
  int64_t B = 1, T = 0, H = 1, Dqk = 0, Dv = 0;
};

void attention_causal_forward(const float* q, const float* k, const float* v, float* o,
                              float* lse, const AttnShape& s, float scale, Arena& ws,
                              int block = 64);
void attention_causal_reference(const float* q, const float* k, const float* v, float* o,
                                const AttnShape& s, float scale);
// Bytes attention_causal_forward takes from `ws` (released on return) at the current
// num_threads(): one slice per thread of scores [block, block], accumulator [block, Dv],
// running max and running sum [block].
size_t attention_causal_workspace_bytes(const AttnShape& s, int block = 64);

// Rotary tables for interleaved-pair RoPE (adjacent dims (2i, 2i+1) rotate together), with
// optional YaRN frequency interpolation (SPEC §1.2).
//   cos, sin : [P, D/2] for positions 0..P-1, D = rotary dim.
struct RopeParams {
  int dim = 0;
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0, original_max_position = 4096, beta_fast = 32, beta_slow = 1;
  double mscale = 1.0, mscale_all_dim = 0.0;
};
void rope_build_tables(const RopeParams& p, int64_t positions, float* cos, float* sin);
// Softmax scale multiplier under YaRN (m² with m = 0.1·mscale_all_dim·ln(s) + 1); 1 otherwise.
double rope_softmax_scale_factor(const RopeParams& p);
// Rotates x in place: x rows [N] of `stride` floats; the rotary slice starts at `offset` and is
// D = p.dim wide; row r has position pos[r]. Pairs (offset+2i, offset+2i+1) rotate by angle
// pos·f_i. (The HF "interleave" de-interleaves first; dot products of q and k are identical.)
void rope_apply_interleaved(float* x, int64_t N, int64_t stride, int64_t offset, int dim,
                            const int64_t* pos, const float* cos, const float* sin);

}  // namespace dm
