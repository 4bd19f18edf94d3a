#include "text/tokenizer.h"

#include <gtest/gtest.h>

// Designated initializers name only the options a test changes.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include <random>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "test_vocab.h"
#include "util/error.h"

namespace dflash::text {
namespace {

using testing::bl;
using testing::test_config;
using Ids = std::vector<int32_t>;

class TokenizerTest : public ::testing::Test {
 protected:
  Tokenizer tok{test_config()};
  int32_t id(std::string_view raw) const {
    auto t = tok.find_token(bl(raw));
    EXPECT_TRUE(t.has_value()) << "no token for '" << raw << "'";
    return t.value_or(-1);
  }
  int32_t special(std::string_view text) const { return tok.find_token(text).value_or(-1); }
};

// Expects `f` to throw dflash::Error whose message contains `what`.
template <typename F>
void expect_error(F&& f, std::string_view what) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string_view(e.what()).find(what), std::string_view::npos) << e.what();
  }
}

TEST_F(TokenizerTest, Vocabulary) {
  EXPECT_EQ(tok.n_vocab(), 256 + 19 + 7);
  EXPECT_EQ(tok.n_merges(), 19u);
  EXPECT_EQ(id(" "), 32);
  EXPECT_EQ(tok.token_text(32), "\xC4\xA0");  // Ġ
  EXPECT_EQ(special("<|im_end|>"), 277);
  EXPECT_EQ(tok.token_type(277), TokenType::Control);
  EXPECT_EQ(tok.token_type(278), TokenType::UserDefined);
}

TEST_F(TokenizerTest, MergesApplyByRank) {
  EXPECT_EQ(tok.encode("hello world"), (Ids{id("hello"), id(" world")}));
  EXPECT_EQ(tok.encode(" the"), (Ids{id(" the")}));    // "he" (rank 0) before " t" (rank 2)
  EXPECT_EQ(tok.encode(" hello"), (Ids{32, id("hello")}));  // no merge " " + "hello"
  EXPECT_EQ(tok.encode("it's"), (Ids{'i', 't', id("'s")}));
  EXPECT_EQ(tok.encode("\xE4\xB8\xAD"), (Ids{id("\xE4\xB8\xAD")}));  // 中 through two merges
  EXPECT_EQ(tok.encode("12"), (Ids{'1', '2'}));  // digits never merge: the pre-tokenizer splits them
}

TEST_F(TokenizerTest, EqualRanksMergeLeftmostFirst) {
  EXPECT_EQ(tok.encode("aaa"), (Ids{id("aa"), 'a'}));
  EXPECT_EQ(tok.encode("aaaa"), (Ids{id("aa"), id("aa")}));
  EXPECT_EQ(tok.encode("aaaaa"), (Ids{id("aa"), id("aa"), 'a'}));
  EXPECT_EQ(tok.encode("\n\n\n"), (Ids{id("\n\n"), '\n'}));
  EXPECT_EQ(tok.encode("hi        "), (Ids{'h', 'i', id("    "), id("    ")}));  // trailing run of 8
  // 8 spaces before a word: the run keeps 7, the 8th joins the word.
  EXPECT_EQ(tok.encode("        x"), (Ids{id("    "), id("  "), ' ', ' ', 'x'}));
}

TEST_F(TokenizerTest, LongWordsUseTheHeap) {
  const Ids ids = tok.encode(std::string(100001, 'a'));
  ASSERT_EQ(ids.size(), 50001u);
  for (size_t i = 0; i + 1 < ids.size(); ++i) ASSERT_EQ(ids[i], id("aa"));
  EXPECT_EQ(ids.back(), 'a');
}

