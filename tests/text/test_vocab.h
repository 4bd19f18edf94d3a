// A tiny byte-level BPE vocabulary for the text tests: the 256 byte tokens (id = byte value, text
// = the byte's GPT-2 alphabet character), a handful of merges whose results are easy to work out by
// hand, and special tokens.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "text/tokenizer.h"
#include "text/unicode.h"

namespace dflash::text::testing {

// Raw bytes -> the byte-level alphabet text ("a b" -> "aĠb").
inline std::string bl(std::string_view bytes) {
  std::string out;
  for (char c : bytes) utf8_append(out, byte_to_unicode(static_cast<uint8_t>(c)));
  return out;
}

// Merges as raw byte strings, in rank order.
inline const std::vector<std::pair<std::string, std::string>>& test_merges() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"h", "e"},             // 0  he
      {"l", "l"},             // 1  ll
      {" ", "t"},             // 2  " t"
      {" t", "he"},           // 3  " the"
      {"he", "ll"},           // 4  hell
      {"hell", "o"},          // 5  hello
      {" ", "w"},             // 6  " w"
      {"o", "r"},             // 7  or
      {" w", "or"},           // 8  " wor"
      {"l", "d"},             // 9  ld
      {" wor", "ld"},         // 10 " world"
      {"a", "a"},             // 11 aa
      {" ", " "},             // 12 "  "
      {"  ", "  "},           // 13 "    "
      {"\n", "\n"},           // 14 "\n\n"
      {"'", "s"},             // 15 's
      {"\xE4", "\xB8"},       // 16 first two bytes of 中 (E4 B8 AD)
      {"\xE4\xB8", "\xAD"},   // 17 中
      {"1", "2"},             // 18 "12": never used, digits are split one by one
  };
  return m;
}

struct TestSpecial {
  const char* text;
  TokenType type;
};
inline const std::vector<TestSpecial>& test_specials() {
  static const std::vector<TestSpecial> s = {
      {"<|endoftext|>", TokenType::Control},
      {"<|im_start|>", TokenType::Control},
      {"<|im_end|>", TokenType::Control},
      {"<think>", TokenType::UserDefined},
      {"</think>", TokenType::UserDefined},
      {"<tool>", TokenType::UserDefined},
      {"<tool><call>", TokenType::UserDefined},  // longer match wins over "<tool>"
  };
  return s;
}

inline TokenizerConfig test_config(PreTokenizer pre = PreTokenizer::Qwen35) {
  TokenizerConfig cfg;
  for (int b = 0; b < 256; ++b) {
    cfg.tokens.push_back(bl(std::string(1, static_cast<char>(b))));
    cfg.types.push_back(TokenType::Normal);
  }
  for (const auto& [l, r] : test_merges()) {
    cfg.merges.push_back(bl(l) + " " + bl(r));
    cfg.tokens.push_back(bl(l + r));
    cfg.types.push_back(TokenType::Normal);
  }
  for (const TestSpecial& s : test_specials()) {
    cfg.tokens.push_back(s.text);
    cfg.types.push_back(s.type);
  }
  cfg.pre = pre;
  cfg.eos_id = static_cast<int32_t>(256 + test_merges().size());  // <|endoftext|>
  cfg.bos_id = cfg.eos_id;
  cfg.pad_id = cfg.eos_id;
  return cfg;
}

}  // namespace dflash::text::testing
