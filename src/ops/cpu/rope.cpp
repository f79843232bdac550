// Rotary position embedding with interleaved pairs and optional YaRN (SPEC §1.2, DeepSeek-V3).
//
// Frequencies f_i = θ^(−2i/D), i < D/2. Under YaRN the low-frequency dims (high i, wavelength
// longer than the original context) are interpolated (f_i / s), the high-frequency dims (low i)
// are kept, with a linear ramp in between. This matches DeepSeek-V3's reference, which writes
//   inv_freq = freq_inter·(1 − mask) + freq_extra·mask,  mask = 1 − linear_ramp(lo, hi)
// i.e. freq_inter weighted by linear_ramp: f ← (f/s)·ramp + f·(1 − ramp), ramp = 0 for i ≤ lo.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"
#include "ops/cpu/attention.h"

namespace dm {

namespace {

// YaRN attention-temperature factor: 0.1·m·ln(s) + 1 for s > 1, else 1.
double yarn_get_mscale(double scaling_factor, double mscale) {
  if (scaling_factor <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scaling_factor) + 1.0;
}

// The (fractional) frequency index at which dim pairs complete `num_rotations` full turns over
// the original context length L0:  D·ln(L0 / (2π·r)) / (2·ln θ).
double yarn_correction_dim(double num_rotations, int dim, double theta,
                           double original_max_position) {
  return dim * std::log(original_max_position / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

void check_rope_params(const RopeParams& p) {
  DM_CHECK(p.dim > 0 && p.dim % 2 == 0, "rope: rotary dim must be positive and even, got ",
           p.dim);
  DM_CHECK(p.theta > 1.0, "rope: theta must be > 1, got ", p.theta);
  if (p.yarn) {
    DM_CHECK(p.factor > 0.0, "rope: yarn factor must be positive, got ", p.factor);
    DM_CHECK(p.original_max_position > 0.0,
             "rope: yarn original_max_position_embeddings must be positive, got ",
             p.original_max_position);
    DM_CHECK(p.beta_fast > 0.0 && p.beta_slow > 0.0, "rope: yarn beta_fast/beta_slow must be "
             "positive, got ", p.beta_fast, "/", p.beta_slow);
  }
}

}  // namespace

template <typename Real>
void rope_build_tables(const RopeParams& p, int64_t positions, Real* cos, Real* sin) {
  check_rope_params(p);
  DM_CHECK(positions >= 0, "rope: negative table length ", positions);
  const int half_dim = p.dim / 2;

  // inverse_frequency[i], i < D/2. Built once per model, so a heap vector is fine here.
  std::vector<double> inverse_frequency(static_cast<size_t>(half_dim));
  for (int i = 0; i < half_dim; ++i)
    inverse_frequency[i] = std::pow(p.theta, -2.0 * double(i) / double(p.dim));

  double amplitude = 1.0;
  if (p.yarn) {
    double ramp_low = std::floor(
        yarn_correction_dim(p.beta_fast, p.dim, p.theta, p.original_max_position));
    double ramp_high = std::ceil(
        yarn_correction_dim(p.beta_slow, p.dim, p.theta, p.original_max_position));
    // The clamp is to [0, D−1] (full rotary dim, not D/2) exactly as the reference does.
    ramp_low = std::max(ramp_low, 0.0);
    ramp_high = std::min(ramp_high, double(p.dim - 1));
    if (ramp_high == ramp_low) ramp_high += 0.001;  // reference's guard against 0/0
    for (int i = 0; i < half_dim; ++i) {
      const double ramp = std::clamp((double(i) - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
      const double f = inverse_frequency[i];
      inverse_frequency[i] = (f / p.factor) * ramp + f * (1.0 - ramp);
    }
    amplitude = yarn_get_mscale(p.factor, p.mscale) / yarn_get_mscale(p.factor, p.mscale_all_dim);
  }
  // The reference keeps inv_freq as an fp32 buffer; at position 1e5 the fp32 rounding of f
  // moves the angle by up to ~6e-3 rad, so round f like the checkpoint saw it, then form the angle
  // pos·f in double (more exact than the reference's fp32 product, which only adds noise).
  std::vector<double> frequency_as_trained(static_cast<size_t>(half_dim));
  for (int i = 0; i < half_dim; ++i)
    frequency_as_trained[i] = double(float(inverse_frequency[i]));

#pragma omp parallel for schedule(static) if (positions * half_dim >= (1 << 16))
  for (int64_t position = 0; position < positions; ++position) {
    Real* cos_row = cos + position * half_dim;  // [D/2]
    Real* sin_row = sin + position * half_dim;  // [D/2]
    for (int i = 0; i < half_dim; ++i) {
      const double angle = double(position) * frequency_as_trained[i];
      cos_row[i] = Real(std::cos(angle) * amplitude);
      sin_row[i] = Real(std::sin(angle) * amplitude);
    }
  }
}

double rope_softmax_scale_factor(const RopeParams& p) {
  if (!p.yarn || p.mscale_all_dim <= 0.0) return 1.0;
  const double m = yarn_get_mscale(p.factor, p.mscale_all_dim);
  return m * m;
}

template <typename Real>
void rope_apply_interleaved(Real* x, int64_t N, int64_t stride, int64_t offset, int dim,
                            const int64_t* pos, const Real* cos, const Real* sin, bool inverse) {
  DM_CHECK(dim >= 0 && dim % 2 == 0, "rope: rotary dim must be even, got ", dim);
  DM_CHECK(offset >= 0 && offset + dim <= stride, "rope: rotary slice [", offset, ", ",
           offset + dim, ") does not fit a row of ", stride);
  const int half_dim = dim / 2;
  // The inverse (negative-angle) rotation flips the sign of sin; with the YaRN amplitude folded
  // into the tables it is the transpose of the forward map, which is what the backward needs.
  const Real sin_sign = inverse ? Real(-1) : Real(1);

#pragma omp parallel for schedule(static) if (N * half_dim >= (1 << 14))
  for (int64_t row = 0; row < N; ++row) {
    Real* pair_base = x + row * stride + offset;  // [D] = D/2 interleaved pairs
    const Real* cos_row = cos + pos[row] * half_dim;
    const Real* sin_row = sin + pos[row] * half_dim;
    for (int i = 0; i < half_dim; ++i) {
      const Real x0 = pair_base[2 * i], x1 = pair_base[2 * i + 1];
      const Real c = cos_row[i], s = sin_sign * sin_row[i];
      pair_base[2 * i] = x0 * c - x1 * s;
      pair_base[2 * i + 1] = x1 * c + x0 * s;
    }
  }
}

void rope_positions_from_doc_start(const int32_t* doc_start, int64_t B, int64_t T, int64_t* pos) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t start = doc_start ? doc_start[b * T + t] : 0;
      DM_CHECK(start >= 0 && start <= t, "rope: doc_start[", b, ", ", t, "] = ", start,
               " must lie in [0, ", t, "]");
      pos[b * T + t] = t - start;
    }
}

template void rope_build_tables<float>(const RopeParams&, int64_t, float*, float*);
template void rope_build_tables<double>(const RopeParams&, int64_t, double*, double*);
template void rope_apply_interleaved<float>(float*, int64_t, int64_t, int64_t, int,
                                            const int64_t*, const float*, const float*, bool);
template void rope_apply_interleaved<double>(double*, int64_t, int64_t, int64_t, int,
                                             const int64_t*, const double*, const double*, bool);

}  // namespace dm
