// Quantile Balancing of expert load (SPEC §1.6), the sign-update option and balance metrics.
// See balance.h for the rule and the estimators.
#include "train/balance.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace dm {
namespace {

void check_balance_shape(int64_t N, int E, int k) {
  DM_CHECK(N >= 0 && E > 0 && k >= 1 && k <= E, "quantile balancing: bad shape N=", N, " E=", E,
           " k=", k);
}

// 0-based position of the (q+1)-th smallest value among n, q = n·k/E, clamped to the data.
double qb_target_position(int64_t n, int E, int k) {
  const double q = double(n) * double(k) / double(E);
  return std::clamp(q, 0.0, double(n - 1));
}

// The value at 0-based position `position` of the ascending order of `values` (n = size),
// interpolating linearly between neighbouring order statistics. Reorders values.
double order_statistic_interpolated(std::vector<double>& values, double position) {
  const int64_t n = int64_t(values.size());
  const int64_t lower = int64_t(std::floor(position));
  const double fraction = position - double(lower);
  std::nth_element(values.begin(), values.begin() + lower, values.end());
  const double lower_value = values[lower];
  if (fraction == 0.0 || lower + 1 >= n) return lower_value;
  // After nth_element everything right of `lower` is ≥ it; the next order statistic is their min.
  const double upper_value = *std::min_element(values.begin() + lower + 1, values.end());
  return lower_value + fraction * (upper_value - lower_value);
}

// Estimate of the value at integer 0-based position p from one expert's histogram: the values of
// bin β (the first whose inclusive cumulative count exceeds p) are assumed spread evenly over it,
// the i-th of its c values at the centre of the i-th of c equal sub-intervals. The true value lies
// in the same bin, so the error is below one bin width.
double histogram_position_value(const int64_t* counts, const QbHistogramRange& range, int64_t p) {
  int64_t cumulative_before = 0;
  for (int bin = 0; bin < range.bins; ++bin) {
    const int64_t c = counts[bin];
    if (cumulative_before + c > p) {
      const double within = (double(p - cumulative_before) + 0.5) / double(c);
      return range.low + range.bin_width() * (double(bin) + within);
    }
    cumulative_before += c;
  }
  return range.high;  // unreachable when p < total count
}

}  // namespace

int64_t qb_raw_bias_exact(const float* scores, const float* cutoff, int64_t N, int E, int k,
                          double* raw_bias) {
  check_balance_shape(N, E, k);
  std::vector<int64_t> used_tokens;
  used_tokens.reserve(size_t(N));
  for (int64_t i = 0; i < N; ++i)
    if (std::isfinite(cutoff[i])) used_tokens.push_back(i);
  const int64_t n = int64_t(used_tokens.size());
  if (n == 0) return 0;
  const double position = qb_target_position(n, E, k);
#pragma omp parallel if (n * E >= (1 << 16))
  {
    std::vector<double> column(size_t(n), 0.0);  // r_{:,j}, one buffer per thread
#pragma omp for schedule(static)
    for (int j = 0; j < E; ++j) {
      for (int64_t u = 0; u < n; ++u) {
        const int64_t i = used_tokens[size_t(u)];
        column[size_t(u)] = double(cutoff[i]) - double(scores[i * E + j]);
      }
      raw_bias[j] = order_statistic_interpolated(column, position);
    }
  }
  return n;
}

QbHistogramRange qb_histogram_range(const float* bias, int E, int bins) {
  DM_CHECK(E > 0 && bins >= 1, "qb_histogram_range: bad E=", E, " bins=", bins);
  double bias_min = 0, bias_max = 0;
  if (bias) {
    bias_min = *std::min_element(bias, bias + E);
    bias_max = *std::max_element(bias, bias + E);
  }
  return QbHistogramRange{bias_min - 1.0, bias_max + 1.0, bins};
}

void qb_histogram_accumulate(const float* scores, const float* cutoff, int64_t N, int E,
                             const QbHistogramRange& range, int64_t* counts) {
  DM_CHECK(N >= 0 && E > 0 && range.bins >= 1 && range.high > range.low,
           "qb_histogram_accumulate: bad shape or range");
  const double inverse_width = 1.0 / range.bin_width();
  // Expert-parallel: each expert's histogram row has one writer.
#pragma omp parallel for schedule(static) if (N * E >= (1 << 16))
  for (int j = 0; j < E; ++j) {
    int64_t* row = counts + int64_t(j) * range.bins;
    for (int64_t i = 0; i < N; ++i) {
      if (!std::isfinite(cutoff[i])) continue;
      const double r = double(cutoff[i]) - double(scores[i * E + j]);
      const int64_t bin = int64_t(std::floor((r - range.low) * inverse_width));
      ++row[std::clamp<int64_t>(bin, 0, range.bins - 1)];
    }
  }
}

