// Sampling (spec/sampler.h): the filters' semantics against exact probabilities, determinism by
// seed, and the engine's sampled path (plain decoding; speculation is greedy-only).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "spec/sampler.h"
#include "spec_fixture.h"
#include "util/error.h"

namespace dflash::spec_test {
namespace {

// Frequency of each id over n draws.
std::vector<double> frequencies(const SamplingParams& p, const std::vector<float>& logits, int n) {
  Sampler s(p);
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) f[static_cast<size_t>(s.sample(logits))] += 1.0 / n;
  return f;
}

std::vector<float> log_probs(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

TEST(Sampler, GreedyIsTheArgmaxWithTheLowestIndexOnTies) {
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.sample(std::vector<float>{0.1f, 3.0f, -1.0f, 3.0f}), 1);
  SamplingParams k1;
  k1.temperature = 1.0;
  k1.top_k = 1;  // top-1 sampling is greedy too
  Sampler s1(k1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s1.sample(std::vector<float>{0.1f, 3.0f, -1.0f, 2.9f}), 1);
}

TEST(Sampler, DrawsFollowTheTemperedSoftmax) {
  constexpr int kN = 40000;  // standard error of a frequency <= 0.0025
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 7;
  const std::vector<float> l = log_probs({0.25, 0.75});
  EXPECT_NEAR(frequencies(p, l, kN)[1], 0.75, 0.012);
  p.temperature = 0.5;  // probabilities squared, renormalised: 1/16 : 9/16 -> 0.9
  EXPECT_NEAR(frequencies(p, l, kN)[1], 0.9, 0.01);
  p.temperature = 2.0;  // square roots: 0.5 : 0.866 -> 0.634
  EXPECT_NEAR(frequencies(p, l, kN)[1], std::sqrt(0.75) / (std::sqrt(0.75) + 0.5), 0.012);
}

TEST(Sampler, TopKTopPAndMinPKeepTheRightTokens) {
  constexpr int kN = 40000;
  const std::vector<float> l = log_probs({0.1, 0.5, 0.15, 0.25});  // order by mass: 1, 3, 2, 0
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 11;
  p.top_k = 2;  // {1, 3}: 0.5 / 0.75
  std::vector<double> f = frequencies(p, l, kN);
  EXPECT_EQ(f[0] + f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.75, 0.012);
  p.top_k = 0;
  p.top_p = 0.7;  // smallest prefix reaching 0.7: {1, 3} (0.75)
  f = frequencies(p, l, kN);
  EXPECT_EQ(f[0] + f[2], 0.0);
  EXPECT_NEAR(f[3], 0.25 / 0.75, 0.012);
  p.top_p = 0.8;  // {1, 3, 2} (0.9)
  f = frequencies(p, l, kN);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_NEAR(f[2], 0.15 / 0.9, 0.012);
  p.top_p = 1.0;
  p.min_p = 0.35;  // keep p >= 0.175: {1, 3}
  f = frequencies(p, l, kN);
  EXPECT_EQ(f[0] + f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.75, 0.012);
}

TEST(Sampler, TheSeedFixesTheDraws) {
  std::vector<float> l(200);
  for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(std::sin(0.37 * i));
  SamplingParams p;
  p.temperature = 0.8;
  p.top_p = 0.95;
  auto draws = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> d;
    for (int i = 0; i < 64; ++i) d.push_back(s.sample(l));
    return d;
  };
  EXPECT_EQ(draws(5), draws(5));
  EXPECT_NE(draws(5), draws(6));
}

TEST(Sampler, RejectsBadParameters) {
  auto bad = [](auto set) {
    SamplingParams p;
    p.temperature = 1.0;
    set(p);
    EXPECT_FALSE(p.check().empty());
    EXPECT_THROW(Sampler{p}, Error);
  };
  bad([](SamplingParams& p) { p.temperature = 2.5; });
  bad([](SamplingParams& p) { p.temperature = -1; });
  bad([](SamplingParams& p) { p.top_k = -1; });
  bad([](SamplingParams& p) { p.top_p = 0; });
  bad([](SamplingParams& p) { p.min_p = 1; });
  SamplingParams ok;
  EXPECT_TRUE(ok.check().empty());
}

TEST(Engine, SamplingIsReproducibleAndSkipsSpeculation) {
  const SynthTargetSpec ts = tiny_target();
  const std::string tp = temp_path("sampling_target.gguf"), dp = temp_path("sampling_drafter.gguf");
  synth_target(ts, tp);
  synth_drafter(tiny_drafter(ts), dp);
  Pair p = load_pair(tp, dp, 8);
  const std::vector<int32_t> prompt = random_tokens(12, 99, ts.n_vocab);
  GenerateOptions o;
  o.max_tokens = 40;
  o.sampling.temperature = 1.0;
  o.sampling.seed = 1234;
  Engine spec(*p.target, p.drafter.get());
  GenerateStats st;
  const auto a = run(spec, prompt, o, &st);
  EXPECT_EQ(st.cycles, 0);  // sampled: no draft / verify cycles
  EXPECT_EQ(static_cast<int64_t>(a.size()), o.max_tokens);
  Engine plain(*p.target);
  EXPECT_EQ(run(plain, prompt, o), a);  // same seed: same tokens, drafter or not
  o.sampling.seed = 4321;
  const auto b = run(plain, prompt, o);
  EXPECT_NE(b, a);  // another seed: another continuation (40 draws from a random model)
  // temperature 0 is still the greedy, speculative path
  GenerateOptions g;
  g.max_tokens = 20;
  GenerateStats gs;
  const auto greedy_spec = run(spec, prompt, g, &gs);
  EXPECT_GT(gs.cycles, 0);
  EXPECT_EQ(run(plain, prompt, g), greedy_spec);
}

}  // namespace
}  // namespace dflash::spec_test
