// Type table and scalar conversions. The per-type codecs live in quant/codecs*.cpp.
#include "quant/types.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>

#include "util/error.h"

namespace dflash {
namespace {

constexpr std::array<TypeTraits, 19> kTraits = {{
    {GgmlType::F32, "f32", 1, 4, true},
    {GgmlType::F16, "f16", 1, 2, true},
    {GgmlType::Q4_0, "q4_0", 32, 18, true},
    {GgmlType::Q8_0, "q8_0", 32, 34, true},
    {GgmlType::Q4_K, "q4_k", 256, 144, true},
    {GgmlType::Q5_K, "q5_k", 256, 176, true},
    {GgmlType::Q6_K, "q6_k", 256, 210, true},
    {GgmlType::I8, "i8", 1, 1, false},
    {GgmlType::I16, "i16", 1, 2, false},
    {GgmlType::I32, "i32", 1, 4, false},
    {GgmlType::I64, "i64", 1, 8, false},
    {GgmlType::F64, "f64", 1, 8, false},
    {GgmlType::BF16, "bf16", 1, 2, true},
    {GgmlType::TQ1_0, "tq1_0", 256, 54, true},
    {GgmlType::TQ2_0, "tq2_0", 256, 66, true},
    {GgmlType::Q1_0, "q1_0", 128, 18, true},
    {GgmlType::Q2_0, "q2_0", 64, 18, true},
    {GgmlType::PQ2_0, "pq2_0", 128, 34, true},
    {GgmlType::PTQ1_0, "ptq1_0", 128, 28, true},
}};

}  // namespace

const TypeTraits* type_traits(uint32_t id) {
  for (const auto& t : kTraits)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const TypeTraits& type_traits(GgmlType type) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  DFLASH_CHECK(t != nullptr, "unknown ggml type id {}", static_cast<uint32_t>(type));
  return *t;
}

std::optional<GgmlType> type_from_name(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const auto& t : kTraits)
    if (lower == t.name) return t.type;
  return std::nullopt;
}

const char* type_name(GgmlType type) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  return t ? t->name : "unknown";
}

size_t row_bytes(GgmlType type, int64_t n) {
  const TypeTraits& t = type_traits(type);
  DFLASH_CHECK(n >= 0 && n % t.block_elems == 0, "row of {} elements is not a multiple of the {} block size {}", n,
               t.name, t.block_elems);
  return static_cast<size_t>(n / t.block_elems) * static_cast<size_t>(t.block_bytes);
}

// ---- scalar conversions --------------------------------------------------------------------

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while ((mant & 0x400) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {  // inf, or NaN made quiet (as F16C's vcvtph2ps does) with its payload kept
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t absx = x & 0x7fffffff;
  if (absx > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((absx >> 13) & 0x3ff));  // NaN, keep quiet
  if (absx >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds to >= 65520 -> inf
  if (absx < 0x38800000) {                                   // result is subnormal or zero
    // value = absx as float; subnormal unit is 2^-24. Round to nearest even on the shifted mantissa.
    const uint32_t e = absx >> 23;
    if (e < 102) return (uint16_t)sign;  // < 2^-25: rounds to zero
    const uint32_t mant = (absx & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14..24
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
    return (uint16_t)(sign | r);
  }
  // normal: rebias exponent, round mantissa to 10 bits (nearest even); carry may bump the exponent
  uint32_t r = absx - ((127u - 15u) << 23);
  r = r + 0xfff + ((r >> 13) & 1);
  return (uint16_t)(sign | (r >> 13));
}

float bf16_to_fp32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t fp32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 64);  // quiet NaN, as ggml does
  return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

}  // namespace dflash
