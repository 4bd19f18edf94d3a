#include "text/pretokenize.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dflash::text {
namespace {

using Pieces = std::vector<std::string>;

Pieces split(std::string_view text, PreTokenizer kind = PreTokenizer::Qwen35) {
  Pieces out;
  for (std::string_view p : pre_tokenize(text, kind)) out.emplace_back(p);
  return out;
}

// Splits must tile the input on anything, both kinds.
void expect_tiles(std::string_view text) {
  for (PreTokenizer k : {PreTokenizer::Qwen2, PreTokenizer::Qwen35}) {
    std::string joined;
    for (std::string_view p : pre_tokenize(text, k)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, text);
  }
}

TEST(PreTokenize, WordsTakeOneLeadingNonLetter) {
  EXPECT_EQ(split("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(split("(word) [x]"), (Pieces{"(word", ")", " [", "x", "]"}));
  EXPECT_EQ(split("\tfoo"), (Pieces{"\tfoo"}));
  EXPECT_EQ(split("foo_bar"), (Pieces{"foo", "_bar"}));
  EXPECT_EQ(split("a\xC2\xA0" "b"), (Pieces{"a", "\xC2\xA0" "b"}));  // NBSP is whitespace, joins the word
}

TEST(PreTokenize, Contractions) {
  EXPECT_EQ(split("I'm can't WE'LL they're I'D you've"),
            (Pieces{"I", "'m", " can", "'t", " WE", "'LL", " they", "'re", " I", "'D", " you", "'ve"}));
  EXPECT_EQ(split("'sup"), (Pieces{"'s", "up"}));   // the contraction matches first, even mid-word
  EXPECT_EQ(split("'x"), (Pieces{"'x"}));           // not a contraction: prefix + letters
  EXPECT_EQ(split("''s"), (Pieces{"''", "s"}));  // "''" is a punctuation run, then the letters
  EXPECT_EQ(split("'\xC5\xBFt"), (Pieces{"'\xC5\xBF", "t"}));  // (?i) folds U+017F (long s) to s
}

TEST(PreTokenize, NumbersAreSingleDigits) {
  EXPECT_EQ(split("12345"), (Pieces{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split("abc123def"), (Pieces{"abc", "1", "2", "3", "def"}));
  EXPECT_EQ(split(" 42"), (Pieces{" ", "4", "2"}));
  EXPECT_EQ(split("3.14"), (Pieces{"3", ".", "1", "4"}));
  EXPECT_EQ(split("\xC2\xBD\xE2\x85\xAB"), (Pieces{"\xC2\xBD", "\xE2\x85\xAB"}));  // ½ Ⅻ are \p{N}
  EXPECT_EQ(split("\xD9\xA3\xD9\xA4"), (Pieces{"\xD9\xA3", "\xD9\xA4"}));          // Arabic-Indic digits
}

TEST(PreTokenize, PunctuationRunsKeepTrailingNewlines) {
  EXPECT_EQ(split("x = 1;\r\n"), (Pieces{"x", " =", " ", "1", ";\r\n"}));
  EXPECT_EQ(split("...\n\nfoo"), (Pieces{"...\n\n", "foo"}));
  EXPECT_EQ(split("a != b"), (Pieces{"a", " !=", " b"}));
  EXPECT_EQ(split("  != b"), (Pieces{" ", " !=", " b"}));
}

TEST(PreTokenize, WhitespaceRuns) {
  EXPECT_EQ(split("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(split("a   \n\n  b"), (Pieces{"a", "   \n\n", " ", " b"}));
  EXPECT_EQ(split("hi   "), (Pieces{"hi", "   "}));
  EXPECT_EQ(split("hello\n"), (Pieces{"hello", "\n"}));
  EXPECT_EQ(split("  \tfoo"), (Pieces{"  ", "\tfoo"}));
  EXPECT_EQ(split("\n\n\n"), (Pieces{"\n\n\n"}));
  EXPECT_EQ(split("a\r\n\r\nb"), (Pieces{"a", "\r\n\r\n", "b"}));
  EXPECT_EQ(split("a \n b"), (Pieces{"a", " \n", " b"}));
  EXPECT_EQ(split("    return x"), (Pieces{"   ", " return", " x"}));
  EXPECT_EQ(split(" "), (Pieces{" "}));
  EXPECT_EQ(split(" 1"), (Pieces{" ", "1"}));
}

TEST(PreTokenize, CjkAndEmoji) {
  EXPECT_EQ(split("\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C"), (Pieces{"\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C"}));
  EXPECT_EQ(split("\xE4\xB8\xAD\xE6\x96\x87 text"), (Pieces{"\xE4\xB8\xAD\xE6\x96\x87", " text"}));
  // 👋🏽 (So + Sk skin tone) and '!' form one punctuation run with the space.
  EXPECT_EQ(split("hi \xF0\x9F\x91\x8B\xF0\x9F\x8F\xBD!"), (Pieces{"hi", " \xF0\x9F\x91\x8B\xF0\x9F\x8F\xBD!"}));
  // Japanese with the ideographic full stop.
  EXPECT_EQ(split("\xE3\x81\x93\xE3\x82\x93\xE3\x80\x82"), (Pieces{"\xE3\x81\x93\xE3\x82\x93", "\xE3\x80\x82"}));
}

TEST(PreTokenize, CombiningMarksDifferBetweenKinds) {
  const std::string cafe = "cafe\xCC\x81";  // e + U+0301
  EXPECT_EQ(split(cafe, PreTokenizer::Qwen2), (Pieces{"cafe", "\xCC\x81"}));
  EXPECT_EQ(split(cafe, PreTokenizer::Qwen35), (Pieces{cafe}));
  // नमस्ते: virama (Mn) and vowel sign (Mc) break qwen2's letter runs.
  const std::string namaste = "\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8\xE0\xA5\x8D\xE0\xA4\xA4\xE0\xA5\x87";
  EXPECT_EQ(split(namaste, PreTokenizer::Qwen2),
            (Pieces{"\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8", "\xE0\xA5\x8D\xE0\xA4\xA4", "\xE0\xA5\x87"}));
  EXPECT_EQ(split(namaste, PreTokenizer::Qwen35), (Pieces{namaste}));
  // A mark after a space: qwen35 keeps space + mark + letters together; qwen2 puts the space
  // before the punctuation-like mark.
  EXPECT_EQ(split("a \xCC\x81x", PreTokenizer::Qwen35), (Pieces{"a", " \xCC\x81x"}));
  EXPECT_EQ(split("a \xCC\x81x", PreTokenizer::Qwen2), (Pieces{"a", " \xCC\x81", "x"}));
}

TEST(PreTokenize, InvalidBytesStandAlone) {
  EXPECT_EQ(split("a\xFF" "b"), (Pieces{"a", "\xFF", "b"}));
  EXPECT_EQ(split("\xE4\xB8"), (Pieces{"\xE4", "\xB8"}));
  EXPECT_EQ(split("!!\xC0!!"), (Pieces{"!!", "\xC0", "!!"}));
  EXPECT_EQ(split(" \xFF"), (Pieces{" ", "\xFF"}));
}

TEST(PreTokenize, TilesArbitraryInput) {
  expect_tiles("");
  expect_tiles("The quick brown fox's 123 jumps!!\r\n\r\n   over\t\tthe lazy dog.   ");
  expect_tiles("\xFF\xFE\xE4\xB8\xAD\xED\xA0\x80 \xF0\x9F\x98\x80\n");
  std::string all_bytes;
  for (int i = 0; i < 256; ++i) all_bytes.push_back(static_cast<char>(i));
  expect_tiles(all_bytes);
  expect_tiles(std::string(10000, ' ') + "x" + std::string(5000, '\n'));
}

}  // namespace
}  // namespace dflash::text
