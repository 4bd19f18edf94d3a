// Sampling for temperature > 0, plain or speculative (the accept rule below keeps the output
// distributed as plain sampling's).
//
// Order of the filters, as llama.cpp and vLLM apply them: top-k on the logits, then the tempered
// softmax, then top-p (the smallest set of the most likely tokens whose mass reaches p), then min-p
// (tokens with probability >= min_p x the largest), then one draw from what is left, renormalised.
// A Sampler owns its random generator (std::mt19937_64 seeded by SamplingParams::seed), so the same
// seed, prompt and logits give the same tokens.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dflash {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax; the other fields are ignored)
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // (0, 1]; 1: off
  double min_p = 0.0;        // [0, 1); 0: off
  uint64_t seed = 0;
  bool greedy() const { return temperature <= 0.0; }
  // Empty when valid, else what is wrong ("temperature must be in [0, 2], got 3").
  std::string check() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // One token drawn from `logits` (one row over the vocabulary). Greedy params: the argmax.
  int32_t sample(std::span<const float> logits);

  // Speculative sampling with a deterministic draft (SPEC 5, Leviathan et al.): a drafted token d is
  // accepted with probability p(d) under the filtered, tempered target distribution, and a rejected
  // position draws from p without d, renormalised. The output is distributed as plain sampling's.
  double probability(std::span<const float> logits, int32_t token);    // p(token), 0 if filtered out
  int32_t sample_excluding(std::span<const float> logits, int32_t excluded);
  double uniform();  // U[0, 1) from the same generator
  // Both steps on one row, filtering it once: true when `draft` is accepted (u < p(draft)); else
  // *replacement = a draw from p without `draft`. Same draws as uniform() < probability() followed
  // by sample_excluding().
  bool accept_draft(std::span<const float> logits, int32_t draft, int32_t* replacement);

 private:
  int32_t filter(std::span<const float> logits);  // fills cand_ (sampling); returns the argmax
  int32_t draw(int32_t excluded);                  // one draw over cand_ without `excluded` (-1: none)
  double mass_of(int32_t token) const;             // p(token) over cand_ (after filter())

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;  // (logit, id) kept by the filters, reused between calls
  double inv_t_ = 1.0, lmax_ = 0.0;              // of the last filter()
};

}  // namespace dflash
