// The shipped model pair (models/target.gguf + models/drafter.gguf) through the real binary:
// golden greedy output, speculative == plain, and a lossless PTQ1_0 -> PQ2_0 re-quantization.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "support/run_binary.h"

namespace dflash::cli::bundled_test {
namespace {

namespace fs = std::filesystem;
using testing::shell_quote;

const fs::path kModels = DFLASH_SOURCE_DIR "/models";

class BundledModel : public testing::BinaryTest {
 protected:
  void SetUp() override {
    BinaryTest::SetUp();
    if (!fs::exists(kModels / "target.gguf")) GTEST_SKIP() << "no bundled model in this checkout";
  }
  // Greedy tokens of `dflash run ... --json`.
  std::vector<int> tokens(const std::string& args) {
    const auto r = run("run " + args + " --json -t 2", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
    EXPECT_EQ(r.code, 0) << r.err;
    if (r.code != 0) return {};
    return nlohmann::json::parse(r.out)["tokens"].get<std::vector<int>>();
  }
  // `dflash bench ARGS --json` on the bundled pair (empty on failure, with the failure recorded).
  nlohmann::json bench(const std::string& args) {
    const auto r = run("bench " + args + " --json", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json();
  }
  static std::vector<std::string> row_names(const nlohmann::json& j) {
    std::vector<std::string> tests;
    for (const auto& row : j["rows"]) tests.push_back(row["test"]);
    return tests;
  }
  static void expect_positive_rates(const nlohmann::json& j) {
    for (const auto& row : j["rows"]) EXPECT_GT(row["tokens_per_second"].get<double>(), 0.0) << row.dump();
  }
};

// Recorded from the CPU reference on 2026-11-30 (commit of models/target.gguf). The CPU kernels have
// a fixed reduction order (scalar == AVX2 bit for bit), so these ids are the same on every x86-64 host.
TEST_F(BundledModel, GoldenGreedyContinuation) {
  const std::vector<int> golden = {224, 343, 684, 29,  1758, 62,  4870, 501, 262, 374, 279,
                                   759, 326, 1352, 798, 15,  313, 1392, 224, 343, 684, 29,
                                   1758, 62, 4870, 501, 262, 374, 279, 759, 326, 1352};
  EXPECT_EQ(tokens("--no-spec --raw -p 'def add(a, b):' -n 32"), golden);
}

// Without -m the bundled drafter is used; its output equals plain decoding's.
TEST_F(BundledModel, SpeculativeEqualsPlain) {
  for (const char* prompt : {"'Write a Python function that merges two sorted lists.'", "'import os\nimport sys\n'"}) {
    const auto plain = tokens(fmt::format("--no-spec -p {} -n 48", prompt));
    for (int block : {2, 5, 8}) {
      const auto r = run(fmt::format("run -p {} -n 48 --json -t 2 --block {}", prompt, block),
                         "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
      ASSERT_EQ(r.code, 0) << r.err;
      const auto j = nlohmann::json::parse(r.out);
      ASSERT_TRUE(j.contains("speculative")) << "the bundled drafter was not used";
      EXPECT_EQ(j["tokens"].get<std::vector<int>>(), plain) << "block " << block;
    }
  }
}

// --temp samples (with the bundled drafter: speculative sampling, reported as such); the same seed gives
// the same tokens, another seed others; a temperature out of range is a usage error.
// (tests/spec/sampler_test.cpp checks that speculative sampling keeps the distribution.)
TEST_F(BundledModel, SampledRunsAreReproducibleBySeed) {
  const std::string base = "--raw -p 'def add(a, b):' -n 32 --temp 0.9 --top-p 0.95";
  const auto a = tokens(base + " --seed 7");
  ASSERT_EQ(a.size(), 32u);
  EXPECT_EQ(tokens(base + " --seed 7"), a);
  EXPECT_NE(tokens(base + " --seed 8"), a);
  const auto r = run("run " + base + " --seed 7 --json -t 2", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j.contains("sampling"));
  EXPECT_TRUE(j.contains("speculative"));  // the bundled drafter is used for sampled decoding too
  EXPECT_EQ(run("run -p x --temp 3", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string())).code, 2);
}

// PTQ1_0 and PQ2_0 hold the same ternary values; the GDN gates stay BF16. Same greedy output.
TEST_F(BundledModel, QuantizeToPq20IsLossless) {
  const std::string out = path("pq2.gguf").string();
  const auto q = run(fmt::format("quantize {} {} --type pq2_0", shell_quote((kModels / "target.gguf").string()),
                                 shell_quote(out)));
  ASSERT_EQ(q.code, 0) << q.err;
  const std::string args = " --raw -p 'class Stack:' -n 24";
  EXPECT_EQ(tokens("--no-spec -m " + shell_quote((kModels / "target.gguf").string()) + args),
            tokens("-m " + shell_quote(out) + args));
}

}  // namespace
}  // namespace dflash::cli::bundled_test

namespace dflash::cli::bundled_test {
namespace {

// `dflash bench` produces every row, with rates and the floor comparison (numbers are not asserted:
// speed is measured in benchmarks, never in tests).
TEST_F(BundledModel, BenchReportsEveryRow) {
  const auto j = bench("-r 1 -n 8 -p 16 -t 2");
  ASSERT_FALSE(j.is_null());
  expect_positive_rates(j);
  EXPECT_EQ(row_names(j), (std::vector<std::string>{"pp16", "tg8", "verify8", "draft8", "spec8 b8"}));
  EXPECT_TRUE(j["rows"][1].contains("percent_of_floor"));
  EXPECT_GT(j["rows"][0]["matmul_tflops"].get<double>(), 0.0);
  EXPECT_GT(j["read_bandwidth_gbs"].get<double>(), 0.0);
  EXPECT_GT(j["rows"][2]["pass_ms"].get<double>(), 0.0);  // the verify's split: the pass and the rollback
  EXPECT_GT(j["rows"][2]["rollback_ms"].get<double>(), 0.0);
  EXPECT_GT(j["rows"][3]["draft_over_decode"].get<double>(), 0.0);
  EXPECT_GT(j["rows"][4]["acceptance_length"].get<double>(), 1.0);  // the bundled drafter accepts something
}

// --depth D: every test after D tokens already in the cache, named as llama-bench names them ("tg4 @ d100");
// the context holds the deepest test (100 cached tokens are more than -p 8 -n 4 alone would size it
// for: no "context full"), and a negative depth is a usage error.
TEST_F(BundledModel, BenchAtDepth) {
  const auto j = bench("-r 1 -n 4 -p 8 -t 2 --depth 100");
  ASSERT_FALSE(j.is_null());
  expect_positive_rates(j);
  EXPECT_EQ(row_names(j), (std::vector<std::string>{"pp8 @ d100", "tg4 @ d100", "verify8 @ d100", "draft8 @ d100",
                                                    "spec4 b8 @ d100"}));
  const auto bad = run("bench --depth -3", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("depth"), std::string::npos) << bad.err;
}

// --no-warmup (time the first run too) is accepted and still reports every row; an unknown flag is a
// usage error, not a crash.
TEST_F(BundledModel, BenchWithoutWarmup) {
  const auto j = bench("-r 1 -n 4 -p 8 -t 2 --no-spec --no-warmup");
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(row_names(j), (std::vector<std::string>{"pp8", "tg4", "verify8"}));
  const auto bad = run("bench --no-warmups", "DFLASH_MODELS_DIR=" + shell_quote(kModels.string()));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("no-warmups"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace dflash::cli::bundled_test
