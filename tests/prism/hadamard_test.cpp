// prism host Hadamard: the explicit matrix, H H = I, and the converter's weight-rotation identity.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <numeric>
#include <random>

#include "prism/hadamard.h"
#include "prism/rotation.h"
#include "util/error.h"

namespace dflash::prism {
namespace {

std::vector<float> rnd(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> rnd_signs(std::mt19937& rng, size_t n) {
  std::vector<float> s(n);
  for (auto& x : s) x = (rng() & 1) ? 1.0f : -1.0f;
  return s;
}

double max_diff(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (!(d <= 1e300)) return INFINITY;  // NaN fails
    m = std::max(m, d);
  }
  return m;
}

TEST(PrismFwht, MatchesExplicitMatrixAndIsAnInvolution) {
  std::mt19937 rng(1);
  auto x = rnd(rng, 1024);
  std::vector<float> y = x;
  fwht(y.data(), 1024);
  std::vector<double> ref(1024);
  for (int r = 0; r < 1024; ++r) {
    double acc = 0;
    for (int c = 0; c < 1024; ++c) acc += (std::popcount(unsigned(r & c)) % 2 ? -1.0 : 1.0) / 32.0 * x[c];
    ref[r] = acc;
  }
  EXPECT_LT(max_diff(y, ref), 1e-6);
  fwht(y.data(), 1024);
  EXPECT_LT(max_diff(y, std::vector<double>(x.begin(), x.end())), 1e-6);
  EXPECT_THROW(fwht(y.data(), 1000), Error);
}

// y = W x (double) for W [out][in].
std::vector<double> matvec(const std::vector<float>& W, const std::vector<float>& x, int64_t out, int64_t in) {
  std::vector<double> y(out);
  for (int64_t o = 0; o < out; ++o) {
    double acc = 0;
    for (int64_t i = 0; i < in; ++i) acc += double(W[o * in + i]) * x[i];
    y[o] = acc;
  }
  return y;
}

std::vector<float> rotate_rows(const std::vector<float>& W, const std::vector<float>& s, int64_t out, int64_t in) {
  std::vector<float> Ws(W.size());
  for (int64_t o = 0; o < out; ++o) rotate_weight_row(W.data() + o * in, s.data(), Ws.data() + o * in, in);
  return Ws;
}

TEST(PrismRotateWeight, StoredWeightTimesForwardInputEqualsOriginalProduct) {
  // W_stored = W . diag(s) . H  =>  W_stored . H(s (.) x) = W . x
  std::mt19937 rng(2);
  const int64_t in = 3072, out = 6;
  auto W = rnd(rng, out * in);
  auto s = rnd_signs(rng, in);
  auto x = rnd(rng, in);
  auto Ws = rotate_rows(W, s, out, in);
  std::vector<float> xr(in);
  hadamard_forward_row(x.data(), s.data(), nullptr, xr.data(), in);
  std::vector<float> y(out);
  auto yd = matvec(Ws, xr, out, in);
  for (int64_t o = 0; o < out; ++o) y[o] = float(yd[o]);
  EXPECT_LT(max_diff(y, matvec(W, x, out, in)), 1e-5);

  // The tempting W . H . diag(s) is not the same thing.
  std::vector<float> Wwrong(W.size());
  for (int64_t o = 0; o < out; ++o) {
    std::vector<float> row(W.begin() + o * in, W.begin() + (o + 1) * in);
    for (int64_t c = 0; c < in; c += kHadamardBlock) fwht(row.data() + c, kHadamardBlock);
    for (int64_t i = 0; i < in; ++i) Wwrong[o * in + i] = row[i] * s[i];
  }
  auto ywrong = matvec(Wwrong, xr, out, in);
  for (int64_t o = 0; o < out; ++o) y[o] = float(ywrong[o]);
  EXPECT_GT(max_diff(y, matvec(W, x, out, in)), 1e-2);
}

TEST(PrismRotateWeight, SsmOutWithGroupedPermutation) {
  // HF's ssm_out reads o in grouped order; the runtime holds o tiled and gathers with the permutation.
  std::mt19937 rng(3);
  const int64_t nk = 4, nv = 12, hv = 256, in = nv * hv, out = 3;  // 3072 inputs
  auto W_hf = rnd(rng, out * in);
  auto s = rnd_signs(rng, in);
  auto o_tiled = rnd(rng, in);
  const auto perm = ssm_out_permutation(nk, nv, hv);
  std::vector<float> o_grouped(in);
  for (int64_t i = 0; i < in; ++i) o_grouped[i] = o_tiled[perm[i]];
  auto Ws = rotate_rows(W_hf, s, out, in);
  std::vector<float> xr(in);
  hadamard_forward_row(o_tiled.data(), s.data(), perm.data(), xr.data(), in);
  auto yd = matvec(Ws, xr, out, in);
  std::vector<float> y(yd.begin(), yd.end());
  EXPECT_LT(max_diff(y, matvec(W_hf, o_grouped, out, in)), 1e-5);
}

TEST(PrismRotateWeight, EmbeddingRoundTripsThroughInverse) {
  std::mt19937 rng(4);
  const int64_t n = 2048;
  auto e = rnd(rng, n);
  auto s = rnd_signs(rng, n);
  std::vector<float> stored(n), back(n);
  rotate_weight_row(e.data(), s.data(), stored.data(), n);
  hadamard_inverse_row(stored.data(), s.data(), back.data(), n);
  EXPECT_LT(max_diff(back, std::vector<double>(e.begin(), e.end())), 1e-6);
}

TEST(PrismPermutation, TiledToGroupedHeads) {
  // 2 K heads, 6 V heads (R = 3), head_v 2. Grouped head g = k*3 + r reads tiled head r*2 + k.
  const auto perm = ssm_out_permutation(2, 6, 2);
  const std::vector<int32_t> want = {0, 1, 4, 5, 8, 9,     // k = 0: tiled heads 0, 2, 4
                                     2, 3, 6, 7, 10, 11};  // k = 1: tiled heads 1, 3, 5
  EXPECT_EQ(perm, want);
  auto big = ssm_out_permutation(16, 48, 128);
  std::vector<int32_t> sorted = big;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int32_t> iota(sorted.size());
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
  // SPEC 2.4: gguf[r*16 + k] = hf[k*3 + r]: grouped element (k*3+r)*128 + j comes from tiled (r*16+k)*128 + j.
  EXPECT_EQ(big[(5 * 3 + 2) * 128 + 7], (2 * 16 + 5) * 128 + 7);
  EXPECT_THROW(ssm_out_permutation(16, 40, 128), Error);
}

}  // namespace
}  // namespace dflash::prism
