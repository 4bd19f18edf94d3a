// Speculative generation == plain greedy generation, bit for bit (SPEC 5.5), on tiny synthetic
// target + drafter pairs: hundreds of prompts x verify widths 2..8 x prefill chunk sizes, stop tokens
// and max_tokens cuts inside blocks, a full context, garbage and scripted drafters (which accept
// often, so every acceptance path runs), and multi-turn cache reuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>

#include "spec/spec_fixture.h"
#include "util/error.h"

namespace dflash {
namespace {

using namespace spec_test;

// The files every test of this process shares.
struct Files {
  std::string target, target_q8, drafter, drafter_q8, drafter_v1;
  static const Files& get() {
    static const Files f = [] {
      Files f;
      const SynthTargetSpec ts = tiny_target();
      SynthTargetSpec tq = tiny_target(GgmlType::Q8_0, 5);
      f.target = temp_path("target.gguf");
      f.target_q8 = temp_path("target_q8.gguf");
      f.drafter = temp_path("drafter.gguf");
      f.drafter_q8 = temp_path("drafter_q8.gguf");
      f.drafter_v1 = temp_path("drafter_v1.gguf");
      synth_target(ts, f.target);
      synth_target(tq, f.target_q8);
      synth_drafter(tiny_drafter(ts), f.drafter);
      synth_drafter(tiny_drafter(tq, true, 12), f.drafter_q8);  // Q8_0 weights and codebooks
      synth_drafter(tiny_drafter(ts, false, 13), f.drafter_v1);
      return f;
    }();
    return f;
  }
};

constexpr int32_t kVocab = 96;

// A drafter that knows the plain greedy continuation and proposes it, each token corrupted with
// probability `noise` (1.0: pure garbage). It checks what the engine hands it: every anchor must be
// the reference token at its position, taps must come in rows of the right width.
class ScriptedDrafter final : public Drafter {
 public:
  ScriptedDrafter(int64_t block, int64_t tap_width) : block_(block), width_(tap_width) {}
  void script(std::vector<int32_t> sequence, double noise, uint64_t seed) {
    seq_ = std::move(sequence);
    noise_ = noise;
    rng_.seed(seed);
  }
  int64_t block_size() const override { return block_; }
  int64_t context_end() const override { return end_; }
  void reset_context() override { end_ = 0; }
  void append_context(std::span<const float> taps, int64_t rows) override {
    if (static_cast<int64_t>(taps.size()) != rows * width_) ++errors;
    for (float x : taps)
      if (!std::isfinite(x)) ++errors;
    end_ += rows;
  }
  std::vector<int32_t> draft(int32_t anchor) override {
    if (end_ >= static_cast<int64_t>(seq_.size()) || seq_[end_] != anchor) ++errors;
    std::vector<int32_t> d(block_ - 1);
    for (int64_t i = 0; i < block_ - 1; ++i) {
      const size_t at = static_cast<size_t>(end_ + 1 + i);
      const bool corrupt = std::uniform_real_distribution<double>(0, 1)(rng_) < noise_;
      d[i] = (at < seq_.size() && !corrupt) ? seq_[at] : static_cast<int32_t>(rng_() % kVocab);
    }
    return d;
  }
  int errors = 0;

