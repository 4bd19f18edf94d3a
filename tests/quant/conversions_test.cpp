// fp16 / bf16 scalar conversions, checked exhaustively over all 65536 16-bit patterns against
// references computed another way: the value from its fields with ldexp (decode), and the exact
// midpoints between neighbouring representable values (encode: ties to even, one ulp either side),
// plus the compiler's _Float16 and the CPU's F16C instructions where available.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "quant/types.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dflash {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Value of a finite half from its fields: (-1)^s * m * 2^(e-25) with the implicit bit, or m * 2^-24.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}
double bf16_value(uint16_t h) {
  const int e = (h >> 7) & 0xff;
  const int m = h & 0x7f;
  const double mag = e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
  return (h & 0x8000) ? -mag : mag;
}

TEST(Fp16, DecodeAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = fp16_to_fp32(h);
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const bool neg = (h & 0x8000) != 0;
    if (e == 31 && m != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      // Quiet NaN with the payload kept in the top mantissa bits and the sign kept.
      ASSERT_EQ(bits_of(f), (neg ? 0x80000000u : 0u) | 0x7fc00000u | (uint32_t(m) << 13)) << std::hex << h;
    } else if (e == 31) {
      ASSERT_TRUE(std::isinf(f) && std::signbit(f) == neg) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(h)) << std::hex << h;
      ASSERT_EQ(std::signbit(f), neg) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(Fp16, EncodeRoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t a = 0; a < 0x7c00; ++a) {  // every finite non-negative half
      const uint16_t h = static_cast<uint16_t>(sign | a);
      const float v = fp16_to_fp32(h);
      ASSERT_EQ(fp32_to_fp16(v), h) << std::hex << h;  // representable values round-trip
      // The next magnitude up; above 65504 it is 65536, which overflows to inf.
      const double next = a + 1 == 0x7c00 ? 65536.0 : std::fabs(half_value(static_cast<uint16_t>(a + 1)));
      const double mid_d = (std::fabs(half_value(h)) + next) / 2;
      const float mid = static_cast<float>(sign ? -mid_d : mid_d);
      ASSERT_EQ(static_cast<double>(std::fabs(mid)), mid_d);  // midpoints are exact floats
      const uint16_t up = static_cast<uint16_t>(sign | (a + 1));
      const uint16_t even = (a & 1) ? up : h;
      ASSERT_EQ(fp32_to_fp16(mid), even) << "midpoint above " << std::hex << h;
      ASSERT_EQ(fp32_to_fp16(std::nextafter(mid, 0.0f)), h) << "just below midpoint above " << std::hex << h;
      const float beyond = std::nextafter(mid, sign ? -INFINITY : INFINITY);
      ASSERT_EQ(fp32_to_fp16(beyond), up) << "just above midpoint above " << std::hex << h;
    }
  }
}

TEST(Fp16, EncodeSpecials) {
  EXPECT_EQ(fp32_to_fp16(0.0f), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_fp16(INFINITY), 0x7c00);
  EXPECT_EQ(fp32_to_fp16(-INFINITY), 0xfc00);
  EXPECT_EQ(fp32_to_fp16(1e10f), 0x7c00);
  EXPECT_EQ(fp32_to_fp16(-65520.0f), 0xfc00);
  EXPECT_EQ(fp32_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16(1e-10f), 0x0000);                  // far below the smallest subnormal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25)), 0x0000);   // tie between 0 and 2^-24 -> even (0)
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -14)), 0x0400);   // smallest normal
  // NaN stays NaN (quiet), sign and top payload bits kept.
  const uint16_t qn = fp32_to_fp16(std::nanf(""));
  EXPECT_EQ(qn & 0x7c00, 0x7c00);
  EXPECT_NE(qn & 0x03ff, 0);
  EXPECT_EQ(fp32_to_fp16(float_of(0xff800001u)) & 0xfe00, 0xfe00);  // signalling, negative -> quiet, negative
  EXPECT_EQ(fp32_to_fp16(float_of(0x7fa00000u)), 0x7f00 | 0x0100);  // payload bit 21 -> half bit 8, quiet bit set
}

