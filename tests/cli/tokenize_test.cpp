// Runs the built `dflash tokenize` / `dflash detokenize` on a GGUF holding the small test vocabulary
// of tests/text (256 byte tokens, a few merges, specials).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "gguf/gguf.h"
#include "support/run_binary.h"
#include "text/test_vocab.h"

namespace dflash::cli::tokenize_test {
namespace {

namespace fs = std::filesystem;

using testing::shell_quote;
using Result = testing::RunResult;
std::string quote(const std::string& s) { return shell_quote(s); }

class TokenizeCli : public testing::BinaryTest {
 protected:
  void SetUp() override {
    BinaryTest::SetUp();
    model_ = path("vocab.gguf").string();
    const text::TokenizerConfig cfg = text::testing::test_config();
    gguf::Writer w;
    w.set("tokenizer.ggml.model", gguf::Value::string("gpt2"));
    w.set("tokenizer.ggml.pre", gguf::Value::string("qwen35"));
    std::vector<gguf::Value> tokens, types, merges;
    for (const auto& t : cfg.tokens) tokens.push_back(gguf::Value::string(t));
    for (auto t : cfg.types) types.push_back(gguf::Value::i32(static_cast<int32_t>(t)));
    for (const auto& m : cfg.merges) merges.push_back(gguf::Value::string(m));
    w.set("tokenizer.ggml.tokens", gguf::Value::array(gguf::ValueType::STRING, std::move(tokens)));
    w.set("tokenizer.ggml.token_type", gguf::Value::array(gguf::ValueType::I32, std::move(types)));
    w.set("tokenizer.ggml.merges", gguf::Value::array(gguf::ValueType::STRING, std::move(merges)));
    w.set("tokenizer.ggml.eos_token_id", gguf::Value::u32(static_cast<uint32_t>(cfg.eos_id)));
    w.write(model_);
  }
  std::string model_;
};

// Ids of the test vocabulary: byte b is token b, merge rank r is token 256 + r, then the specials.
constexpr int kHello = 256 + 5, kWorld = 256 + 10, kImStart = 256 + 19 + 1, kImEnd = 256 + 19 + 2;

TEST_F(TokenizeCli, TokenizePrintsIds) {
  Result r = run(fmt::format("tokenize -m {} {}", quote(model_), quote("hello world")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, fmt::format("{} {}\n", kHello, kWorld));

  r = run(fmt::format("tokenize -m {} --json {}", quote(model_), quote("<|im_start|>hello<|im_end|>")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["ids"], nlohmann::json::array({kImStart, kHello, kImEnd}));

  r = run(fmt::format("tokenize -m {} --no-special --json {}", quote(model_), quote("<|im_end|>")));
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json parsed = nlohmann::json::parse(r.out);  // range-for over a temporary's member dangles
  for (int id : parsed["ids"]) EXPECT_LT(id, 256);
}

TEST_F(TokenizeCli, VerboseShowsPieces) {
  Result r = run(fmt::format("tokenize -m {} --verbose {}", quote(model_), quote("hello world<|im_end|>")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"hello\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\" world\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("control"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3 tokens"), std::string::npos) << r.out;

  r = run(fmt::format("tokenize -m {} --split {}", quote(model_), quote("I'm 42")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out), nlohmann::json::array({"I", "'m", " ", "4", "2"}));
}

TEST_F(TokenizeCli, FileAndBatch) {
  std::ofstream(dir_ / "in.txt", std::ios::binary) << "hello\xFF world";
  Result r = run(fmt::format("tokenize -m {} --file {}", quote(model_), quote((dir_ / "in.txt").string())));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, fmt::format("{} 255 {}\n", kHello, kWorld));

  std::ofstream(dir_ / "docs.jsonl") << "\"hello world\"\n{\"text\": \"\\u4e2d hi\"}\n\n\"\"\n";
  r = run(fmt::format("tokenize -m {} --batch {}", quote(model_), quote((dir_ / "docs.jsonl").string())));
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<nlohmann::json> results;
  while (std::getline(lines, line)) results.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(results.size(), 3u) << r.out;
  EXPECT_EQ(results[0]["ids"], nlohmann::json::array({kHello, kWorld}));
  for (const auto& j : results) EXPECT_TRUE(j["roundtrip"].get<bool>());
  EXPECT_NE(r.err.find("3 documents"), std::string::npos) << r.err;

  std::ofstream(dir_ / "bad.jsonl") << "\"ok\"\n{not json\n";
  r = run(fmt::format("tokenize -m {} --batch {}", quote(model_), quote((dir_ / "bad.jsonl").string())));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("bad.jsonl:2"), std::string::npos) << r.err;
}

TEST_F(TokenizeCli, Detokenize) {
  Result r = run(fmt::format("detokenize -m {} {} {}", quote(model_), kHello, kWorld));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "hello world\n");
  r = run(fmt::format("detokenize -m {} '[{}, {}, {}]'", quote(model_), kImStart, kHello, kImEnd));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "<|im_start|>hello<|im_end|>\n");
  r = run(fmt::format("detokenize -m {} --no-special {},{},{}", quote(model_), kImStart, kHello, kImEnd));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "hello\n");
}

TEST_F(TokenizeCli, Errors) {
  Result r = run(fmt::format("detokenize -m {} 999999", quote(model_)));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("out of range"), std::string::npos) << r.err;
  r = run(fmt::format("detokenize -m {} 12x", quote(model_)));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("not a token id"), std::string::npos) << r.err;
  r = run(fmt::format("tokenize -m {} hi", quote((dir_ / "missing.gguf").string())));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("missing.gguf"), std::string::npos) << r.err;
  EXPECT_EQ(run("tokenize hi").code, 2);  // -m is required
}

}  // namespace
}  // namespace dflash::cli::tokenize_test