TEST_F(TokenizerTest, SpecialTokens) {
  const std::string chat = "<|im_start|>user\nhi<|im_end|>\n";
  EXPECT_EQ(tok.encode(chat), (Ids{special("<|im_start|>"), 'u', 's', 'e', 'r', '\n', 'h', 'i', special("<|im_end|>"), '\n'}));
  // Without parse_special, control tokens are plain text...
  const Ids plain = tok.encode(chat, {.add_special = true, .parse_special = false});
  for (int32_t t : plain) EXPECT_NE(tok.token_type(t), TokenType::Control);
  EXPECT_EQ(tok.decode(plain), chat);
  // ...but user-defined tokens are always split out (HF added tokens / llama.cpp USER_DEFINED).
  EXPECT_EQ(tok.encode("<think>x</think>", {.add_special = true, .parse_special = false}),
            (Ids{special("<think>"), 'x', special("</think>")}));
  // Leftmost, then longest.
  EXPECT_EQ(tok.encode("<tool><call>"), (Ids{special("<tool><call>")}));
  EXPECT_EQ(tok.encode("a<tool><cal"), (Ids{'a', special("<tool>"), '<', 'c', 'a', 'l'}));
  EXPECT_EQ(tok.encode("<|im_end|><|im_end|>"), (Ids{special("<|im_end|>"), special("<|im_end|>")}));
  // The text around a special token is pre-tokenized on its own: " " before it stays alone.
  EXPECT_EQ(tok.encode("a <|im_end|>"), (Ids{'a', ' ', special("<|im_end|>")}));
  EXPECT_EQ(tok.encode("<|im_end"), (Ids{'<', '|', 'i', 'm', '_', 'e', 'n', 'd'}));
}

TEST_F(TokenizerTest, InvalidUtf8BecomesByteTokens) {
  EXPECT_EQ(tok.encode("a\xFF" "b"), (Ids{'a', 0xFF, 'b'}));
  EXPECT_EQ(tok.encode("\xE4\xB8"), (Ids{0xE4, 0xB8}));  // a truncated 中 must not merge
  EXPECT_EQ(tok.encode("\xED\xA0\x80"), (Ids{0xED, 0xA0, 0x80}));
  EXPECT_EQ(tok.decode(tok.encode("x\xC0\xAFy\xF0\x9F")), "x\xC0\xAFy\xF0\x9F");
}

TEST_F(TokenizerTest, EmptyAndBos) {
  EXPECT_TRUE(tok.encode("").empty());
  auto cfg = test_config();
  cfg.add_bos = true;
  Tokenizer with_bos(std::move(cfg));
  EXPECT_EQ(with_bos.encode("hi"), (Ids{with_bos.bos_id(), 'h', 'i'}));
  EXPECT_EQ(with_bos.encode("hi", {.add_special = false}), (Ids{'h', 'i'}));
}

TEST_F(TokenizerTest, DecodeRoundTrips) {
  std::mt19937 rng(1234);
  const std::vector<std::string> parts = {"hello", " world", "  ", "\n\n", "'s", "\xE4\xB8\xAD", "<|im_end|>", "<think>",
                                          "12", "aaa", "\t", "\xF0\x9F\x91\x8B", "\r\n", "e\xCC\x81", "\xFF", "!?"};
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 20);
    for (int i = 0; i < n; ++i) text += parts[rng() % parts.size()];
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() & 0xFF);
    EXPECT_EQ(tok.decode(tok.encode(bytes)), bytes);
  }
}

TEST_F(TokenizerTest, DecodeSpecialFlag) {
  const Ids ids = tok.encode("<|im_start|>a<think>b<|im_end|>");
  EXPECT_EQ(tok.decode(ids), "<|im_start|>a<think>b<|im_end|>");
  EXPECT_EQ(tok.decode(ids, /*special=*/false), "a<think>b");  // user-defined tokens stay
  EXPECT_EQ(tok.token_to_piece(32), " ");
  EXPECT_EQ(tok.token_to_piece(id("\n\n")), "\n\n");
  EXPECT_EQ(tok.token_to_piece(special("<|im_end|>"), false), "");
  expect_error([&] { tok.decode(Ids{tok.n_vocab()}); }, "out of range");
  expect_error([&] { tok.token_to_piece(-1); }, "out of range");
}

TEST_F(TokenizerTest, EndOfGeneration) {
  EXPECT_TRUE(tok.is_eog(special("<|im_end|>")));
  EXPECT_TRUE(tok.is_eog(special("<|endoftext|>")));
  EXPECT_TRUE(tok.is_eog(tok.eos_id()));
  EXPECT_FALSE(tok.is_eog(special("<|im_start|>")));
  EXPECT_FALSE(tok.is_eog('a'));
}

