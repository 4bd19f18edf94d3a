#include "text/unicode.h"

#include <gtest/gtest.h>

namespace dflash::text {
namespace {

TEST(ByteMap, Gpt2Alphabet) {
  EXPECT_EQ(byte_to_unicode(' '), 0x120u);   // Ġ
  EXPECT_EQ(byte_to_unicode('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(byte_to_unicode('\t'), 0x109u);  // ĉ
  EXPECT_EQ(byte_to_unicode('A'), static_cast<uint32_t>('A'));
  EXPECT_EQ(byte_to_unicode(0x00), 0x100u);
  EXPECT_EQ(byte_to_unicode(0x7F), 0x121u);
  EXPECT_EQ(byte_to_unicode(0xA0), 0x142u);
  EXPECT_EQ(byte_to_unicode(0xAD), 0x143u);  // the last unprintable byte
  EXPECT_EQ(byte_to_unicode(0xE4), 0xE4u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(byte_from_unicode(byte_to_unicode(static_cast<uint8_t>(b))), b);
  EXPECT_EQ(byte_from_unicode(0x144), -1);
  EXPECT_EQ(byte_from_unicode(0x4E2D), -1);
}

TEST(Utf8, DecodeStrict) {
  uint32_t cp = 0;
  EXPECT_EQ(utf8_decode("\xE4\xB8\xAD", 0, cp), 3u);
  EXPECT_EQ(cp, 0x4E2Du);
  EXPECT_EQ(utf8_decode("\xF0\x9F\x91\x8B", 0, cp), 4u);
  EXPECT_EQ(cp, 0x1F44Bu);
  EXPECT_EQ(utf8_decode("\xC0\xAF", 0, cp), 0u);          // overlong
  EXPECT_EQ(utf8_decode("\xED\xA0\x80", 0, cp), 0u);      // surrogate
  EXPECT_EQ(utf8_decode("\xF4\x90\x80\x80", 0, cp), 0u);  // above U+10FFFF
  EXPECT_EQ(utf8_decode("\xE4\xB8", 0, cp), 0u);          // truncated
  EXPECT_EQ(utf8_decode("\x80", 0, cp), 0u);              // stray continuation
}

TEST(Utf8, IncompleteTail) {
  EXPECT_EQ(utf8_incomplete_tail(""), 0u);
  EXPECT_EQ(utf8_incomplete_tail("abc"), 0u);
  EXPECT_EQ(utf8_incomplete_tail("a\xE4"), 1u);
  EXPECT_EQ(utf8_incomplete_tail("a\xE4\xB8"), 2u);
  EXPECT_EQ(utf8_incomplete_tail("a\xE4\xB8\xAD"), 0u);
  EXPECT_EQ(utf8_incomplete_tail("\xF0\x9F\x91"), 3u);
  EXPECT_EQ(utf8_incomplete_tail("a\xFF"), 0u);      // can never complete
  EXPECT_EQ(utf8_incomplete_tail("a\xE4\x41"), 0u);  // broken already
  EXPECT_EQ(utf8_incomplete_tail("\xED\xA0"), 0u);   // would be a surrogate
}

TEST(Utf8, SanitizeReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_sanitize("abc"), "abc");
  EXPECT_EQ(utf8_sanitize("\xE4\xB8" "a"), "\xEF\xBF\xBD" "a");  // one U+FFFD for the truncated char
  EXPECT_EQ(utf8_sanitize("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_sanitize("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_sanitize("\xF0\x9F\x91"), "\xEF\xBF\xBD");
  EXPECT_TRUE(utf8_is_valid("\xE4\xB8\xAD"));
  EXPECT_FALSE(utf8_is_valid("\xE4\xB8"));
}

TEST(CharClass, Categories) {
  EXPECT_EQ(char_class('a'), kClsLetter);
  EXPECT_EQ(char_class('7'), kClsNumber);
  EXPECT_EQ(char_class('!'), 0);
  EXPECT_EQ(char_class(' '), kClsSpace);
  EXPECT_EQ(char_class('\n'), kClsSpace | kClsCrLf);
  EXPECT_EQ(char_class('\r'), kClsSpace | kClsCrLf);
  EXPECT_EQ(char_class(0x0B), kClsSpace);    // \v
  EXPECT_EQ(char_class(0x85), kClsSpace);    // NEL
  EXPECT_EQ(char_class(0xA0), kClsSpace);    // NBSP
  EXPECT_EQ(char_class(0x3000), kClsSpace);  // ideographic space
  EXPECT_EQ(char_class(0x200B), 0);          // zero width space is Cf, not \s
  EXPECT_EQ(char_class(0x1C), 0);            // \s excludes the separators Python's isspace includes
  EXPECT_EQ(char_class(0x4E2D), kClsLetter);
  EXPECT_EQ(char_class(0x0301), kClsMark);
  EXPECT_EQ(char_class(0x00BD), kClsNumber);   // ½
  EXPECT_EQ(char_class(0x216B), kClsNumber);   // Ⅻ
  EXPECT_EQ(char_class(0x1F44B), 0);           // 👋 So
  EXPECT_EQ(char_class(0x1D400), kClsLetter);  // 𝐀 (outside the BMP table)
}

TEST(PythonStrip, StripsUnicodeWhitespace) {
  EXPECT_EQ(python_strip("  hi \n"), "hi");
  EXPECT_EQ(python_strip("\xE3\x80\x80hi\xC2\xA0"), "hi");  // U+3000, U+00A0
  EXPECT_EQ(python_strip("\x1Chi\x1F"), "hi");               // isspace() includes U+001C..U+001F
  EXPECT_EQ(python_strip("\xE2\x80\x8Bhi"), "\xE2\x80\x8Bhi");  // U+200B is not whitespace
  EXPECT_EQ(python_strip(" \xFF "), "\xFF");
  EXPECT_EQ(python_strip("   "), "");
  EXPECT_EQ(python_strip(""), "");
}

}  // namespace
}  // namespace dflash::text
