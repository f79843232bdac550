#include "infer/sampler.h"

#include <algorithm>
#include <cmath>

namespace dm {

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}

void Sampler::log_softmax(const float* z, int64_t V, float* out) {
  float mx = *std::max_element(z, z + V);
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(double(z[v] - mx));
  const float lse = mx + float(std::log(s));
  for (int64_t v = 0; v < V; ++v) out[v] = z[v] - lse;
}

int32_t Sampler::sample(float* z, int64_t V, std::span<const int32_t> context) {
  if (p_.repetition_penalty != 1.0f)
    for (int32_t t : context)
      if (t >= 0 && t < V) z[t] = z[t] > 0 ? z[t] / p_.repetition_penalty : z[t] * p_.repetition_penalty;
  if (p_.temperature <= 0.0f) return int32_t(std::max_element(z, z + V) - z);  // ties → lowest id

  cand_.clear();
  for (int64_t v = 0; v < V; ++v) cand_.emplace_back(z[v] / p_.temperature, int32_t(v));
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = cand_.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    keep = size_t(p_.top_k);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  cand_.resize(keep);
  // Probabilities over the kept candidates (sorted descending).
  const float mx = cand_[0].first;
  double total = 0;
  for (auto& c : cand_) total += (c.first = std::exp(c.first - mx));
  for (auto& c : cand_) c.first = float(c.first / total);
  if (p_.min_p > 0) {
    const float cut = p_.min_p * cand_[0].first;
    size_t n = 1;
    while (n < cand_.size() && cand_[n].first >= cut) ++n;
    cand_.resize(n);
  }
  if (p_.top_p < 1.0f) {
    double acc = 0;
    size_t n = 0;
    while (n < cand_.size()) {
      acc += cand_[n].first;
      ++n;
      if (acc >= p_.top_p) break;
    }
    cand_.resize(n);
  }
  double s = 0;
  for (const auto& c : cand_) s += c.first;
  std::uniform_real_distribution<double> u(0.0, s);
  double r = u(rng_);
  for (const auto& c : cand_) {
    r -= c.first;
    if (r <= 0) return c.second;
  }
  return cand_.back().second;
}

}  // namespace dm