 private:
  int64_t block_, width_, end_ = 0;
  std::vector<int32_t> seq_;
  double noise_ = 0;
  std::mt19937_64 rng_;
};

void expect_stats_consistent(const GenerateStats& st, const std::vector<int32_t>& out, int64_t B) {
  EXPECT_EQ(st.generated, static_cast<int64_t>(out.size()));
  EXPECT_EQ(static_cast<int64_t>(st.accepted_per_cycle.size()), st.cycles);
  int64_t acc = 0;
  for (int32_t k : st.accepted_per_cycle) {
    EXPECT_LE(k, B - 1);
    acc += k;
  }
  EXPECT_EQ(acc, st.accepted);
  EXPECT_LE(st.accepted, st.drafted);
  ASSERT_EQ(static_cast<int64_t>(st.accepted_at.size()), B - 1);
  for (int64_t i = 0; i + 1 < B - 1; ++i) EXPECT_GE(st.accepted_at[i], st.accepted_at[i + 1]);
  if (!st.accepted_at.empty()) {
    EXPECT_LE(st.accepted_at[0], st.cycles);
  }
}

// One prompt's case: the plain reference with and without a stop token, then speculative runs.
struct Case {
  std::vector<int32_t> prompt;
  GenerateOptions opts;
  std::vector<int32_t> expected;
  bool stopped = false;
};

Case make_case(Engine& plain, std::mt19937_64& rng, int64_t max_prompt, int64_t max_new) {
  Case c;
  c.prompt = random_tokens(1 + rng() % max_prompt, rng(), kVocab);
  c.opts.speculative = false;
  c.opts.max_tokens = 1 + static_cast<int64_t>(rng() % max_new);
  const std::vector<int32_t> free_run = run(plain, c.prompt, c.opts);
  if (rng() % 2 && free_run.size() > 1) {
    // a stop token somewhere in the run: generation must end right after its first occurrence
    c.opts.stop_tokens = {free_run[rng() % free_run.size()], static_cast<int32_t>(kVocab + 7)};
    GenerateStats st;
    c.expected = run(plain, c.prompt, c.opts, &st);
    const auto first = std::find(free_run.begin(), free_run.end(), c.opts.stop_tokens[0]);
    EXPECT_EQ(c.expected, std::vector<int32_t>(free_run.begin(), first + 1));
    EXPECT_TRUE(st.stopped_by_token);
    c.stopped = true;
  } else {
    c.expected = free_run;
  }
  c.opts.speculative = true;
  return c;
}

// ---------------------------------------------------------------------------------------------

struct PairCase {
  bool quantized;
  bool v1;
  int64_t max_rows;  // prefill chunk
};

// 200 prompts (spread over pairs with different prefill chunks and weight types) x B = 2..8.
TEST(Speculative, RealDrafterMatchesPlainGreedy) {
  const Files& f = Files::get();
  const std::vector<PairCase> pcs = {{false, false, 8}, {false, false, 5}, {true, false, 13},
                                     {false, true, 16}, {false, false, 40}, {true, false, 11}};
  std::vector<Pair> pairs;
  for (const PairCase& pc : pcs)
    pairs.push_back(load_pair(pc.quantized ? f.target_q8 : f.target,
                              pc.v1 ? f.drafter_v1 : (pc.quantized ? f.drafter_q8 : f.drafter), pc.max_rows));
  std::mt19937_64 rng(2024);
  int64_t cycles = 0, drafted = 0, accepted = 0, tokens = 0, stops = 0;
  for (int i = 0; i < 200; ++i) {
    Pair& p = pairs[i % pairs.size()];
    Engine plain(*p.target);
    const Case c = make_case(plain, rng, 44, 24);
    stops += c.stopped;
    Engine spec(*p.target, p.drafter.get());
    for (int64_t B = 2; B <= 8; ++B) {
      GenerateOptions o = c.opts;
      o.block = B;
      GenerateStats st;
      const auto out = run(spec, c.prompt, o, &st);
      ASSERT_EQ(out, c.expected) << "prompt " << i << " (" << c.prompt.size() << " tokens, max_rows "
                                 << pcs[i % pcs.size()].max_rows << ") block " << B;
      EXPECT_EQ(st.stopped_by_token, c.stopped);
      expect_stats_consistent(st, out, B);
      cycles += st.cycles;
      drafted += st.drafted;
      accepted += st.accepted;
      tokens += st.generated - 1;
    }
  }
  EXPECT_GT(stops, 40);
  std::cout << "random drafters: " << cycles << " cycles, acceptance " << accepted << "/" << drafted
            << ", tokens per cycle " << static_cast<double>(tokens) / cycles << "\n";
}

// A scripted drafter that is mostly right exercises every acceptance length, stop tokens among the
// accepted drafts, the bonus as stop token, and max_tokens cuts inside a block.
TEST(Speculative, ScriptedDrafterMatchesPlainGreedy) {
  const Files& f = Files::get();
  std::vector<Pair> pairs;
  for (int64_t rows : {8, 6, 16}) pairs.push_back(load_pair(f.target, f.drafter, rows));
  const int64_t tap_width = 3 * 64;
  std::mt19937_64 rng(77);
  const double noises[] = {0.0, 0.05, 0.2, 0.5, 1.0};
  int64_t drafted = 0, accepted = 0, full_cycles = 0, cycles = 0;
  for (int i = 0; i < 200; ++i) {
    Pair& p = pairs[i % pairs.size()];
    Engine plain(*p.target);
    const Case c = make_case(plain, rng, 40, 40);
    // the reference continuation, longer than any cycle can look ahead
    GenerateOptions ref_opts;
    ref_opts.speculative = false;
    ref_opts.max_tokens = c.opts.max_tokens + 8;
    std::vector<int32_t> seq = c.prompt;
    const auto cont = run(plain, c.prompt, ref_opts);
    seq.insert(seq.end(), cont.begin(), cont.end());
    const double noise = noises[i % 5];
    for (int64_t B = 2; B <= 8; ++B) {
      ScriptedDrafter sd(8, tap_width);
      sd.script(seq, noise, rng());
      Engine spec(*p.target, &sd);
      GenerateOptions o = c.opts;
      o.block = B;
      GenerateStats st;
      const auto out = run(spec, c.prompt, o, &st);
      ASSERT_EQ(out, c.expected) << "prompt " << i << " noise " << noise << " block " << B;
      ASSERT_EQ(sd.errors, 0) << "prompt " << i << " block " << B;
      expect_stats_consistent(st, out, B);
      if (noise == 0.0) {
        EXPECT_EQ(st.accepted, st.drafted) << "prompt " << i << " block " << B;
      }
      drafted += st.drafted;
      accepted += st.accepted;
      cycles += st.cycles;
      for (int32_t k : st.accepted_per_cycle) full_cycles += k == B - 1;
    }
  }
  EXPECT_GT(full_cycles, 500);
  EXPECT_LT(accepted, drafted);
  std::cout << "scripted drafters: acceptance " << accepted << "/" << drafted << " over " << cycles << " cycles\n";
}

// The callback can stop generation at any token, also inside an accepted block; the next turn
// then reuses exactly the cached prefix.
TEST(Speculative, CallbackStopInsideABlockKeepsTheCacheInvariant) {
  const Files& f = Files::get();
  Pair p = load_pair(f.target, f.drafter, 8);
  ScriptedDrafter sd(8, 3 * 64);
  Engine plain(*p.target);
  const auto prompt = random_tokens(9, 5, kVocab);
  GenerateOptions po;
  po.speculative = false;
  po.max_tokens = 40;
  const auto ref = run(plain, prompt, po);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), ref.begin(), ref.end());
  for (int64_t stop_at = 1; stop_at <= 12; ++stop_at) {
    sd.script(seq, 0.0, stop_at);
    Engine spec(*p.target, &sd);
    GenerateOptions o;
    o.max_tokens = 30;
    std::vector<int32_t> out;
    spec.generate(prompt, o, [&](int32_t t) {
      out.push_back(t);
      // the cache holds the prompt and every yielded token but the last, at every yield
      std::vector<int32_t> want = prompt;
      want.insert(want.end(), out.begin(), out.end() - 1);
      EXPECT_EQ(spec.cached_tokens(), want);
      return static_cast<int64_t>(out.size()) < stop_at;
    });
    ASSERT_EQ(out, std::vector<int32_t>(ref.begin(), ref.begin() + stop_at));
    EXPECT_EQ(p.target->n_past(), static_cast<int64_t>(spec.cached_tokens().size()));
    EXPECT_EQ(sd.context_end(), p.target->n_past());
    // next turn: prompt + output + 3 new tokens reuses the cache
    std::vector<int32_t> p2 = prompt;
    p2.insert(p2.end(), out.begin(), out.end());
    const auto extra = random_tokens(3, 100 + stop_at, kVocab);
    p2.insert(p2.end(), extra.begin(), extra.end());
    GenerateOptions o2;
    o2.max_tokens = 12;
    GenerateStats st;
    sd.script(std::vector<int32_t>(), 1.0, 9);  // garbage proposals from here on (no reference to check)
    const auto out2 = run(spec, p2, o2, &st);
    EXPECT_EQ(st.reused_tokens, static_cast<int64_t>(prompt.size() + out.size() - 1));
    Engine fresh(*p.target);
    GenerateOptions o3 = o2;
    o3.speculative = false;
    EXPECT_EQ(out2, run(fresh, p2, o3));
  }
}

