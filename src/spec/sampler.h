// Sampling for temperature > 0 (plain decoding; speculation is greedy-only, SPEC 5).
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

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;  // (logit, id), reused between calls
};

}  // namespace dflash