#if defined(__FLT16_MAX__)
// The compiler's own float -> _Float16 conversion (IEEE, ties to even) on a sweep of float patterns.
TEST(Fp16, EncodeMatchesCompilerFloat16) {
  std::mt19937 rng(1234);
  for (uint64_t u = 0; u < (1ull << 32); u += 4099 + (rng() & 1023)) {
    const float f = float_of(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    const _Float16 g = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &g, 2);
    ASSERT_EQ(fp32_to_fp16(f), want) << std::hex << u;
  }
}
#endif

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// The CPU's F16C conversions agree bit for bit, NaNs included (the AVX2 kernels use them).
TEST(Fp16, MatchesF16CHardware) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C";
  for (uint32_t i = 0; i < 65536; ++i)
    ASSERT_EQ(bits_of(fp16_to_fp32(static_cast<uint16_t>(i))), bits_of(hw_f16_to_f32(static_cast<uint16_t>(i))))
        << std::hex << i;
  std::mt19937 rng(99);
  for (uint64_t u = 0; u < (1ull << 32); u += 8191 + (rng() & 4095)) {
    const float f = float_of(static_cast<uint32_t>(u));
    ASSERT_EQ(fp32_to_fp16(f), hw_f32_to_f16(f)) << std::hex << u;
  }
}
#endif

TEST(Bf16, DecodeAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = bf16_to_fp32(h);
    const int e = (h >> 7) & 0xff, m = h & 0x7f;
    if (e == 255 && m != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(bits_of(f), uint32_t(h) << 16);  // bf16 is the top half of a float: bits kept
    } else if (e == 255) {
      ASSERT_TRUE(std::isinf(f));
    } else {
      ASSERT_EQ(static_cast<double>(f), bf16_value(h)) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0);
    }
  }
}

TEST(Bf16, EncodeRoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t a = 0; a < 0x7f80; ++a) {
      const uint16_t h = static_cast<uint16_t>(sign | a);
      ASSERT_EQ(fp32_to_bf16(bf16_to_fp32(h)), h) << std::hex << h;
      // Midpoint to the next magnitude (2^128 past the largest finite: overflows to inf).
      const double next = a + 1 == 0x7f80 ? std::ldexp(1.0, 128) : std::fabs(bf16_value(static_cast<uint16_t>(a + 1)));
      const double mid_d = (std::fabs(bf16_value(h)) + next) / 2;
      const uint16_t up = static_cast<uint16_t>(sign | (a + 1));
      const uint16_t even = (a & 1) ? up : h;
      const float mid = static_cast<float>(sign ? -mid_d : mid_d);
      ASSERT_EQ(static_cast<double>(std::fabs(mid)), mid_d);
      ASSERT_EQ(fp32_to_bf16(mid), even) << std::hex << h;
      ASSERT_EQ(fp32_to_bf16(std::nextafter(mid, 0.0f)), h) << std::hex << h;
      ASSERT_EQ(fp32_to_bf16(std::nextafter(mid, sign ? -INFINITY : INFINITY)), up) << std::hex << h;
    }
  }
}

TEST(Bf16, EncodeSpecials) {
  EXPECT_EQ(fp32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(fp32_to_bf16(-INFINITY), 0xff80);
  EXPECT_EQ(fp32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_bf16(float_of(0x00000001u)), 0x0000);  // smallest subnormal rounds to 0
  EXPECT_EQ(fp32_to_bf16(float_of(0x00018000u)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(fp32_to_bf16(float_of(0x7f800001u)), 0x7fc0);  // signalling NaN -> quiet NaN
  EXPECT_EQ(fp32_to_bf16(float_of(0xffc12345u)), 0xffc1);
}

}  // namespace
}  // namespace dflash