TEST_F(TokenizerTest, SplitShowsPieces) {
  const std::string text = "Hi <|im_end|> 42";
  const auto spans = tok.split(text);
  std::vector<std::string> pieces;
  for (auto [b, e] : spans) pieces.push_back(text.substr(b, e - b));
  EXPECT_EQ(pieces, (std::vector<std::string>{"Hi", " ", "<|im_end|>", " ", "4", "2"}));
}

// ---------------------------------------------------------------------------------------------
// Streaming

TEST_F(TokenizerTest, StreamNeverSplitsACharacter) {
  StreamDecoder sd(tok);
  // 你 = E4 BD A0, 好 = E5 A5 BD: byte tokens, one at a time.
  const Ids ids = {0xE4, 0xBD, 0xA0, 0xE5, 0xA5, 0xBD, '!'};
  std::vector<std::string> out;
  for (int32_t t : ids) out.push_back(sd.push(t));
  EXPECT_EQ(out, (std::vector<std::string>{"", "", "\xE4\xBD\xA0", "", "", "\xE5\xA5\xBD", "!"}));
  EXPECT_EQ(sd.flush(), "");
}

TEST_F(TokenizerTest, StreamEmojiAcrossTokensAndFlush) {
  StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(0xF0), "");
  EXPECT_EQ(sd.push(0x9F), "");
  EXPECT_EQ(sd.push(0x91), "");
  EXPECT_EQ(sd.pending_bytes(), 3u);
  EXPECT_EQ(sd.push(0x8B), "\xF0\x9F\x91\x8B");
  // An incomplete character at the end becomes U+FFFD on flush.
  EXPECT_EQ(sd.push(0xE4), "");
  EXPECT_EQ(sd.push(0xB8), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(sd.pending_bytes(), 0u);
}

TEST_F(TokenizerTest, StreamReplacesInvalidBytesAtOnce) {
  StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(sd.push(0xE4), "");
  EXPECT_EQ(sd.push('a'), "\xEF\xBF\xBD" "a");  // the broken sequence, then the letter
  EXPECT_EQ(sd.push(special("<|im_end|>")), "<|im_end|>");
  StreamDecoder quiet(tok, /*special=*/false);
  EXPECT_EQ(quiet.push(special("<|im_end|>")), "");
}

TEST_F(TokenizerTest, StreamMatchesDecodeOnValidText) {
  const std::string text = "h\xC3\xA9llo \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x91\x8B\xF0\x9F\x8F\xBD <think>ok</think>\n";
  StreamDecoder sd(tok);
  std::string streamed;
  for (int32_t t : tok.encode(text)) streamed += sd.push(t);
  streamed += sd.flush();
  EXPECT_EQ(streamed, text);
}

// ---------------------------------------------------------------------------------------------
// Validation

TEST(TokenizerConfigCheck, RejectsBadVocabularies) {
  {
    auto cfg = test_config();
    cfg.merges.push_back(bl("x") + " " + bl("nothere"));
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "'" + bl("nothere") + "' is not a token");
  }
  {
    auto cfg = test_config();
    cfg.merges.push_back(bl("x") + " " + bl("y"));  // "xy" is not in the vocabulary
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "merged text");
  }
  {
    auto cfg = test_config();
    cfg.merges.push_back("nospace");
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "not of the form");
  }
  {
    auto cfg = test_config();
    cfg.types.pop_back();
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "token types");
  }
  {
    auto cfg = test_config();
    cfg.eos_id = static_cast<int32_t>(cfg.tokens.size());
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "eos id");
  }
  {
    auto cfg = test_config();
    cfg.types[5] = static_cast<TokenType>(9);
    expect_error([&] { Tokenizer t(std::move(cfg)); }, "unknown type 9");
  }
  expect_error([] { Tokenizer t(TokenizerConfig{}); }, "empty");
}

TEST(TokenizerConfigCheck, MissingByteTokensAreDroppedNotFatal) {
  auto cfg = test_config();
  cfg.merges.clear();
  cfg.tokens['z'] = "not-a-byte";  // the vocabulary has no token for byte 'z'
  Tokenizer t(std::move(cfg));
  EXPECT_EQ(t.encode("azb"), (Ids{'a', 'b'}));
}

// ---------------------------------------------------------------------------------------------
// GGUF

