// dot_row / matmul_rows: the lane contract of quant/kernels.h (checked against an emulation written
// here), scalar == AVX2 bit for bit, accuracy against double precision, matmul == dot_row whatever the
// number of rows or threads; round trips; argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "quant/kernels.h"
#include "quant/thread_pool.h"
#include "quant/types.h"
#include "util/error.h"

namespace dflash {
namespace {

using quant_detail::Isa;

const std::vector<GgmlType> kCodecTypes = {
    GgmlType::F32,   GgmlType::F16,   GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0,
    GgmlType::Q4_K,  GgmlType::Q5_K,  GgmlType::Q6_K, GgmlType::TQ1_0, GgmlType::TQ2_0,
    GgmlType::Q1_0,  GgmlType::Q2_0,  GgmlType::PQ2_0, GgmlType::PTQ1_0};

std::string type_label(const ::testing::TestParamInfo<GgmlType>& info) { return type_name(info.param); }

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Byte offsets of the fp16 scale fields inside one block (SPEC 1.1 layouts).
std::vector<int> half_fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: case GgmlType::Q4_0: case GgmlType::Q1_0: case GgmlType::Q2_0: case GgmlType::PQ2_0:
      return {0};
    case GgmlType::Q4_K: case GgmlType::Q5_K: return {0, 2};
    case GgmlType::Q6_K: return {208};
    case GgmlType::TQ1_0: return {52};
    case GgmlType::TQ2_0: return {64};
    case GgmlType::PTQ1_0: return {26};
    default: return {};
  }
}

// A finite half of moderate magnitude (exponent 1..29: about 6e-5 .. 3e4), or now and then a subnormal.
uint16_t random_half(std::mt19937& rng) {
  const uint32_t r = rng();
  const uint16_t sign = (r & 1) ? 0x8000 : 0;
  const uint16_t mant = static_cast<uint16_t>((r >> 1) & 0x3ff);
  const uint16_t exp = (r >> 11) % 16 == 0 ? 0 : static_cast<uint16_t>(1 + (r >> 16) % 29);
  return static_cast<uint16_t>(sign | (exp << 10) | mant);
}

// Random bytes in every code field (all bit patterns the decoders can meet) with finite scales.
std::vector<uint8_t> random_row(GgmlType t, int64_t n, std::mt19937& rng) {
  const TypeTraits& tt = type_traits(t);
  std::vector<uint8_t> row(row_bytes(t, n));
  if (t == GgmlType::F32) {
    std::normal_distribution<float> nd(0.0f, 3.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      std::memcpy(&row[4 * i], &v, 4);
    }
    return row;
  }
  for (auto& b : row) b = static_cast<uint8_t>(rng());
  if (t == GgmlType::F16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = random_half(rng);
      std::memcpy(&row[2 * i], &h, 2);
    }
  } else if (t == GgmlType::BF16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t r = rng();
      const uint16_t h = static_cast<uint16_t>((r & 0x807f) | ((107 + (r >> 16) % 40) << 7));
      std::memcpy(&row[2 * i], &h, 2);
    }
  } else {
    for (int64_t b = 0; b < n / tt.block_elems; ++b)
      for (int off : half_fields(t)) {
        const uint16_t h = random_half(rng);
        std::memcpy(&row[b * tt.block_bytes + off], &h, 2);
      }
  }
  return row;
}

std::vector<float> random_floats(int64_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = nd(rng);
  return v;
}

// Row lengths to try: a few block counts, and for plain types lengths that leave lane tails.
std::vector<int64_t> test_lengths(GgmlType t) {
  const int64_t be = type_traits(t).block_elems;
  if (be == 1) return {1, 7, 31, 32, 33, 100, 255, 256, 257, 1000, 4096};
  return {be, 2 * be, 3 * be, 5 * be, 4096 / be * be + be};
}