// Multi-turn chat: each turn extends the last; reusing both caches gives what a fresh run gives.
// With prefill chunks below the chunked-GDN threshold every forward is the sequential recurrence,
// so even the drafter context is bit-identical and the drafts (and stats) repeat exactly.
TEST(Speculative, MultiTurnReuseMatchesFreshRun) {
  const Files& f = Files::get();
  for (int64_t rows : {8, 40}) {
    Pair a = load_pair(f.target, f.drafter, rows);
    Pair b = load_pair(f.target, f.drafter, rows);
    Engine chat(*a.target, a.drafter.get());
    Engine fresh(*b.target, b.drafter.get());
    std::mt19937_64 rng(rows);
    std::vector<int32_t> prompt = random_tokens(11, 1, kVocab);
    for (int turn = 0; turn < 6; ++turn) {
      GenerateOptions o;
      o.max_tokens = 6 + static_cast<int64_t>(rng() % 20);
      o.block = 2 + static_cast<int64_t>(rng() % 7);
      o.speculative = turn != 3;  // one plain turn in between: the drafter context is then rebuilt
      GenerateStats sc, sf;
      const size_t cached_before = chat.cached_tokens().size();
      const auto out = run(chat, prompt, o, &sc);
      fresh.reset();
      const auto want = run(fresh, prompt, o, &sf);
      ASSERT_EQ(out, want) << "max_rows " << rows << " turn " << turn;
      if (turn > 0 && turn != 4) {
        EXPECT_EQ(sc.reused_tokens, static_cast<int64_t>(cached_before)) << "turn " << turn;
      }
      if (turn == 4) {
        EXPECT_EQ(sc.reused_tokens, 0) << "the drafter context was stale: start over";
      }
      if (rows == 8 && o.speculative) {
        EXPECT_EQ(sc.accepted_per_cycle, sf.accepted_per_cycle) << "turn " << turn;
      }
      prompt.insert(prompt.end(), out.begin(), out.end());
      const auto extra = random_tokens(1 + rng() % 9, rng(), kVocab);
      prompt.insert(prompt.end(), extra.begin(), extra.end());
    }
  }
}