gguf::Writer tokenizer_gguf(const TokenizerConfig& cfg, std::string_view pre = "qwen35") {
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::string("qwen35"));
  w.set("tokenizer.ggml.model", gguf::Value::string("gpt2"));
  w.set("tokenizer.ggml.pre", gguf::Value::string(std::string(pre)));
  std::vector<gguf::Value> tokens, types, merges;
  for (const auto& t : cfg.tokens) tokens.push_back(gguf::Value::string(t));
  for (auto t : cfg.types) types.push_back(gguf::Value::i32(static_cast<int32_t>(t)));
  for (const auto& m : cfg.merges) merges.push_back(gguf::Value::string(m));
  w.set("tokenizer.ggml.tokens", gguf::Value::array(gguf::ValueType::STRING, std::move(tokens)));
  w.set("tokenizer.ggml.token_type", gguf::Value::array(gguf::ValueType::I32, std::move(types)));
  w.set("tokenizer.ggml.merges", gguf::Value::array(gguf::ValueType::STRING, std::move(merges)));
  w.set("tokenizer.ggml.eos_token_id", gguf::Value::u32(static_cast<uint32_t>(cfg.eos_id)));
  w.set("tokenizer.ggml.bos_token_id", gguf::Value::u32(static_cast<uint32_t>(cfg.bos_id)));
  w.set("tokenizer.ggml.padding_token_id", gguf::Value::u32(static_cast<uint32_t>(cfg.pad_id)));
  w.set("tokenizer.ggml.add_bos_token", gguf::Value::boolean(false));
  return w;
}

TEST(TokenizerGguf, LoadsLikeTheVectors) {
  const auto cfg = test_config();
  const auto file = gguf::File::from_bytes(tokenizer_gguf(cfg).to_bytes(), "tok.gguf");
  const Tokenizer a = Tokenizer::from_gguf(file);
  const Tokenizer b(test_config());
  EXPECT_EQ(a.n_vocab(), b.n_vocab());
  EXPECT_EQ(a.pre_tokenizer(), PreTokenizer::Qwen35);
  EXPECT_EQ(a.eos_id(), b.eos_id());
  EXPECT_FALSE(a.add_bos());
  for (std::string_view text : {"hello world <|im_end|>", "  it's 12 \xE4\xB8\xAD\n\n", "aaaaa<think>"}) {
    EXPECT_EQ(a.encode(text), b.encode(text));
  }
  const auto file2 = gguf::File::from_bytes(tokenizer_gguf(cfg, "qwen2").to_bytes(), "tok.gguf");
  EXPECT_EQ(Tokenizer::from_gguf(file2).pre_tokenizer(), PreTokenizer::Qwen2);
}

TEST(TokenizerGguf, ErrorsNameFileAndKey) {
  const auto cfg = test_config();
  {
    auto w = tokenizer_gguf(cfg, "llama-bpe");
    const auto f = gguf::File::from_bytes(w.to_bytes(), "bad-pre.gguf");
    expect_error([&] { Tokenizer::from_gguf(f); }, "bad-pre.gguf: tokenizer.ggml.pre is 'llama-bpe'");
  }
  {
    auto w = tokenizer_gguf(cfg);
    w.set("tokenizer.ggml.model", gguf::Value::string("llama"));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "spm.gguf");
    expect_error([&] { Tokenizer::from_gguf(f); }, "tokenizer.ggml.model is 'llama'");
  }
  {
    auto w = tokenizer_gguf(cfg);
    w.set("tokenizer.ggml.eos_token_id", gguf::Value::u32(100000));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "eos.gguf");
    expect_error([&] { Tokenizer::from_gguf(f); }, "tokenizer.ggml.eos_token_id is 100000");
  }
  {
    auto w = tokenizer_gguf(cfg);
    w.set("tokenizer.ggml.token_type", gguf::Value::array(gguf::ValueType::I32, {gguf::Value::i32(1)}));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "types.gguf");
    expect_error([&] { Tokenizer::from_gguf(f); }, "token_type has 1 entries");
  }
  {
    auto w = tokenizer_gguf(cfg);
    std::vector<gguf::Value> merges = {gguf::Value::string("q zz")};
    w.set("tokenizer.ggml.merges", gguf::Value::array(gguf::ValueType::STRING, std::move(merges)));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "merges.gguf");
    expect_error([&] { Tokenizer::from_gguf(f); }, "merges.gguf: tokenizer: merge #0 'q zz'");
  }
}

}  // namespace
}  // namespace dflash::text
