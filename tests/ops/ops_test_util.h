// Helpers for the op tests: random data, moving host vectors through a backend, tolerant and exact
// comparisons. References in the tests are straightforward double-precision loops.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace dflash::test {

inline std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <typename T>
DeviceArray<T> to_dev(Backend& be, const std::vector<T>& host) {
  DeviceArray<T> a(be, host.size());
  be.upload(a.get(), host.data(), host.size() * sizeof(T));
  return a;
}

template <typename T>
std::vector<T> from_dev(Backend& be, const DeviceArray<T>& a) {
  std::vector<T> host(a.size());
  be.download(host.data(), a.get(), a.bytes());
  be.synchronize();
  return host;
}

// Checks |got - ref| <= atol + rtol * |ref| everywhere; NaN or Inf in `got` fails. Returns max abs error.
inline double expect_close(const std::vector<float>& got, const std::vector<double>& ref, double atol, double rtol,
                           const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  double max_err = 0.0;
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!std::isfinite(got[i]) || !(err <= atol + rtol * std::fabs(ref[i]))) {
      if (bad++ == 0) first_bad = i;
    }
    if (std::isfinite(err)) max_err = std::max(max_err, err);
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements out of tolerance; first at " << first_bad << " got "
                     << got[first_bad] << " ref " << ref[first_bad] << " (max abs err " << max_err << ")";
  return max_err;
}

inline double expect_close(const std::vector<float>& got, const std::vector<float>& ref, double atol, double rtol,
                           const std::string& what) {
  return expect_close(got, std::vector<double>(ref.begin(), ref.end()), atol, rtol, what);
}

// Bit-exact comparison of two float ranges.
inline bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

}  // namespace dflash::test