// The contract, written out independently: fma element i into lane i % 32, then the fixed tree.
float contract_dot(const std::vector<float>& w, const float* x) {
  float L[32] = {};
  for (size_t i = 0; i < w.size(); ++i) L[i % 32] = std::fma(w[i], x[i], L[i % 32]);
  float v[8];
  for (int k = 0; k < 8; ++k) v[k] = (L[k] + L[k + 8]) + (L[k + 16] + L[k + 24]);
  const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
  return (s0 + s2) + (s1 + s3);
}

class Dot : public ::testing::TestWithParam<GgmlType> {};

TEST_P(Dot, ScalarAndAvx2AgreeBitForBit) {
  if (!quant_detail::avx2_available()) GTEST_SKIP() << "no AVX2 on this CPU";
  const GgmlType t = GetParam();
  std::mt19937 rng(42 + static_cast<int>(t));
  for (int64_t n : test_lengths(t)) {
    for (int trial = 0; trial < 8; ++trial) {
      const auto w = random_row(t, n, rng);
      const auto x = random_floats(n, rng);
      std::vector<float> a(n), b(n);
      quant_detail::dequantize_row_isa(Isa::Scalar, t, w.data(), a.data(), n);
      quant_detail::dequantize_row_isa(Isa::Avx2, t, w.data(), b.data(), n);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0) << type_name(t) << " n=" << n;
      const float ds = quant_detail::dot_row_isa(Isa::Scalar, t, w.data(), x.data(), n);
      const float dv = quant_detail::dot_row_isa(Isa::Avx2, t, w.data(), x.data(), n);
      ASSERT_EQ(bits_of(ds), bits_of(dv)) << type_name(t) << " n=" << n << ": " << ds << " vs " << dv;
    }
  }
}

TEST_P(Dot, FollowsTheLaneContract) {
  const GgmlType t = GetParam();
  std::mt19937 rng(7 + static_cast<int>(t));
  for (int64_t n : test_lengths(t)) {
    const auto w = random_row(t, n, rng);
    const auto x = random_floats(n, rng);
    std::vector<float> deq(n);
    dequantize_row(t, w.data(), deq.data(), n);
    const float want = contract_dot(deq, x.data());
    for (Isa isa : {Isa::Scalar, Isa::Avx2}) {
      if (isa == Isa::Avx2 && !quant_detail::avx2_available()) continue;
      const float got = quant_detail::dot_row_isa(isa, t, w.data(), x.data(), n);
      ASSERT_EQ(bits_of(got), bits_of(want)) << type_name(t) << " n=" << n << (isa == Isa::Avx2 ? " avx2" : " scalar");
    }
    ASSERT_EQ(bits_of(dot_row(t, w.data(), x.data(), n)), bits_of(want));
  }
}

TEST_P(Dot, MatchesDoublePrecisionReference) {
  const GgmlType t = GetParam();
  std::mt19937 rng(1000 + static_cast<int>(t));
  for (int64_t n : {int64_t{256}, int64_t{4096}, int64_t{16384}}) {
    // Realistic weights: quantized normal data.
    const auto src = random_floats(n, rng, 0.05f);
    std::vector<uint8_t> w(row_bytes(t, n));
    quantize_row(t, src.data(), w.data(), n);
    const auto x = random_floats(n, rng);
    std::vector<float> deq(n);
    dequantize_row(t, w.data(), deq.data(), n);
    double ref = 0, mag = 0;
    for (int64_t i = 0; i < n; ++i) {
      ref += static_cast<double>(deq[i]) * x[i];
      mag += std::fabs(static_cast<double>(deq[i]) * x[i]);
    }
    const double got = dot_row(t, w.data(), x.data(), n);
    // Worst case of fp32 lane sums: (n/32 terms per lane + 5 tree levels) roundings of at most 2^-24
    // of the magnitude each.
    const double bound = (static_cast<double>(n) / 32 + 6) * std::ldexp(1.0, -24) * mag;
    EXPECT_LE(std::fabs(got - ref), bound) << type_name(t) << " n=" << n << " ref=" << ref;
    EXPECT_GT(mag, 0.0);
  }
}

