// Helpers shared by the GGUF tests: building small valid images and patching them byte-wise.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf.h"
#include "util/error.h"

namespace dflash::gguf::test {

using Bytes = std::vector<uint8_t>;

// Position of the first occurrence of `needle` in `b` (fails the test when absent).
inline size_t find_bytes(const Bytes& b, std::string_view needle) {
  for (size_t i = 0; i + needle.size() <= b.size(); ++i)
    if (std::memcmp(b.data() + i, needle.data(), needle.size()) == 0) return i;
  ADD_FAILURE() << "'" << needle << "' not found in the image";
  return 0;
}

// Offset of the u64 length prefix of the GGUF string `s` (key or tensor name) in the image.
inline size_t string_at(const Bytes& b, std::string_view s) { return find_bytes(b, s) - 8; }
// Offset just past the GGUF string `s`.
inline size_t after_string(const Bytes& b, std::string_view s) { return find_bytes(b, s) + s.size(); }

template <typename T>
void poke(Bytes& b, size_t at, T v) {
  ASSERT_LE(at + sizeof(T), b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}
template <typename T>
T peek(const Bytes& b, size_t at) {
  T v{};
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}

// Parses `b` and returns the error message (empty when it parsed).
inline std::string parse_error(Bytes b, std::string name = "broken.gguf") {
  try {
    File::from_bytes(std::move(b), std::move(name));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : v) {
    x ^= x << 13; x ^= x >> 17; x ^= x << 5;
    c = static_cast<uint8_t>(x);
  }
  return v;
}

}  // namespace dflash::gguf::test
