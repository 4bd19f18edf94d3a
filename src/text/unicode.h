// Unicode helpers for the text layer: strict UTF-8 decoding, the character classes the Qwen
// pre-tokenizers need (from utf8proc's general categories), GPT-2's byte <-> unicode map, and
// UTF-8 repair for text that leaves the engine (streams, JSON).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::text {

// ---------------------------------------------------------------------------------------------
// UTF-8

// Decodes one code point at s[i]. Strict (RFC 3629): no overlongs, no surrogates, nothing above
// U+10FFFF. Returns the sequence length (1..4) and sets `cp`; returns 0 when the bytes at s[i] do
// not start a valid, complete sequence (then `cp` is untouched).
size_t utf8_decode(std::string_view s, size_t i, uint32_t& cp);

// Appends the UTF-8 encoding of `cp` (must be a valid scalar value).
void utf8_append(std::string& out, uint32_t cp);

// How many bytes at the end of `s` form the start of a sequence that is valid so far but
// incomplete (0..3). Used by the streaming decoder to hold back half a character.
size_t utf8_incomplete_tail(std::string_view s);

// Replaces invalid UTF-8 with U+FFFD, one per maximal invalid subpart (the Unicode / WHATWG
// practice, as Rust's String::from_utf8_lossy and Python's errors="replace" do).
std::string utf8_sanitize(std::string_view s);
bool utf8_is_valid(std::string_view s);

// ---------------------------------------------------------------------------------------------
// Character classes (bit flags) as the pre-tokenizer regexes see them.
enum CharClass : uint8_t {
  kClsSpace = 1 << 0,   // regex \s (Oniguruma's Unicode \s): \t\n\v\f\r, U+0085, Zs, Zl, Zp
  kClsLetter = 1 << 1,  // \p{L}: Lu Ll Lt Lm Lo
  kClsNumber = 1 << 2,  // \p{N}: Nd Nl No
  kClsMark = 1 << 3,    // \p{M}: Mn Mc Me
  kClsCrLf = 1 << 4,    // \r or \n (also kClsSpace)
};
// Class bits of a code point (0 for punctuation, symbols, controls, unassigned...).
uint8_t char_class(uint32_t cp);

// Python's str.isspace() (what Jinja's |trim strips): the set differs from \s by U+001C..U+001F.
bool is_python_space(uint32_t cp);
// Python str.strip() with no argument, on UTF-8 text (invalid bytes are never stripped).
std::string_view python_strip(std::string_view s);

// The Unicode version of the category tables in use (utf8proc's).
const char* unicode_version();

// ---------------------------------------------------------------------------------------------
// GPT-2 byte-level BPE alphabet: every byte maps to one printable code point (bytes that are
// printable Latin-1 map to themselves, the other 68 to U+0100.. in order), so a byte string becomes
// a string of visible characters ("Ġ" = space, "Ċ" = newline).
uint32_t byte_to_unicode(uint8_t b);
// Inverse map; returns -1 for code points that are not in the alphabet.
int byte_from_unicode(uint32_t cp);

}  // namespace dflash::text
