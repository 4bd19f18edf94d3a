// The ternary and 2-bit quantizers decide each code by comparisons (no libm call) wherever |x / d| <= 2.
// Their references round with lround / round (half away from zero). Random test vectors almost never
// land on a tie, so this test builds blocks that do: exact halves, the floats either side of them,
// zeros of both signs, and blocks with a NaN, an infinity or a subnormal maximum (whose inverse
// overflows), and compares every byte with the lround / round formulation written out here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "quant/types.h"

namespace dflash {
namespace {

float amax_of(const float* x, int n) {  // as the quantizers: a NaN is kept only where it comes last
  float m = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    m = m > a ? m : a;
  }
  return m;
}
int trit_lround(float x, float id) {
  const long v = std::lround(x * id) + 1;
  return v < 0 ? 0 : (v > 2 ? 2 : static_cast<int>(v));
}
void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// Base-3 packing as the PrismML / ggml references: digit n of byte m is value n * count + m.
void pack(const float* x, float id, int count, int digits, uint8_t* out) {
  for (int m = 0; m < count; ++m) {
    int v = 0;
    for (int n = 0; n < digits; ++n) v = v * 3 + trit_lround(x[n * count + m], id);
    if (digits == 4) v *= 3;
    out[m] = static_cast<uint8_t>((v * 256 + 242) / 243);
  }
}

// One block of each type, written with lround / round.
void ref_block(GgmlType t, const float* x, uint8_t* dst) {
  if (t == GgmlType::PTQ1_0 || t == GgmlType::TQ1_0) {
    const int n = t == GgmlType::PTQ1_0 ? 128 : 256;
    const float d = amax_of(x, n), id = d != 0.0f ? 1.0f / d : 0.0f;
    if (n == 128) {
      pack(x, id, 16, 5, dst), pack(x + 80, id, 8, 5, dst + 16), pack(x + 120, id, 2, 4, dst + 24);
      put_u16(dst + 26, fp32_to_fp16(d));
    } else {
      pack(x, id, 32, 5, dst), pack(x + 160, id, 16, 5, dst + 32), pack(x + 240, id, 4, 4, dst + 48);
      put_u16(dst + 52, fp32_to_fp16(d));
    }
  } else if (t == GgmlType::TQ2_0) {
    const float d = amax_of(x, 256), id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 64; j += 32)
      for (int m = 0; m < 32; ++m) {
        int q = 0;
        for (int l = 0; l < 4; ++l) q |= trit_lround(x[4 * j + 32 * l + m], id) << (2 * l);
        dst[j + m] = static_cast<uint8_t>(q);
      }
    put_u16(dst + 64, fp32_to_fp16(d));
  } else {  // Q2_0 (64) / PQ2_0 (128)
    const int n = t == GgmlType::Q2_0 ? 64 : 128;
    const float d = amax_of(x, n), id = d > 0.0f ? 1.0f / d : 0.0f;
    put_u16(dst, fp32_to_fp16(d));
    std::memset(dst + 2, 0, n / 4);
    for (int j = 0; j < n; ++j) {
      int q = static_cast<int>(std::round(x[j] * id)) + 1;
      q = q < 0 ? 0 : (q > 3 ? 3 : q);
      dst[2 + j / 4] |= static_cast<uint8_t>(q << (2 * (j % 4)));
    }
  }
}

// Rows of 256 values (every block size divides it) that hit the rounding's edges.
std::vector<std::vector<float>> edge_rows() {
  const float half = 0.5f, below = std::nextafter(0.5f, 0.0f), above = std::nextafter(0.5f, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> rows;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(0, 9);
  for (float d : {1.0f, 4.0f, 0.0625f, 3.0f, 1e-3f}) {  // powers of two make x / d exact; others round
    std::vector<float> r(256);
    // |x| <= d, so each block's maximum is d and x / d hits the halves exactly (d a power of two)
    const float cand[10] = {half, -half, below, -below, above, -above, 1.0f, -1.0f, 0.0f, -0.0f};
    for (int i = 0; i < 256; ++i) r[i] = d * cand[pick(rng)];
    for (int b = 0; b < 256; b += 64) r[b + (b / 64) % 7] = (b & 64) ? -d : d;  // each 64-block's max is +-d
    rows.push_back(r);
  }
  // Non-finite values and a subnormal maximum (1 / d overflows to infinity): the slow path.
  std::vector<float> r(256, 0.25f);
  r[3] = nan, r[70] = inf, r[140] = -inf, r[200] = nan, r[201] = 1.0f;
  rows.push_back(r);
  std::vector<float> tiny(256);
  for (int i = 0; i < 256; ++i) tiny[i] = (i % 3 - 1) * 1e-40f;
  rows.push_back(tiny);
  rows.push_back(std::vector<float>(256, 0.0f));
  return rows;
}

class TieRounding : public ::testing::TestWithParam<GgmlType> {};

TEST_P(TieRounding, MatchesTheLroundFormulation) {
  const GgmlType t = GetParam();
  const TypeTraits& tt = type_traits(t);
  const int64_t n = 256;
  const size_t rb = row_bytes(t, n);
  int row_index = 0;
  for (const std::vector<float>& row : edge_rows()) {
    std::vector<uint8_t> ours(rb), want(rb);
    quantize_row(t, row.data(), ours.data(), n);
    for (int64_t b = 0; b < n / tt.block_elems; ++b)
      ref_block(t, row.data() + b * tt.block_elems, want.data() + b * tt.block_bytes);
    for (size_t i = 0; i < rb; ++i)
      ASSERT_EQ(int(ours[i]), int(want[i])) << tt.name << " edge row " << row_index << ", byte " << i << " (block "
                                             << i / tt.block_bytes << ")";
    ++row_index;
  }
}

INSTANTIATE_TEST_SUITE_P(TernaryAnd2Bit, TieRounding,
                         ::testing::Values(GgmlType::PTQ1_0, GgmlType::TQ1_0, GgmlType::TQ2_0, GgmlType::Q2_0,
                                           GgmlType::PQ2_0),
                         [](const ::testing::TestParamInfo<GgmlType>& info) {
                           return std::string(type_name(info.param));
                         });

}  // namespace
}  // namespace dflash
