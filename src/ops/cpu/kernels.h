// Scalar helpers shared by the CPU ops. Every reduction here has a fixed order that depends only on
// its length, never on how many rows an op processes or on the thread count (SPEC 5.5).
#pragma once

#include <cmath>
#include <cstdint>

namespace dflash::cpu {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Eight interleaved partial sums (lane i takes elements i, i+8, ...), combined pairwise at the end.
// The fixed lane structure lets the compiler vectorise without changing the result.
constexpr int kLanes = 8;

inline float combine_lanes(const float (&acc)[kLanes]) {
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return combine_lanes(acc);
}

inline float sum_sq_f32(const float* a, int64_t n) { return dot_f32(a, a, n); }

}  // namespace dflash::cpu
