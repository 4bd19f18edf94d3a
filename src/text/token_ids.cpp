#include "text/token_ids.h"

#include <string>

#include "util/error.h"

namespace dflash {

std::vector<int32_t> parse_token_ids(std::string_view text, std::string_view what) {
  const auto is_separator = [](char c) {
    return c == ',' || c == '[' || c == ']' || c == ' ' || c == '\t' || c == '\n' || c == '\r';
  };
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    if (is_separator(text[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !is_separator(text[j])) ++j;
    const std::string_view item = text.substr(i, j - i);
    int64_t v = 0;
    for (const char c : item) {
      if (c < '0' || c > '9') fail("{}: '{}' is not a token id (expected a number from 0 to {})", what, item, INT32_MAX);
      v = v * 10 + (c - '0');
      if (v > INT32_MAX) fail("{}: token id '{}' is too large (at most {})", what, item, INT32_MAX);
    }
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

}  // namespace dflash
