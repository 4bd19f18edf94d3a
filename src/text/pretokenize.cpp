#include "text/pretokenize.h"

#include "text/unicode.h"

namespace dflash::text {

const char* pre_tokenizer_name(PreTokenizer p) {
  switch (p) {
    case PreTokenizer::Qwen2: return "qwen2";
    case PreTokenizer::Qwen35: return "qwen35";
  }
  return "?";
}

namespace {

constexpr uint8_t kClsInvalid = 1 << 7;  // a byte that is not valid UTF-8: always its own piece

struct Char {
  uint32_t cp;   // code point (the byte value for kClsInvalid)
  uint32_t off;  // byte offset of the character in the fragment
  uint8_t cls;
};

bool is_contraction_letter(uint32_t cp, char lower) {
  // (?i:...) compares case-insensitively; under Unicode simple case folding U+017F (long s) is 's'.
  return cp == static_cast<uint32_t>(lower) || cp == static_cast<uint32_t>(lower - 'a' + 'A') ||
         (lower == 's' && cp == 0x17F);
}

// One pass of the alternation at character i (leftmost-first, as the regex engine tries it);
// returns the end of the match. Every character is matched by some alternative, so the result is
// always > i.
size_t match_at(const std::vector<Char>& c, size_t i, bool marks_are_letters) {
  const size_t n = c.size();
  const uint8_t letter = marks_are_letters ? (kClsLetter | kClsMark) : kClsLetter;
  // [^\s\p{L}\p{N}] (qwen35: also not \p{M}), and never an invalid byte.
  const uint8_t not_punct = kClsSpace | kClsLetter | kClsNumber | kClsInvalid | (marks_are_letters ? kClsMark : 0);
  auto is_letter = [&](size_t k) { return k < n && (c[k].cls & letter) != 0; };
  auto is_punct = [&](size_t k) { return k < n && (c[k].cls & not_punct) == 0; };

  const uint8_t cls = c[i].cls;
  if (cls & kClsInvalid) return i + 1;

  // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (c[i].cp == '\'' && i + 1 < n) {
    const uint32_t a = c[i + 1].cp;
    if (is_contraction_letter(a, 's') || is_contraction_letter(a, 't') || is_contraction_letter(a, 'm') ||
        is_contraction_letter(a, 'd')) {
      return i + 2;
    }
    if (i + 2 < n) {
      const uint32_t b = c[i + 2].cp;
      if ((is_contraction_letter(a, 'r') && is_contraction_letter(b, 'e')) ||
          (is_contraction_letter(a, 'v') && is_contraction_letter(b, 'e')) ||
          (is_contraction_letter(a, 'l') && is_contraction_letter(b, 'l'))) {
        return i + 3;
      }
    }
  }

  // 2. [^\r\n\p{L}\p{N}]?\p{L}+   (qwen35: [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+)
  // The optional prefix is greedy: a non-CR/LF, non-letter, non-number character directly before a
  // letter run joins it (" word", "\tword", "(word"; in qwen35 a mark can be the prefix, too).
  {
    size_t j = i;
    const bool prefix_ok = (cls & (kClsCrLf | kClsLetter | kClsNumber)) == 0;
    if (prefix_ok && is_letter(i + 1)) j = i + 1;
    if (is_letter(j)) {
      while (is_letter(j)) ++j;
      return j;
    }
  }

  // 3. \p{N}: one digit at a time.
  if (cls & kClsNumber) return i + 1;

  // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  {
    size_t j = i;
    if (c[i].cp == ' ' && is_punct(i + 1)) j = i + 1;
    if (is_punct(j)) {
      while (is_punct(j)) ++j;
      while (j < n && (c[j].cls & kClsCrLf)) ++j;
      return j;
    }
  }

  // 5-7. Whitespace. Let [i, e) be the whitespace run at i.
  //   \s*[\r\n]+  : when the run holds a CR/LF, up to and including its last CR/LF;
  //   \s+(?!\S)   : else the run, minus its last character when a non-space follows it;
  //   \s+         : else (a single space before a non-space) that one character.
  size_t e = i;
  size_t last_crlf = SIZE_MAX;
  while (e < n && (c[e].cls & kClsSpace)) {
    if (c[e].cls & kClsCrLf) last_crlf = e;
    ++e;
  }
  if (e == i) return i + 1;  // unreachable: every class is handled above
  if (last_crlf != SIZE_MAX) return last_crlf + 1;
  if (e == n) return e;
  if (e - i >= 2) return e - 1;
  return e;
}

void scan(std::string_view text, bool marks_are_letters, std::vector<std::pair<uint32_t, uint32_t>>& out) {
  // The decoded fragment, reused across calls on one thread (fragments are split per call).
  thread_local std::vector<Char> chars;
  chars.clear();
  chars.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<uint8_t>(text[i]);
    if (b < 0x80) {
      chars.push_back({b, static_cast<uint32_t>(i), char_class(b)});
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t len = utf8_decode(text, i, cp);
    if (len == 0) {
      chars.push_back({b, static_cast<uint32_t>(i), kClsInvalid});
      ++i;
    } else {
      chars.push_back({cp, static_cast<uint32_t>(i), char_class(cp)});
      i += len;
    }
  }
  const size_t n = chars.size();
  size_t k = 0;
  while (k < n) {
    const size_t e = match_at(chars, k, marks_are_letters);
    const uint32_t begin = chars[k].off;
    const uint32_t end = e < n ? chars[e].off : static_cast<uint32_t>(text.size());
    out.emplace_back(begin, end);
    k = e;
  }
}

}  // namespace

void pre_tokenize(std::string_view text, PreTokenizer kind, std::vector<std::pair<uint32_t, uint32_t>>& out) {
  scan(text, kind == PreTokenizer::Qwen35, out);
}

std::vector<std::string_view> pre_tokenize(std::string_view text, PreTokenizer kind) {
  std::vector<std::pair<uint32_t, uint32_t>> spans;
  pre_tokenize(text, kind, spans);
  std::vector<std::string_view> pieces;
  pieces.reserve(spans.size());
  for (auto [b, e] : spans) pieces.push_back(text.substr(b, e - b));
  return pieces;
}

}  // namespace dflash::text
