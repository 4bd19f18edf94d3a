// round_to_xq_planes: the CUDA integer matmuls' activation rounding emulated on the CPU
// (src/quant/xq_emulation.h). Hand-worked values at 1, 2 and 3 planes (the step, half-to-even ties, the
// 1-plane clamp), the error bound against the block's largest |x| on random blocks, and the pass-through
// and error cases.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "quant/xq_emulation.h"
#include "util/error.h"

namespace dflash {
namespace {

// A block whose largest |x| is 63 (frexp exponent 6, so E = 0): the step is 2^-8 at 2 planes, 2^-16 at 3.
std::vector<float> block_max63(float a, float b) {
  std::vector<float> x(128, 0.0f);
  x[0] = 63.0f;
  x[1] = a;
  x[2] = b;
  return x;
}

TEST(XqEmulation, TwoPlanesStepAndTies) {
  auto x = block_max63(0.3f, 0.001953125f);  // 0.3 * 256 = 76.8 -> 77; 2^-9 is half a step: ties to 0 (even)
  x[3] = 3.0f * 0.001953125f;                // 1.5 steps -> 2 steps (even)
  x[4] = -0.3f;
  std::vector<float> y(128);
  round_to_xq_planes(x.data(), y.data(), 128, 2);
  EXPECT_EQ(y[0], 63.0f);
  EXPECT_EQ(y[1], 77.0f / 256.0f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 2.0f / 256.0f);
  EXPECT_EQ(y[4], -77.0f / 256.0f);
}

TEST(XqEmulation, ThreePlanesStep) {
  auto x = block_max63(0.3f, 0.0f);  // 0.3 * 65536 = 19660.8 -> 19661
  std::vector<float> y(128);
  round_to_xq_planes(x.data(), y.data(), 128, 3);
  EXPECT_EQ(y[1], 19661.0f / 65536.0f);
}

TEST(XqEmulation, OnePlaneWhatIf) {  // step 2^-1 for a largest |x| of 63; 63.9 * 2 = 127.8 -> 128, clamped to 127
  auto x = block_max63(0.3f, 0.25f);  // 0.6 -> 1; 0.5 is a tie -> 0
  std::vector<float> y(128);
  round_to_xq_planes(x.data(), y.data(), 128, 1);
  EXPECT_EQ(y[0], 63.0f);
  EXPECT_EQ(y[1], 0.5f);
  EXPECT_EQ(y[2], 0.0f);
  x[0] = -63.9f;
  round_to_xq_planes(x.data(), y.data(), 128, 1);
  EXPECT_EQ(y[0], -63.5f);
}

TEST(XqEmulation, ErrorWithinTheBlockBound) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int planes : {1, 2, 3}) {
    std::vector<float> x(128 * 64), y(x.size()), z(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * std::ldexp(1.0f, static_cast<int>(i / 128) % 20 - 10);
    round_to_xq_planes(x.data(), y.data(), static_cast<int64_t>(x.size()), planes);
    int changed = 0;
    for (size_t b = 0; b < x.size(); b += 128) {
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));
      // half a step <= this (1 plane: a whole step, where the clamp to 127 moves the largest values)
      const float bound = std::ldexp(amax, planes == 1 ? -6 : planes == 2 ? -14 : -22);
      for (int i = 0; i < 128; ++i) {
        EXPECT_LE(std::fabs(y[b + i] - x[b + i]), bound) << planes << " planes, block " << b / 128 << ", " << i;
        changed += y[b + i] != x[b + i];
      }
    }
    EXPECT_GT(changed, 0) << planes << " planes: nothing was rounded";
    round_to_xq_planes(y.data(), z.data(), static_cast<int64_t>(y.size()), planes);
    EXPECT_EQ(z, y) << planes << " planes: rounding a rounded block changed it";
  }
}

TEST(XqEmulation, ZeroBlocksPassAndBadInputsThrow) {
  std::vector<float> x(256, 0.0f), y(256, 1.0f);
  x[130] = 5.0f;
  round_to_xq_planes(x.data(), y.data(), 256, 2);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(y[i], 0.0f);
  EXPECT_EQ(y[130], 5.0f);  // 5 = 80 steps of 2^-4: on the grid
  EXPECT_THROW(round_to_xq_planes(x.data(), y.data(), 100, 2), Error);
  EXPECT_THROW(round_to_xq_planes(x.data(), y.data(), 128, 4), Error);
  EXPECT_THROW(round_to_xq_planes(x.data(), y.data(), 128, 0), Error);
}

}  // namespace
}  // namespace dflash