int64_t qb_raw_bias_from_histogram(const int64_t* counts, int E, int k,
                                   const QbHistogramRange& range, double* raw_bias) {
  DM_CHECK(E > 0 && k >= 1 && k <= E && range.bins >= 1, "qb_raw_bias_from_histogram: bad shape");
  const int64_t n = std::accumulate(counts, counts + range.bins, int64_t(0));
  if (n == 0) return 0;
  const double position = qb_target_position(n, E, k);
  const int64_t lower = int64_t(std::floor(position));
  const double fraction = position - double(lower);
  for (int j = 0; j < E; ++j) {
    const int64_t* row = counts + int64_t(j) * range.bins;
    const double lower_value = histogram_position_value(row, range, lower);
    double value = lower_value;
    if (fraction > 0.0 && lower + 1 < n)
      value += fraction * (histogram_position_value(row, range, lower + 1) - lower_value);
    raw_bias[j] = value;
  }
  return n;
}

void qb_set_bias(const double* raw_bias, int E, const BalanceOptions& options,
                 BalanceLayerState* state, float* bias) {
  std::vector<double> smoothed(raw_bias, raw_bias + E);
  if (options.quantile_ema > 0.0 && state) {
    DM_CHECK(options.quantile_ema < 1.0, "quantile balancing: EMA factor must be in [0, 1), got ",
             options.quantile_ema);
    if (state->smoothed_raw_bias.size() == size_t(E)) {
      for (int j = 0; j < E; ++j)
        smoothed[j] = options.quantile_ema * state->smoothed_raw_bias[j] +
                      (1.0 - options.quantile_ema) * raw_bias[j];
    }
    state->smoothed_raw_bias = smoothed;
  }
  // Selection depends only on differences of b: centring keeps the bias from drifting.
  const double mean = std::accumulate(smoothed.begin(), smoothed.end(), 0.0) / E;
  for (int j = 0; j < E; ++j) bias[j] = float(smoothed[j] - mean);
}

void qb_cutoffs(const float* scores, const float* bias, int64_t N, int E, int k, float* cutoff) {
  check_balance_shape(N, E, k);
  DM_CHECK(k < E, "qb_cutoffs: top-(k+1) needs k < E");
  // The (k+1)-th largest biased score of each row, by insertion into a descending list of the
  // k+1 largest seen so far: for the usual k ≪ E a value smaller than the list's last is one
  // compare (nth_element over a copy of the row cost ~290 ns a row at E = 32, k = 6; QB's
  // refinement calls this N·8 times a step). The value is unique even with ties, so it equals
  // nth_element's.
#pragma omp parallel if (N * E >= (1 << 16))
  {
    std::vector<float> top(static_cast<size_t>(k) + 1);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* row = scores + i * E;
      int count = 0;
      for (int j = 0; j < E; ++j) {
        const float v = row[j] + bias[j];
        if (count == k + 1 && !(v > top[size_t(k)])) continue;
        int at = count < k + 1 ? count++ : k;  // the slot v enters from (the last is dropped)
        while (at > 0 && top[size_t(at - 1)] < v) {
          top[size_t(at)] = top[size_t(at - 1)];
          --at;
        }
        top[size_t(at)] = v;
      }
      cutoff[i] = top[size_t(k)];
    }
  }
}

namespace {
// raw bias of one estimate (Exact or Histogram) from scores and cutoffs; returns tokens used.
int64_t qb_estimate(const float* scores, const float* cutoff, int64_t N, int E, int k,
                    const BalanceOptions& options, const float* routed_bias, double* raw_bias) {
  if (options.estimator == QuantileEstimator::Exact)
    return qb_raw_bias_exact(scores, cutoff, N, E, k, raw_bias);
  const QbHistogramRange range = qb_histogram_range(routed_bias, E, options.histogram_bins);
  std::vector<int64_t> counts(size_t(E) * size_t(range.bins), 0);
  qb_histogram_accumulate(scores, cutoff, N, E, range, counts.data());
  return qb_raw_bias_from_histogram(counts.data(), E, k, range, raw_bias);
}
}  // namespace

