#include "spec/sampler.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "util/error.h"

namespace dflash {

std::string SamplingParams::check() const {
  if (!(temperature >= 0.0 && temperature <= 2.0)) return fmt::format("temperature must be in [0, 2], got {}", temperature);
  if (top_k < 0) return fmt::format("top_k must be >= 0 (0: off), got {}", top_k);
  if (!(top_p > 0.0 && top_p <= 1.0)) return fmt::format("top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0 && min_p < 1.0)) return fmt::format("min_p must be in [0, 1), got {}", min_p);
  return {};
}

Sampler::Sampler(const SamplingParams& params) : p_(params), rng_(params.seed) {
  const std::string err = p_.check();
  DFLASH_CHECK(err.empty(), "sampling: {}", err);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int32_t best = filter(logits);
  if (p_.greedy()) return best;
  return draw(-1);
}

double Sampler::uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

double Sampler::mass_of(int32_t token) const {
  double total = 0.0, mass = 0.0;
  for (const auto& c : cand_) {
    const double w = std::exp((static_cast<double>(c.first) - lmax_) * inv_t_);
    total += w;
    if (c.second == token) mass = w;
  }
  return mass / total;
}

double Sampler::probability(std::span<const float> logits, int32_t token) {
  const int32_t best = filter(logits);
  if (p_.greedy()) return token == best ? 1.0 : 0.0;
  return mass_of(token);
}

bool Sampler::accept_draft(std::span<const float> logits, int32_t draft, int32_t* replacement) {
  const int32_t best = filter(logits);
  if (p_.greedy()) {
    *replacement = best;
    return draft == best;
  }
  if (uniform() < mass_of(draft)) return true;
  *replacement = draw(draft);
  return false;
}

int32_t Sampler::sample_excluding(std::span<const float> logits, int32_t excluded) {
  const int32_t best = filter(logits);
  if (p_.greedy()) return best;
  return draw(excluded);
}

int32_t Sampler::filter(std::span<const float> logits) {
  DFLASH_CHECK(!logits.empty(), "sampling: empty logits");
  const int64_t n = static_cast<int64_t>(logits.size());
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;  // lowest index wins ties, like the backends' argmax
  if (p_.greedy()) return static_cast<int32_t>(best);

  // Candidates, most likely first. Only as many are sorted as the filters can keep: top_k, or for
  // top-p a prefix that grows until its mass reaches p (the mass of everything is known up front).
  const double inv_t = 1.0 / p_.temperature, lmax = logits[best];
  inv_t_ = inv_t;
  lmax_ = lmax;
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += std::exp((static_cast<double>(logits[i]) - lmax) * inv_t);
  cand_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) cand_[i] = {logits[i], static_cast<int32_t>(i)};
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  int64_t keep = p_.top_k > 0 ? std::min(p_.top_k, n) : n;
  if (keep < n) {
    std::nth_element(cand_.begin(), cand_.begin() + keep, cand_.end(), by_logit);
    cand_.resize(static_cast<size_t>(keep));
    total = 0.0;
    for (const auto& c : cand_) total += std::exp((static_cast<double>(c.first) - lmax) * inv_t);
  }
  int64_t sorted = 0;
  auto sort_prefix = [&](int64_t want) {
    want = std::min<int64_t>(want, static_cast<int64_t>(cand_.size()));
    if (want <= sorted) return;
    std::partial_sort(cand_.begin() + sorted, cand_.begin() + want, cand_.end(), by_logit);
    sorted = want;
  };
  if (p_.top_p < 1.0) {
    double mass = 0.0;
    int64_t i = 0;
    for (int64_t chunk = 64;; chunk *= 4) {
      sort_prefix(chunk);
      for (; i < sorted; ++i) {
        mass += std::exp((static_cast<double>(cand_[i].first) - lmax) * inv_t);
        if (mass >= p_.top_p * total) break;
      }
      if (i < sorted || sorted == static_cast<int64_t>(cand_.size())) break;
    }
    keep = std::min<int64_t>(i + 1, static_cast<int64_t>(cand_.size()));
    cand_.resize(static_cast<size_t>(keep));
  }
  if (p_.min_p > 0.0) {
    // p_i >= min_p * p_max  <=>  (l_i - lmax) / T >= log(min_p)
    const double cut = std::log(p_.min_p);
    cand_.erase(std::remove_if(cand_.begin(), cand_.end(),
                               [&](const auto& c) { return (static_cast<double>(c.first) - lmax) * inv_t < cut; }),
                cand_.end());
  }
  return static_cast<int32_t>(best);
}

// One draw over the filtered candidates (without `excluded`), in the order the filters left them
// (deterministic for given logits, so the seed fixes the result; no full sort of the vocabulary when
// no filter is on).
int32_t Sampler::draw(int32_t excluded) {
  double left = 0.0;
  for (const auto& c : cand_)
    if (c.second != excluded) left += std::exp((static_cast<double>(c.first) - lmax_) * inv_t_);
  if (!(left > 0.0)) return excluded;  // `excluded` held all the mass (it is never rejected then)
  const double u = std::uniform_real_distribution<double>(0.0, left)(rng_);
  double acc = 0.0;
  int32_t last = excluded;
  for (const auto& c : cand_) {
    if (c.second == excluded) continue;
    acc += std::exp((static_cast<double>(c.first) - lmax_) * inv_t_);
    last = c.second;
    if (u < acc) return c.second;
  }
  return last;  // u == left after rounding
}

}  // namespace dflash