// When the context fills up, speculative decoding stops where plain decoding stops.
TEST(Speculative, FullContextMatchesPlain) {
  const Files& f = Files::get();
  for (int64_t n_ctx : {24, 31}) {
    Pair p = load_pair(f.target, f.drafter, 8, n_ctx);
    ScriptedDrafter sd(8, 3 * 64);
    for (int64_t len = 1; len < n_ctx; len += 3) {
      const auto prompt = random_tokens(len, 40 + len, kVocab);
      Engine plain(*p.target);
      GenerateOptions o;
      o.speculative = false;
      o.max_tokens = 100;
      GenerateStats sp;
      const auto want = run(plain, prompt, o, &sp);
      EXPECT_TRUE(sp.context_full);
      std::vector<int32_t> seq = prompt;
      seq.insert(seq.end(), want.begin(), want.end());
      for (double noise : {0.0, 1.0}) {
        for (int64_t B : {2, 5, 8}) {
          sd.script(seq, noise, B);
          Engine spec(*p.target, &sd);
          o.speculative = true;
          o.block = B;
          GenerateStats ss;
          ASSERT_EQ(run(spec, prompt, o, &ss), want) << "n_ctx " << n_ctx << " prompt " << len << " block " << B;
          EXPECT_TRUE(ss.context_full);
          EXPECT_EQ(sd.errors, 0);
          Engine real(*p.target, p.drafter.get());
          ASSERT_EQ(run(real, prompt, o), want) << "n_ctx " << n_ctx << " prompt " << len << " block " << B;
        }
      }
    }
  }
}

TEST(Speculative, BlockWidthOutOfRangeIsAnError) {
  const Files& f = Files::get();
  Pair p = load_pair(f.target, f.drafter, 8);
  Engine e(*p.target, p.drafter.get());
  for (int64_t B : {0, 1, 9}) {
    GenerateOptions o;
    o.block = B;
    EXPECT_THROW(run(e, random_tokens(5, 1, kVocab), o), Error) << B;
  }
}

}  // namespace
}  // namespace dflash
