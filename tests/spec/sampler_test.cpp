// Sampling (spec/sampler.h): the filters' semantics against exact probabilities, determinism by
// seed, and the engine's sampled path (plain decoding; speculation is greedy-only).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
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

TEST(Sampler, ProbabilityAndDrawsWithoutOneToken) {
  const std::vector<float> l = log_probs({0.1, 0.5, 0.15, 0.25});
  SamplingParams p;
  p.temperature = 1.0;
  p.top_k = 3;  // keeps 1, 3, 2 (mass 0.9)
  p.seed = 5;
  Sampler s(p);
  EXPECT_NEAR(s.probability(l, 1), 0.5 / 0.9, 1e-6);
  EXPECT_NEAR(s.probability(l, 2), 0.15 / 0.9, 1e-6);
  EXPECT_EQ(s.probability(l, 0), 0.0);  // filtered out
  std::vector<double> f(4, 0.0);
  constexpr int kN = 40000;
  for (int i = 0; i < kN; ++i) f[static_cast<size_t>(s.sample_excluding(l, 1))] += 1.0 / kN;
  EXPECT_EQ(f[1] + f[0], 0.0);
  EXPECT_NEAR(f[3], 0.25 / 0.4, 0.012);  // {3, 2} renormalised
  // The only candidate excluded: it comes back (speculative sampling never rejects a token of p = 1).
  SamplingParams one = p;
  one.top_k = 1;
  Sampler s1(one);
  EXPECT_EQ(s1.sample_excluding(l, 1), 1);
  EXPECT_NEAR(s1.probability(l, 1), 1.0, 1e-12);
}

struct SamplingPair {
  std::string target, drafter;
  static const SamplingPair& get() {
    static const SamplingPair f = [] {
      SamplingPair f;
      const SynthTargetSpec ts = tiny_target();
      f.target = temp_path("sampling_target.gguf");
      f.drafter = temp_path("sampling_drafter.gguf");
      synth_target(ts, f.target);
      synth_drafter(tiny_drafter(ts), f.drafter);
      return f;
    }();
    return f;
  }
};

TEST(Engine, SpeculativeSamplingIsReproducibleBySeed) {
  const SamplingPair& f = SamplingPair::get();
  Pair p = load_pair(f.target, f.drafter, 8);
  const std::vector<int32_t> prompt = random_tokens(12, 99, 96);
  GenerateOptions o;
  o.max_tokens = 40;
  o.sampling.temperature = 1.0;
  o.sampling.seed = 1234;
  Engine spec(*p.target, p.drafter.get());
  GenerateStats st;
  const auto a = run(spec, prompt, o, &st);
  EXPECT_GT(st.cycles, 0);  // sampled, and still draft / verify cycles
  EXPECT_EQ(static_cast<int64_t>(a.size()), o.max_tokens);
  EXPECT_EQ(run(spec, prompt, o), a);  // same seed: same tokens
  o.sampling.seed = 4321;
  EXPECT_NE(run(spec, prompt, o), a);  // another seed: another continuation
  // temperature 0 is still greedy: speculative == plain token for token
  GenerateOptions g;
  g.max_tokens = 20;
  Engine plain(*p.target);
  EXPECT_EQ(run(plain, prompt, g), run(spec, prompt, g));
}

// A drafter that proposes the target's greedy continuation of (prompt, anchor), computed on its own
// copy of the target: drafts that the sampled target accepts often, but not always.
class GreedyOracleDrafter final : public Drafter {
 public:
  GreedyOracleDrafter(const gguf::File& file, std::vector<int32_t> prompt, int64_t block)
      : prompt_(std::move(prompt)), block_(block) {
    be_ = make_cpu_backend(1);
    TargetOptions to;
    to.n_ctx = 256;
    oracle_ = TargetModel::load(file, *be_, to);
  }
  int64_t block_size() const override { return block_; }
  int64_t context_end() const override { return end_; }
  void reset_context() override { end_ = 0; }
  void append_context(std::span<const float>, int64_t rows) override { end_ += rows; }
  std::vector<int32_t> draft(int32_t anchor) override {
    // only the first cycle after the prompt is scripted; later ones propose token 0
    std::vector<int32_t> d(static_cast<size_t>(block_ - 1), 0);
    if (end_ != static_cast<int64_t>(prompt_.size())) return d;
    auto it = cache_.find(anchor);
    if (it == cache_.end()) {
      std::vector<int32_t> ctx = prompt_;
      ctx.push_back(anchor);
      Engine e(*oracle_);
      GenerateOptions g;
      g.max_tokens = block_;
      std::vector<int32_t> cont = run(e, ctx, g);  // cont[0] follows the anchor
      it = cache_.emplace(anchor, std::move(cont)).first;
    }
    for (size_t i = 0; i < d.size() && i < it->second.size(); ++i) d[i] = it->second[i];
    return d;
  }

 private:
  std::vector<int32_t> prompt_;
  int64_t block_, end_ = 0;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<TargetModel> oracle_;
  std::map<int32_t, std::vector<int32_t>> cache_;
};

// Speculative sampling must keep the distribution of plain sampling. Over many seeds, the tokens at
// positions 1 and 2 after the prompt (decided by the first verify) have the same distribution either
// way; a loop that accepted drafts more often than p(d) would move it towards the drafter's tokens.
TEST(Engine, SpeculativeSamplingKeepsTheDistribution) {
  const SamplingPair& f = SamplingPair::get();
  Pair p = load_pair(f.target, f.drafter, 8);
  const std::vector<int32_t> prompt = random_tokens(10, 7, 96);
  GreedyOracleDrafter oracle(*p.target_file, prompt, 4);
  Engine plain(*p.target);
  Engine spec(*p.target, &oracle);
  constexpr int kRuns = 3000;
  GenerateOptions o;
  o.max_tokens = 3;  // the anchor (from the prefill's logits) and two tokens of the first cycle
  o.sampling.temperature = 0.8;
  o.sampling.top_k = 3;
  o.block = 4;
  std::vector<std::vector<double>> fp(3, std::vector<double>(96, 0.0)), fs = fp;
  int64_t cycles = 0, accepted = 0;
  for (int i = 0; i < kRuns; ++i) {
    o.sampling.seed = 1000 + static_cast<uint64_t>(i);
    const auto a = run(plain, prompt, o);
    o.sampling.seed = 900000 + static_cast<uint64_t>(i);
    GenerateStats st;
    const auto b = run(spec, prompt, o, &st);
    for (size_t pos = 1; pos <= 2; ++pos) {
      fp[pos][static_cast<size_t>(a[pos])] += 1.0 / kRuns;
      fs[pos][static_cast<size_t>(b[pos])] += 1.0 / kRuns;
    }
    cycles += st.cycles;
    accepted += st.accepted;
  }
  for (size_t pos = 1; pos <= 2; ++pos) {
    double tv = 0.0;
    for (size_t t = 0; t < 96; ++t) tv += 0.5 * std::fabs(fp[pos][t] - fs[pos][t]);
    EXPECT_LT(tv, 0.05) << "position " << pos;  // sampling noise: ~0.02 at 3000 runs over a few tokens
  }
  EXPECT_GT(cycles, 0);
  EXPECT_GT(accepted, kRuns / 20) << "the test needs accepted drafts to mean anything";
}

}  // namespace
}  // namespace dflash::spec_test
