// Small block-layout helpers shared by the quant kernels and quantizers (SPEC 1.1).
//
// Everything here has internal linkage (unnamed namespace): this header is included by files compiled
// with -mavx2, and an external inline definition could be picked by the linker for the portable path.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant/types.h"

namespace dflash::quant_detail {
namespace {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);  // blocks are little-endian, like every machine we run on
  return v;
}
inline void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline float load_half(const uint8_t* p) { return fp16_to_fp32(load_u16(p)); }

// Sub-block scale and min j (0..7) of a Q4_K/Q5_K block: 6 bits each, packed into scales[12].
struct KScaleMin {
  uint8_t scale;
  uint8_t min;
};
inline KScaleMin k_scale_min(const uint8_t* s, int j) {
  if (j < 4) return {static_cast<uint8_t>(s[j] & 63), static_cast<uint8_t>(s[j + 4] & 63)};
  return {static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)),
          static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4))};
}

// Trit n (0 = most significant) of a base-3 byte as stored by TQ1_0/PTQ1_0: the byte is a fixed-point
// fraction q/256 ~ v/243, so multiplying by 3^n (mod 256) drops the leading digits and *3 >> 8 reads
// the next one. Returns 0, 1 or 2 (value = trit - 1).
constexpr uint8_t kPow3[6] = {1, 3, 9, 27, 81, 243};
inline int base3_trit(uint8_t b, int n) {
  const uint8_t shifted = static_cast<uint8_t>(b * kPow3[n]);
  return (static_cast<uint16_t>(shifted) * 3) >> 8;
}

}  // namespace
}  // namespace dflash::quant_detail
