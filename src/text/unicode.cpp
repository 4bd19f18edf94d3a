#include "text/unicode.h"

#include <utf8proc.h>

#include <array>
#include <memory>

namespace dflash::text {

// =============================================================================================
// UTF-8

namespace {

// Walks the sequence starting at s[i] against the RFC 3629 byte ranges. Returns how many bytes
// match (the lead included; 0 when s[i] cannot lead) and sets `need` to the full length.
size_t utf8_prefix(std::string_view s, size_t i, size_t& need) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 < 0x80) { need = 1; return 1; }
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 2;
  else if (b0 >= 0xE0 && b0 <= 0xEF) { need = 3; if (b0 == 0xE0) lo = 0xA0; if (b0 == 0xED) hi = 0x9F; }
  else if (b0 >= 0xF0 && b0 <= 0xF4) { need = 4; if (b0 == 0xF0) lo = 0x90; if (b0 == 0xF4) hi = 0x8F; }
  else { need = 1; return 0; }
  size_t k = 1;
  while (k < need && i + k < s.size()) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
    ++k;
  }
  return k;
}

}  // namespace

size_t utf8_decode(std::string_view s, size_t i, uint32_t& cp) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) { cp = b0; return 1; }
  size_t need = 0;
  const size_t k = utf8_prefix(s, i, need);
  if (k != need) return 0;
  uint32_t v = need == 2 ? (b0 & 0x1F) : need == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t j = 1; j < need; ++j) v = (v << 6) | (static_cast<uint8_t>(s[i + j]) & 0x3F);
  cp = v;
  return need;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t utf8_incomplete_tail(std::string_view s) {
  // A sequence is at most 4 bytes, so an incomplete one starts within the last 3.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t i = n - back;
    const auto b = static_cast<uint8_t>(s[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: look further back
    size_t need = 0;
    const size_t k = utf8_prefix(s, i, need);
    return (k == back && k < need) ? back : 0;
  }
  return 0;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t need = 0;
    const size_t k = utf8_prefix(s, i, need);
    if (k == need) {
      out.append(s.substr(i, k));
      i += k;
    } else {
      out.append("\xEF\xBF\xBD");
      i += k == 0 ? 1 : k;
    }
  }
  return out;
}

bool utf8_is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t need = 0;
    if (utf8_prefix(s, i, need) != need) return false;
    i += need;
  }
  return true;
}

// =============================================================================================
// Character classes

namespace {

uint8_t compute_class(uint32_t cp) {
  if (cp == '\r' || cp == '\n') return kClsSpace | kClsCrLf;
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return kClsSpace;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO:
      return kClsLetter;
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return kClsNumber;
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
      return kClsMark;
    case UTF8PROC_CATEGORY_ZS: case UTF8PROC_CATEGORY_ZL: case UTF8PROC_CATEGORY_ZP:
      return kClsSpace;
    default:
      return 0;
  }
}

// The BMP's classes in one 64 KiB table, built once (utf8proc's lookup is two table reads plus a
// call; the scanner asks for every character).
const std::array<uint8_t, 0x10000>& bmp_classes() {
  // Never destroyed: threads still tokenizing while the process exits may read it.
  static const std::array<uint8_t, 0x10000>* const table = [] {
    auto* t = new std::array<uint8_t, 0x10000>();
    for (uint32_t cp = 0; cp < 0x10000; ++cp) (*t)[cp] = compute_class(cp);
    return t;
  }();
  return *table;
}

}  // namespace

uint8_t char_class(uint32_t cp) {
  if (cp < 0x10000) return bmp_classes()[cp];
  return compute_class(cp);
}

bool is_python_space(uint32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85) return true;
  if (cp < 0xA0) return false;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

std::string_view python_strip(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e) {
    uint32_t cp = 0;
    const size_t len = utf8_decode(s, b, cp);
    if (len == 0 || !is_python_space(cp)) break;
    b += len;
  }
  while (e > b) {
    // Step back to the start of the last character.
    size_t start = e - 1;
    while (start > b && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80 && e - start < 4) --start;
    uint32_t cp = 0;
    const size_t len = utf8_decode(s, start, cp);
    if (len == 0 || start + len != e || !is_python_space(cp)) break;
    e = start;
  }
  return s.substr(b, e - b);
}

const char* unicode_version() { return utf8proc_unicode_version(); }

// =============================================================================================
// GPT-2 byte map

namespace {

struct ByteMap {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 512> from_cp{};  // every mapped code point is < 0x144
  ByteMap() {
    from_cp.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      from_cp[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

}  // namespace

uint32_t byte_to_unicode(uint8_t b) { return byte_map().to_cp[b]; }

int byte_from_unicode(uint32_t cp) { return cp < 512 ? byte_map().from_cp[cp] : -1; }

}  // namespace dflash::text