TEST_P(Dot, MatmulRowsEqualsDotRowForAnyRowCountAndThreadCount) {
  const GgmlType t = GetParam();
  std::mt19937 rng(5 + static_cast<int>(t));
  const int64_t n_in = 512, n_out = 37;
  const size_t rb = row_bytes(t, n_in);
  std::vector<uint8_t> W;
  for (int64_t o = 0; o < n_out; ++o) {
    const auto r = random_row(t, n_in, rng);
    W.insert(W.end(), r.begin(), r.end());
  }
  ThreadPool pool1(1), pool3(3), pool8(8);
  for (int64_t M : {1, 2, 7, 8, 9, 20}) {
    const auto x = random_floats(M * n_in, rng);
    std::vector<float> want(M * n_out);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < n_out; ++o) want[m * n_out + o] = dot_row(t, W.data() + o * rb, x.data() + m * n_in, n_in);
    for (ThreadPool* pool : {&pool1, &pool3, &pool8, static_cast<ThreadPool*>(nullptr)}) {
      for (Isa isa : {Isa::Scalar, Isa::Avx2}) {
        if (isa == Isa::Avx2 && !quant_detail::avx2_available()) continue;
        std::vector<float> y(M * n_out, -1.0f);
        quant_detail::matmul_rows_isa(isa, t, W.data(), n_in, n_out, x.data(), M, y.data(), pool);
        ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0)
            << type_name(t) << " M=" << M << " threads=" << (pool ? pool->size() : -1);
      }
    }
    std::vector<float> y(M * n_out);
    matmul_rows(t, W.data(), n_in, n_out, x.data(), M, y.data());
    ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0);
  }
}

TEST_P(Dot, WrongRowSizeThrows) {
  const GgmlType t = GetParam();
  const int64_t be = type_traits(t).block_elems;
  std::vector<uint8_t> buf(4096, 0);
  std::vector<float> f(4096, 0.0f);
  const int64_t bad = be == 1 ? -1 : be + 1;
  EXPECT_THROW(dequantize_row(t, buf.data(), f.data(), bad), Error);
  EXPECT_THROW(quantize_row(t, f.data(), buf.data(), bad), Error);
  EXPECT_THROW(dot_row(t, buf.data(), f.data(), bad), Error);
  EXPECT_THROW(matmul_rows(t, buf.data(), bad, 1, f.data(), 1, f.data()), Error);
  EXPECT_THROW(row_bytes(t, bad), Error);
  if (be > 1) {
    EXPECT_THROW(dot_row(t, buf.data(), f.data(), be / 2), Error);
  }
  EXPECT_NO_THROW(dot_row(t, buf.data(), f.data(), 0));
}

// Quantize -> dequantize keeps normal data within a per-type relative RMS error.
TEST_P(Dot, RoundTripError) {
  const GgmlType t = GetParam();
  double bound = 0.0;
  switch (t) {
    case GgmlType::F32: bound = 0.0; break;
    case GgmlType::F16: bound = 1e-3; break;
    case GgmlType::BF16: bound = 5e-3; break;
    case GgmlType::Q8_0: bound = 0.01; break;
    case GgmlType::Q6_K: bound = 0.03; break;
    case GgmlType::Q5_K: bound = 0.06; break;
    case GgmlType::Q4_K: bound = 0.12; break;
    case GgmlType::Q4_0: bound = 0.15; break;
    default: bound = 0.8; break;  // ternary / binary codes of Gaussian data are coarse by design
  }
  std::mt19937 rng(77);
  const int64_t n = 8192;
  const auto src = random_floats(n, rng, 0.3f);
  std::vector<uint8_t> q(row_bytes(t, n));
  quantize_row(t, src.data(), q.data(), n);
  std::vector<float> back(n);
  dequantize_row(t, q.data(), back.data(), n);
  double err = 0, sig = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += (back[i] - src[i]) * static_cast<double>(back[i] - src[i]);
    sig += src[i] * static_cast<double>(src[i]);
  }
  EXPECT_LE(std::sqrt(err / sig), bound) << type_name(t);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, Dot, ::testing::ValuesIn(kCodecTypes), type_label);

