// Expert load balancing without an auxiliary loss: Quantile Balancing (QB, SPEC §1.6), DeepSeek's
// sign update as the comparison option, and the per-layer balance metrics.
//
// QB, per MoE layer, for a batch of N tokens, E experts, top-k, target load q = N·k/E. The forward
// selects with top-(k+1) on s + b and keeps each token's cutoff α_i = its (k+1)-th biased score
// (MoeSaved::routing.scores / .cutoff). After the step each bias is *set*:
//     b_j ← −quantile_{1−k/E}(s_{:,j} − α)  =  the (q+1)-th smallest r_{ij} = α_i − s_ij,
// i.e. −b_j is the (q+1)-th largest margin of expert j: exactly the q tokens with a larger margin
// would clear their cutoff, s_ij + b_j > α_i. Then the mean of b is subtracted (selection only
// depends on differences of b). No learning rate.
//   * Fractional q: linear interpolation between the order statistics at 0-based positions ⌊q⌋
//     and ⌈q⌉ of the ascending r (position q is the (q+1)-th smallest).
//   * Tokens whose cutoff is not finite (fewer than k+1 eligible experts) carry no information
//     about a threshold and are skipped; q uses the number of tokens that remain.
// Estimators behind the same update:
//   Exact:     nth_element per expert over all N values.
//   Histogram: per expert an integer histogram of r over [b_min − 1, b_max + 1] (b = the bias the
//              forward routed with; every r lies in that range since α_i = s_im + b_m for some m
//              and s ∈ [0,1]) with B ≈ 1000 bins; pick the bin where the cumulative count passes
//              position q; interpolate linearly inside it. Error ≤ one bin width. Histograms of
//              several ranks / micro-batches simply add, so the distributed case all-reduces only
//              the integer counts: build (qb_histogram_accumulate) and pick
//              (qb_raw_bias_from_histogram) are separate calls.
//   Option: an EMA of the estimated quantiles across steps (BalanceOptions::quantile_ema).
#pragma once
#include <cstdint>
#include <vector>

namespace dm {

enum class BalanceRule : uint8_t {
  Quantile,  // QB (default)
  Sign,      // DeepSeek-V3: b_j += γ·sign(mean load − load_j)
};
enum class QuantileEstimator : uint8_t { Exact, Histogram };

struct BalanceOptions {
  BalanceRule rule = BalanceRule::Quantile;
  QuantileEstimator estimator = QuantileEstimator::Exact;
  int histogram_bins = 1000;
  // 0 = off. Otherwise smoothed_j ← ema·smoothed_j + (1 − ema)·estimate_j before the bias is set
  // from it (the first update takes the estimate as is).
  double quantile_ema = 0.0;
  double sign_rate = 1e-3;  // γ of the sign update
  // Fixed-point refinements of the QB estimate on the same batch (0 = the one-shot rule): α is
  // re-derived as the (k+1)-th largest s_i + b under the candidate bias, then b re-estimated.
  // Assumes ungrouped routing (every expert eligible for every token).
  int refine_iterations = 0;
  // Steps pooled into one estimate (1 = this step's batch only). The scores of the last
  // window − 1 batches are kept (BalanceLayerState::past_scores) and the quantile is taken over
  // the union, their cutoffs re-derived under the bias being fitted: a batch's expert loads
  // follow the documents it holds, so one batch's quantile carries that batch's composition into
  // the next step's bias; pooling W batches divides that part by ~√W (older scores lag the
  // weights by up to W − 1 optimizer steps).
  int window = 1;
};

// Per MoE layer state carried between steps (the quantile EMA and the pooling window).
struct BalanceLayerState {
  std::vector<double> smoothed_raw_bias;  // [E]; empty until the first QB update
  std::vector<std::vector<float>> past_scores;  // window − 1 most recent batches, each [N_i, E], oldest first
};

// --- QB building blocks (scores [N,E], cutoff [N] from the forward's routing) -----------------

// raw_bias[j] = the (q+1)-th smallest α_i − s_ij (before mean subtraction). Returns the number of
// tokens used (finite cutoff); when it is 0, raw_bias is left untouched.
int64_t qb_raw_bias_exact(const float* scores, const float* cutoff, int64_t N, int E, int k,
                          double* raw_bias);

struct QbHistogramRange {
  double low = 0, high = 0;  // [b_min − 1, b_max + 1]
  int bins = 0;
  double bin_width() const { return (high - low) / bins; }
};
// The range for the bias the forward routed with (identical on every rank).
QbHistogramRange qb_histogram_range(const float* bias, int E, int bins);
// counts[E, bins] += histogram of r_ij = α_i − s_ij per expert j (tokens with a non-finite cutoff
// skipped; values outside the range, possible only through rounding, land in the edge bins).
void qb_histogram_accumulate(const float* scores, const float* cutoff, int64_t N, int E,
                             const QbHistogramRange& range, int64_t* counts);
// raw_bias[j] from the (summed) histogram of expert j. Every used token adds one count to every
// expert, so the token count is read off the counts. Returns it; 0 → raw_bias untouched.
int64_t qb_raw_bias_from_histogram(const int64_t* counts, int E, int k,
                                   const QbHistogramRange& range, double* raw_bias);

// bias[j] ← smoothed raw_bias[j] − mean_j(smoothed raw_bias): the EMA (if enabled) then the mean
// subtraction.
void qb_set_bias(const double* raw_bias, int E, const BalanceOptions& options,
                 BalanceLayerState* state, float* bias);

// cutoff[i] = the (k+1)-th largest scores[i,:] + bias (ungrouped routing; k < E).
void qb_cutoffs(const float* scores, const float* bias, int64_t N, int E, int k, float* cutoff);

// --- One-call updates (single process) --------------------------------------------------------

// QB with the configured estimator; `bias` must be the bias the forward routed with (the
// histogram range is derived from it). Leaves bias unchanged when no token has a finite cutoff.
void quantile_balance_update(const float* scores, const float* cutoff, int64_t N, int E, int k,
                             const BalanceOptions& options, BalanceLayerState* state, float* bias);
// DeepSeek's sign rule: b_j += γ·sign(mean load − load_j) (sign(0) = 0).
void sign_balance_update(const int64_t* loads, int E, double gamma, float* bias);

// --- Loads and metrics ------------------------------------------------------------------------

// loads[e] = number of (token, slot) pairs routed to e (overwrites loads[E]); idx [N,k].
void expert_loads(const int32_t* idx, int64_t N, int k, int E, int64_t* loads);

struct BalanceMetrics {
  double mean_load = 0;                 // c̄ = N·k/E
  double max_violation = 0;             // MaxVio = (max_j c_j − c̄)/c̄
  double coefficient_of_variation = 0;  // std_j(c_j)/c̄ (population std)
  int dead_experts = 0;                 // #{j : c_j = 0}
};
BalanceMetrics balance_metrics(const int64_t* loads, int E);

}  // namespace dm