void quantile_balance_update(const float* scores, const float* cutoff, int64_t N, int E, int k,
                             const BalanceOptions& options, BalanceLayerState* state, float* bias) {
  check_balance_shape(N, E, k);
  DM_CHECK(options.window >= 1, "quantile balancing: window must be >= 1, got ", options.window);
  if (options.window > 1 && state && k < E) {
    // Pool the kept batches with this one: their cutoffs under the bias this batch was routed
    // with (this batch's own cutoffs are exactly those), then the same estimate + refinement.
    int64_t pooled_rows = N;
    for (const auto& p : state->past_scores) pooled_rows += int64_t(p.size()) / E;
    std::vector<float> pooled;
    pooled.reserve(size_t(pooled_rows * E));
    for (const auto& p : state->past_scores) pooled.insert(pooled.end(), p.begin(), p.end());
    pooled.insert(pooled.end(), scores, scores + N * E);
    std::vector<float> alpha(static_cast<size_t>(pooled_rows));
    qb_cutoffs(pooled.data(), bias, pooled_rows - N, E, k, alpha.data());
    std::copy(cutoff, cutoff + N, alpha.begin() + (pooled_rows - N));
    state->past_scores.emplace_back(scores, scores + N * E);
    while (int(state->past_scores.size()) > options.window - 1)
      state->past_scores.erase(state->past_scores.begin());
    BalanceOptions single = options;
    single.window = 1;
    quantile_balance_update(pooled.data(), alpha.data(), pooled_rows, E, k, single, state, bias);
    return;
  }
  std::vector<double> raw_bias(size_t(E), 0.0);
  const int64_t used = qb_estimate(scores, cutoff, N, E, k, options, bias, raw_bias.data());
  if (used == 0) return;
  // Fixed-point refinement: the cutoffs α came from the bias the forward routed with; under the
  // new bias they move, so one update balances the batch only approximately. Re-deriving α from
  // the candidate bias and re-estimating converges to the self-consistent bias.
  if (options.refine_iterations > 0 && k < E) {
    std::vector<float> candidate(static_cast<size_t>(E)), alpha(static_cast<size_t>(N));
    std::vector<double> next(static_cast<size_t>(E));
    for (int it = 0; it < options.refine_iterations; ++it) {
      const double mean = std::accumulate(raw_bias.begin(), raw_bias.end(), 0.0) / E;
      for (int j = 0; j < E; ++j) candidate[size_t(j)] = float(raw_bias[size_t(j)] - mean);
      qb_cutoffs(scores, candidate.data(), N, E, k, alpha.data());
      if (qb_estimate(scores, alpha.data(), N, E, k, options, candidate.data(), next.data()) == 0)
        break;
      raw_bias = next;
    }
  }
  qb_set_bias(raw_bias.data(), E, options, state, bias);
}

void sign_balance_update(const int64_t* loads, int E, double gamma, float* bias) {
  DM_CHECK(E > 0, "sign_balance_update: bad E=", E);
  const double mean = double(std::accumulate(loads, loads + E, int64_t(0))) / E;
  for (int j = 0; j < E; ++j) {
    const double gap = mean - double(loads[j]);
    const double sign = gap > 0 ? 1.0 : (gap < 0 ? -1.0 : 0.0);
    bias[j] = float(double(bias[j]) + gamma * sign);
  }
}

void expert_loads(const int32_t* idx, int64_t N, int k, int E, int64_t* loads) {
  std::fill(loads, loads + E, int64_t(0));
  for (int64_t r = 0; r < N * k; ++r) {
    DM_CHECK(idx[r] >= 0 && idx[r] < E, "expert_loads: expert id ", idx[r], " outside [0, ", E,
             ")");
    ++loads[idx[r]];
  }
}

BalanceMetrics balance_metrics(const int64_t* loads, int E) {
  DM_CHECK(E > 0, "balance_metrics: bad E=", E);
  BalanceMetrics m;
  const int64_t total = std::accumulate(loads, loads + E, int64_t(0));
  m.mean_load = double(total) / E;
  int64_t max_load = 0;
  double squared_deviation = 0;
  for (int j = 0; j < E; ++j) {
    max_load = std::max(max_load, loads[j]);
    squared_deviation += (double(loads[j]) - m.mean_load) * (double(loads[j]) - m.mean_load);
    if (loads[j] == 0) ++m.dead_experts;
  }
  if (m.mean_load > 0) {
    m.max_violation = (double(max_load) - m.mean_load) / m.mean_load;
    m.coefficient_of_variation = std::sqrt(squared_deviation / E) / m.mean_load;
  }
  return m;
}

}  // namespace dm