// Ternary inputs {-s, 0, +s} with s exact in fp16 survive every ternary/2-bit type exactly, and
// quantizing the dequantized row gives the same bytes again.
TEST(RoundTrip, TernaryValuesAreExact) {
  std::mt19937 rng(3);
  for (GgmlType t : {GgmlType::TQ1_0, GgmlType::TQ2_0, GgmlType::Q2_0, GgmlType::PQ2_0, GgmlType::PTQ1_0}) {
    const int64_t be = type_traits(t).block_elems, n = 4 * 256;
    std::vector<float> src(n);
    for (int64_t b = 0; b < n / be; ++b) {
      const float s = fp16_to_fp32(fp32_to_fp16(0.01f * static_cast<float>(1 + b)));
      for (int64_t j = 0; j < be; ++j) src[b * be + j] = s * static_cast<float>(static_cast<int>(rng() % 3) - 1);
      src[b * be + rng() % be] = (rng() & 1) ? s : -s;  // the block maximum is s
    }
    std::vector<uint8_t> q(row_bytes(t, n)), q2(row_bytes(t, n));
    quantize_row(t, src.data(), q.data(), n);
    std::vector<float> back(n);
    dequantize_row(t, q.data(), back.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], src[i]) << type_name(t) << " element " << i;
    quantize_row(t, back.data(), q2.data(), n);
    EXPECT_EQ(q, q2) << type_name(t);
  }
}

TEST(RoundTrip, Q1_0KeepsSignsAndMeanMagnitude) {
  const int64_t n = 512;
  std::vector<float> src(n);
  for (int64_t i = 0; i < n; ++i) src[i] = (i % 3 == 0 ? -0.375f : 0.375f);
  std::vector<uint8_t> q(row_bytes(GgmlType::Q1_0, n));
  quantize_row(GgmlType::Q1_0, src.data(), q.data(), n);
  std::vector<float> back(n);
  dequantize_row(GgmlType::Q1_0, q.data(), back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], src[i]) << i;
}

TEST(RoundTrip, PlainTypesAreIdempotent) {
  std::mt19937 rng(11);
  const auto src = random_floats(1000, rng, 10.0f);
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) {
    std::vector<uint8_t> q(row_bytes(t, 1000)), q2(row_bytes(t, 1000));
    std::vector<float> back(1000);
    quantize_row(t, src.data(), q.data(), 1000);
    dequantize_row(t, q.data(), back.data(), 1000);
    quantize_row(t, back.data(), q2.data(), 1000);
    EXPECT_EQ(q, q2) << type_name(t);
  }
}

TEST(Errors, TypesWithoutCodecThrow) {
  std::vector<uint8_t> buf(64);
  std::vector<float> f(64);
  EXPECT_THROW(dequantize_row(GgmlType::I8, buf.data(), f.data(), 8), Error);
  EXPECT_THROW(dot_row(GgmlType::I32, buf.data(), f.data(), 8), Error);
  EXPECT_THROW(quantize_row(static_cast<GgmlType>(99), f.data(), buf.data(), 8), Error);
  EXPECT_THROW(matmul_rows(GgmlType::F64, buf.data(), 8, 1, f.data(), 1, f.data()), Error);
}

TEST(ThreadPoolTest, CoversEveryIndexOnceAndPropagatesErrors) {
  ThreadPool pool(4);
  std::vector<int> hits(1001, 0);
  pool.parallel_for(1001, 7, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++hits[i];
  });
  for (int h : hits) ASSERT_EQ(h, 1);
  EXPECT_THROW(pool.parallel_for(100, 3, [](int64_t b, int64_t) {
    if (b >= 50) throw Error("boom");
  }), Error);
  // Still usable afterwards, and nested calls run inline.
  int total = 0;
  std::mutex mu;
  pool.parallel_for(10, 1, [&](int64_t, int64_t) {
    pool.parallel_for(5, 1, [&](int64_t, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      ++total;
    });
  });
  EXPECT_EQ(total, 50);
}

}  // namespace
}  // namespace dflash
