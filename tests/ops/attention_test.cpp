// CPU backend: NeoX RoPE and softmax attention over a KV cache.
#include <gtest/gtest.h>

#include "ops/backend.h"
#include "ops_test_util.h"
#include "util/error.h"

namespace dflash::test {
namespace {

// Reference rotation with the angle recipe the op documents (fp32 inv_freq, fp32 product), the rest
// in double; `exact_angle` uses a double angle instead (only close for small positions).
std::vector<double> rope_ref(const std::vector<float>& x, const std::vector<int32_t>& pos, int64_t M, int64_t heads,
                             int64_t hd, int64_t n_rot, double theta, bool exact_angle) {
  std::vector<double> y(x.begin(), x.end());
  const int64_t half = n_rot / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double inv = std::pow(theta, -2.0 * i / n_rot);
        const double ang = exact_angle ? pos[m] * inv : double(float(pos[m]) * float(inv));
        const size_t a = (m * heads + h) * hd + i, b = a + half;
        y[a] = x[a] * std::cos(ang) - double(x[b]) * std::sin(ang);
        y[b] = x[b] * std::cos(ang) + double(x[a]) * std::sin(ang);
      }
  return y;
}

TEST(CpuRope, MatchesReferenceAndLeavesTailDims) {
  std::mt19937 rng(10);
  auto be = make_cpu_backend(3);
  struct Case { int64_t M, heads, hd, n_rot; float theta; std::vector<int32_t> pos; };
  std::vector<Case> cases = {
      {1, 1, 8, 8, 10000.0f, {5}},
      {4, 3, 256, 64, 1e7f, {0, 1, 4095, 262143}},
      {3, 2, 128, 128, 1e6f, {7, 100000, 31}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "M " << c.M << " heads " << c.heads << " hd " << c.hd << " n_rot " << c.n_rot);
    auto x = random_vec(rng, c.M * c.heads * c.hd);
    std::vector<float> y = x;
    be->rope_neox(y.data(), c.pos.data(), c.M, c.heads, c.hd, c.n_rot, c.theta);
    expect_close(y, rope_ref(x, c.pos, c.M, c.heads, c.hd, c.n_rot, c.theta, false), 1e-6, 1e-6, "rope");
    // Row by row gives the same bits.
    for (int64_t m = 0; m < c.M; ++m) {
      std::vector<float> r(x.begin() + m * c.heads * c.hd, x.begin() + (m + 1) * c.heads * c.hd);
      be->rope_neox(r.data(), c.pos.data() + m, 1, c.heads, c.hd, c.n_rot, c.theta);
      EXPECT_TRUE(same_bits(r.data(), y.data() + m * c.heads * c.hd, r.size())) << "row " << m;
    }
  }
  // Small positions: close to the exact double angle too.
  auto x = random_vec(rng, 2 * 64);
  std::vector<int32_t> pos = {3, 90};
  std::vector<float> y = x;
  be->rope_neox(y.data(), pos.data(), 2, 1, 64, 64, 1e7f);
  expect_close(y, rope_ref(x, pos, 2, 1, 64, 64, 1e7, true), 1e-5, 1e-5, "rope vs double angle");
}

std::vector<double> attention_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  const std::vector<int32_t>& range, int64_t M, int64_t H, int64_t Hkv, int64_t hd,
                                  double scale) {
  std::vector<double> out(M * H * hd, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / Hkv), lo = range[2 * m], hi = range[2 * m + 1];
      if (hi == lo) continue;
      std::vector<double> s(hi - lo);
      double mx = -1e300;
      for (int64_t j = lo; j < hi; ++j) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += double(q[(m * H + h) * hd + i]) * k[(j * Hkv + kvh) * hd + i];
        s[j - lo] = d * scale;
        mx = std::max(mx, s[j - lo]);
      }
      double sum = 0;
      for (auto& e : s) sum += (e = std::exp(e - mx));
      for (int64_t j = lo; j < hi; ++j)
        for (int64_t i = 0; i < hd; ++i) out[(m * H + h) * hd + i] += s[j - lo] / sum * v[(j * Hkv + kvh) * hd + i];
    }
  return out;
}

TEST(CpuAttention, MatchesReferenceAndRowsAreBitIdentical) {
  std::mt19937 rng(11);
  auto be = make_cpu_backend(3);
  auto be1 = make_cpu_backend(1);
  struct Case { int64_t M, H, Hkv, hd, n_keys; };
  for (auto c : {Case{1, 1, 1, 16, 1}, Case{5, 6, 2, 64, 40}, Case{8, 24, 4, 256, 300}}) {
    SCOPED_TRACE(testing::Message() << "M " << c.M << " H " << c.H << " Hkv " << c.Hkv << " hd " << c.hd);
    auto q = random_vec(rng, c.M * c.H * c.hd, -2, 2);
    auto k = random_vec(rng, c.n_keys * c.Hkv * c.hd, -2, 2);
    auto v = random_vec(rng, c.n_keys * c.Hkv * c.hd);
    // Causal ranges ending at the last keys, one row with a window (lo > 0), one empty row when M > 2.
    std::vector<int32_t> range(2 * c.M);
    for (int64_t m = 0; m < c.M; ++m) {
      range[2 * m] = 0;
      range[2 * m + 1] = int32_t(c.n_keys - c.M + 1 + m);
    }
    if (c.M > 2) {
      range[2] = 3;
      range[4] = range[5] = 7;
    }
    const float scale = 1.0f / std::sqrt(float(c.hd));
    auto qd = to_dev(*be, q), kd = to_dev(*be, k), vd = to_dev(*be, v);
    auto rd = to_dev(*be, range);
    DeviceArray<float> od(*be, c.M * c.H * c.hd);
    be->attention(qd.get(), kd.get(), vd.get(), rd.get(), od.get(), c.M, c.H, c.Hkv, c.hd, scale);
    auto out = from_dev(*be, od);
    expect_close(out, attention_ref(q, k, v, range, c.M, c.H, c.Hkv, c.hd, scale), 2e-6, 1e-5, "attention");
    const int64_t row = c.H * c.hd;
    std::vector<float> o1(row);
    for (int64_t m = 0; m < c.M; ++m) {
      be->attention(q.data() + m * row, k.data(), v.data(), range.data() + 2 * m, o1.data(), 1, c.H, c.Hkv, c.hd,
                    scale);
      EXPECT_TRUE(same_bits(o1.data(), out.data() + m * row, row)) << "row " << m;
    }
    std::vector<float> ot(out.size());
    be1->attention(q.data(), k.data(), v.data(), range.data(), ot.data(), c.M, c.H, c.Hkv, c.hd, scale);
    EXPECT_TRUE(same_bits(ot.data(), out.data(), out.size())) << "thread count changed bits";
  }
}

TEST(CpuAttention, RejectsBadRangesAndHeadCounts) {
  auto be = make_cpu_backend(1);
  std::vector<float> q(8), k(8), v(8), out(8);
  std::vector<int32_t> bad = {2, 1};
  EXPECT_THROW(be->attention(q.data(), k.data(), v.data(), bad.data(), out.data(), 1, 1, 1, 8, 1.0f), Error);
  std::vector<int32_t> ok = {0, 1};
  EXPECT_THROW(be->attention(q.data(), k.data(), v.data(), ok.data(), out.data(), 1, 3, 2, 8, 1.0f), Error);
}

}  // namespace
}  // namespace dflash::test
