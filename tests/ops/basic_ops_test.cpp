// CPU backend: memory, matmul, get_rows, norms, elementwise ops, Hadamard, argmax / top_k.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <numeric>

#include "ops/backend.h"
#include "ops_test_util.h"
#include "prism/hadamard.h"
#include "util/error.h"

namespace dflash::test {
namespace {

std::unique_ptr<Backend> cpu(int threads = 3) { return make_cpu_backend(threads); }

// ---- memory ---------------------------------------------------------------------------------------

TEST(CpuMemory, AllocIsZeroedAlignedAndCopies) {
  auto be = cpu();
  for (size_t bytes : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}}) {
    void* p = be->alloc(bytes);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    const auto* b = static_cast<const uint8_t*>(p);
    EXPECT_TRUE(std::all_of(b, b + bytes, [](uint8_t v) { return v == 0; }));
    be->release(p);
  }
  std::vector<float> h = {1, 2, 3, 4};
  auto a = to_dev(*be, h);
  DeviceArray<float> b(*be, 4);
  be->copy(b.get(), a.get(), a.bytes());
  EXPECT_EQ(from_dev(*be, b), h);
  be->fill_zero(b.get(), b.bytes());
  EXPECT_EQ(from_dev(*be, b), std::vector<float>(4, 0.0f));
}

TEST(CpuMemory, UploadWeightKeepsHostPointer) {
  auto be = cpu();
  std::vector<float> w(8 * 3);
  WeightRef ref = be->upload_weight(w.data(), GgmlType::F32, 8, 3);
  EXPECT_EQ(ref.data, w.data());
  EXPECT_EQ(ref.in, 8);
  EXPECT_EQ(ref.out, 3);
  EXPECT_EQ(ref.row_bytes, 32u);
  EXPECT_THROW(be->upload_weight(nullptr, GgmlType::F32, 8, 3), Error);
}

// ---- matmul / get_rows ----------------------------------------------------------------------------

struct QuantWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> deq;  // [out][in], what the codec decodes
};

QuantWeight make_weight(GgmlType type, int64_t in, int64_t out, std::mt19937& rng) {
  QuantWeight q;
  const size_t rb = row_bytes(type, in);
  q.bytes.resize(rb * out);
  q.deq.resize(static_cast<size_t>(in * out));
  for (int64_t o = 0; o < out; ++o) {
    auto row = random_vec(rng, in);
    quantize_row(type, row.data(), q.bytes.data() + o * rb, in);
    dequantize_row(type, q.bytes.data() + o * rb, q.deq.data() + o * in, in);
  }
  return q;
}

class CpuMatmul : public ::testing::TestWithParam<GgmlType> {};

TEST_P(CpuMatmul, MatchesDoubleReferenceAndRowsAreBitIdentical) {
  const GgmlType type = GetParam();
  std::mt19937 rng(1);
  auto be = cpu(3);
  auto be1 = cpu(1);
  for (auto [in, out, M] : {std::tuple{256, 7, 1}, {512, 33, 5}, {1024, 130, 9}}) {
    SCOPED_TRACE(testing::Message() << type_name(type) << " in=" << in << " out=" << out << " M=" << M);
    auto w = make_weight(type, in, out, rng);
    WeightRef wr = be->upload_weight(w.bytes.data(), type, in, out);
    auto x = random_vec(rng, static_cast<size_t>(M * in));
    auto xd = to_dev(*be, x);
    DeviceArray<float> yd(*be, static_cast<size_t>(M * out));
    be->matmul(wr, xd.get(), yd.get(), M);
    auto y = from_dev(*be, yd);

    std::vector<double> ref(static_cast<size_t>(M * out));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += double(w.deq[o * in + i]) * x[m * in + i];
        ref[m * out + o] = s;
      }
    expect_close(y, ref, 2e-5 * std::sqrt(double(in)), 1e-5, "matmul");

    // Each row alone, and with one thread, gives the same bits.
    std::vector<float> y1(static_cast<size_t>(out));
    for (int64_t m = 0; m < M; ++m) {
      be->matmul(wr, xd.get() + m * in, y1.data(), 1);
      EXPECT_TRUE(same_bits(y1.data(), y.data() + m * out, out)) << "row " << m;
    }
    std::vector<float> yt(static_cast<size_t>(M * out));
    be1->matmul(wr, x.data(), yt.data(), M);
    EXPECT_TRUE(same_bits(yt.data(), y.data(), yt.size())) << "thread count changed bits";
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CpuMatmul, ::testing::Values(GgmlType::F32, GgmlType::F16, GgmlType::Q8_0),
                         [](const auto& info) { return std::string(type_name(info.param)); });

TEST(CpuGetRows, DequantizesSelectedRows) {
  std::mt19937 rng(2);
  auto be = cpu();
  const int64_t in = 64, out = 10;
  auto w = make_weight(GgmlType::Q8_0, in, out, rng);
  WeightRef wr = be->upload_weight(w.bytes.data(), GgmlType::Q8_0, in, out);
  std::vector<int32_t> ids = {3, 0, 9, 3};
  auto idd = to_dev(*be, ids);
  DeviceArray<float> yd(*be, ids.size() * in);
  be->get_rows(wr, idd.get(), yd.get(), static_cast<int64_t>(ids.size()));
  auto y = from_dev(*be, yd);
  for (size_t m = 0; m < ids.size(); ++m)
    EXPECT_TRUE(same_bits(y.data() + m * in, w.deq.data() + ids[m] * in, in)) << m;
  std::vector<int32_t> bad = {10};
  auto badd = to_dev(*be, bad);
  EXPECT_THROW(be->get_rows(wr, badd.get(), yd.get(), 1), Error);
}

// ---- normalisation --------------------------------------------------------------------------------

enum class Norm { Rms, RmsNoWeight, L2, RmsGated };

void norm_ref(Norm kind, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& z,
              std::vector<double>& y, int64_t rows, int64_t n, double eps, double scale) {
  y.resize(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double inv = kind == Norm::L2 ? 1.0 / std::sqrt(ss + eps) : 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) {
      double v = x[r * n + i] * inv;
      if (kind == Norm::Rms || kind == Norm::RmsGated) v *= w[i];
      if (kind == Norm::L2) v *= scale;
      if (kind == Norm::RmsGated) {
        const double zz = z[r * n + i];
        v *= zz / (1.0 + std::exp(-zz));
      }
      y[r * n + i] = v;
    }
  }
}

TEST(CpuNorm, AllNormsMatchReferenceAndRowsAreBitIdentical) {
  std::mt19937 rng(3);
  auto be = cpu();
  for (Norm kind : {Norm::Rms, Norm::RmsNoWeight, Norm::L2, Norm::RmsGated}) {
    for (auto [rows, n] : {std::pair{1, 128}, {7, 5120}, {3, 100}}) {
      SCOPED_TRACE(testing::Message() << "kind " << int(kind) << " rows " << rows << " n " << n);
      auto x = random_vec(rng, rows * n, -3, 3);
      auto w = random_vec(rng, n, 0.5, 1.5);
      auto z = random_vec(rng, rows * n, -4, 4);
      const float eps = 1e-6f, scale = 0.125f;
      auto run = [&](const float* xp, const float* zp, float* yp, int64_t r) {
        switch (kind) {
          case Norm::Rms: be->rms_norm(xp, w.data(), yp, r, n, eps); break;
          case Norm::RmsNoWeight: be->rms_norm(xp, nullptr, yp, r, n, eps); break;
          case Norm::L2: be->l2_norm(xp, yp, r, n, eps, scale); break;
          case Norm::RmsGated: be->rms_norm_gated(xp, w.data(), zp, yp, r, n, eps); break;
        }
      };
      std::vector<float> y(x.size());
      run(x.data(), z.data(), y.data(), rows);
      std::vector<double> ref;
      norm_ref(kind, x, w, z, ref, rows, n, eps, scale);
      expect_close(y, ref, 1e-6, 1e-5, "norm");
      std::vector<float> y1(n);
      for (int64_t r = 0; r < rows; ++r) {
        run(x.data() + r * n, z.data() + r * n, y1.data(), 1);
        EXPECT_TRUE(same_bits(y1.data(), y.data() + r * n, n)) << "row " << r;
      }
      // In place gives the same bits.
      std::vector<float> xi = x;
      run(xi.data(), z.data(), xi.data(), rows);
      EXPECT_TRUE(same_bits(xi.data(), y.data(), y.size()));
    }
  }
}

// ---- elementwise ----------------------------------------------------------------------------------

TEST(CpuElementwise, AddSwigluMulSigmoidCopyRows) {
  std::mt19937 rng(4);
  auto be = cpu();
  const int64_t n = 40000;  // several pool tasks
  auto a = random_vec(rng, n, -10, 10), b = random_vec(rng, n, -10, 10);
  std::vector<float> y(n);
  std::vector<double> ref(n);

  be->add(a.data(), b.data(), y.data(), n);
  for (int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) + b[i];
  expect_close(y, ref, 0, 1e-7, "add");

  be->swiglu(a.data(), b.data(), y.data(), n);
  for (int64_t i = 0; i < n; ++i) ref[i] = a[i] / (1.0 + std::exp(-double(a[i]))) * b[i];
  expect_close(y, ref, 1e-6, 1e-6, "swiglu");

  be->mul_sigmoid(a.data(), b.data(), y.data(), n);
  for (int64_t i = 0; i < n; ++i) ref[i] = a[i] / (1.0 + std::exp(-double(b[i])));
  expect_close(y, ref, 1e-6, 1e-6, "mul_sigmoid");

  // copy_rows: 3 rows of 5 from a stride-7 source into a stride-6 destination.
  std::vector<float> src(3 * 7), dst(3 * 6, -1.0f);
  std::iota(src.begin(), src.end(), 0.0f);
  be->copy_rows(dst.data(), 6, src.data() + 1, 7, 3, 5);
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) EXPECT_EQ(dst[r * 6 + c], src[r * 7 + 1 + c]);
    EXPECT_EQ(dst[r * 6 + 5], -1.0f);
  }
}

// matmul_parts / sum_parts / residual_norm_rotate / dflash_conv_parts with parts (the Backend defaults
// the CPU keeps): the
// parts are added in part order, ((p0 + p1) + p2) + ..., before the residual joins x. Values chosen so
// that another order gives other bits (1e8 - 1e8 + 1 = 1, but 1e8 + (-1e8 + 1) = 0 in float).
TEST(CpuResidualParts, PartsAreAddedInOrderBeforeTheResidual) {
  std::mt19937 rng(41);
  auto be = cpu();
  const int64_t rows = 2, dim = 64, n = rows * dim;
  std::vector<float> parts(3 * n);
  for (int64_t i = 0; i < n; ++i) {
    parts[i] = (i % 2 ? -1.0f : 1.0f) * 1e8f;
    parts[n + i] = -parts[i];
    parts[2 * n + i] = 1.0f + static_cast<float>(i % 5);
  }
  std::vector<float> folded(n);
  for (int64_t i = 0; i < n; ++i) folded[i] = (parts[i] + parts[n + i]) + parts[2 * n + i];
  ASSERT_NE(folded[0], parts[0] + (parts[n] + parts[2 * n]));  // the order matters for these values

  std::vector<float> summed = parts;
  be->sum_parts(summed.data(), 3, n);
  EXPECT_TRUE(std::equal(folded.begin(), folded.end(), summed.begin())) << "sum_parts: not ((p0 + p1) + p2)";
  EXPECT_TRUE(std::equal(parts.begin() + n, parts.end(), summed.begin() + n)) << "sum_parts wrote past the first part";

  const auto x0 = random_vec(rng, n, -2, 2), w = random_vec(rng, dim, 0.5, 1.5);
  std::vector<float> x_parts = x0, x_whole = x0, n_parts(n), n_whole(n), res = parts, res_whole = folded;
  be->residual_norm_rotate(x_parts.data(), res.data(), 3, w.data(), n_parts.data(), nullptr, {}, rows, dim, 1e-6f);
  be->residual_norm_rotate(x_whole.data(), res_whole.data(), 1, w.data(), n_whole.data(), nullptr, {}, rows, dim,
                           1e-6f);
  EXPECT_EQ(x_parts, x_whole);
  EXPECT_EQ(n_parts, n_whole);

  // dflash_conv_parts: the conv of the parts' sum (the drafter's residual; res aliasing y).
  const int64_t K = 2, group = 4, G = dim / group, d_stride = K * G;
  const auto base = random_vec(rng, K * dim, -1, 1), dc = random_vec(rng, rows * d_stride, -1, 1);
  std::vector<float> conv_parts = x0, conv_whole = x0, cp = parts, cw = folded;
  be->dflash_conv_parts(cp.data(), 3, base.data(), dc.data(), d_stride, conv_parts.data(), conv_parts.data(), rows,
                        dim, K, group);
  be->dflash_conv(cw.data(), base.data(), dc.data(), d_stride, conv_whole.data(), conv_whole.data(), rows, dim, K,
                  group);
  EXPECT_EQ(conv_parts, conv_whole);

  // The CPU's matmul_parts is matmul: one part, the same bits.
  std::vector<float> wf = random_vec(rng, 48 * 32, -1, 1), xm = random_vec(rng, 3 * 32, -1, 1);
  const WeightRef wr = be->upload_weight(wf.data(), GgmlType::F32, 32, 48);
  std::vector<float> y_parts(8 * 3 * 48, -7.0f), y(3 * 48);
  EXPECT_EQ(be->matmul_parts(wr, xm.data(), y_parts.data(), 3, 8), 1);
  be->matmul(wr, xm.data(), y.data(), 3);
  EXPECT_TRUE(std::equal(y.begin(), y.end(), y_parts.begin()));
  EXPECT_EQ(y_parts[3 * 48], -7.0f);  // nothing past the one part
}

// ---- Hadamard -------------------------------------------------------------------------------------

double h_entry(int r, int c) { return (std::popcount(unsigned(r & c)) % 2 ? -1.0 : 1.0) / 32.0; }

// Reference: y = H_blk(s (.) P x) or s (.) H_blk(x) with the explicit matrix.
std::vector<double> hadamard_ref(const std::vector<float>& x, const std::vector<float>* s,
                                 const std::vector<int32_t>* perm, int64_t rows, int64_t n, bool inverse) {
  std::vector<double> y(x.size());
  std::vector<double> t(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * n;
    for (int64_t i = 0; i < n; ++i) {
      double v = perm ? xr[(*perm)[i]] : xr[i];
      if (s && !inverse) v *= (*s)[i];
      t[i] = v;
    }
    for (int64_t c0 = 0; c0 < n; c0 += 1024)
      for (int i = 0; i < 1024; ++i) {
        double acc = 0;
        for (int j = 0; j < 1024; ++j) acc += h_entry(i, j) * t[c0 + j];
        y[r * n + c0 + i] = (s && inverse) ? acc * (*s)[c0 + i] : acc;
      }
  }
  return y;
}

TEST(CpuHadamard, MatchesExplicitMatrix) {
  std::mt19937 rng(5);
  auto be = cpu();
  const int64_t rows = 3, n = 3072;
  auto x = random_vec(rng, rows * n, -2, 2);
  std::vector<float> s(n);
  for (auto& v : s) v = (rng() & 1) ? 1.0f : -1.0f;
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<float> y(x.size());
  for (bool inverse : {false, true})
    for (bool with_signs : {false, true})
      for (bool with_perm : {false, true}) {
        if (inverse && with_perm) continue;
        SCOPED_TRACE(testing::Message() << "inverse " << inverse << " signs " << with_signs << " perm " << with_perm);
        be->hadamard(x.data(), with_signs ? s.data() : nullptr, with_perm ? perm.data() : nullptr, y.data(), rows, n, 1024, inverse);
        auto ref = hadamard_ref(x, with_signs ? &s : nullptr, with_perm ? &perm : nullptr, rows, n, inverse);
        expect_close(y, ref, 2e-6, 1e-6, "hadamard");
        // In place and row by row give the same bits.
        std::vector<float> xi = x;
        be->hadamard(xi.data(), with_signs ? s.data() : nullptr, with_perm ? perm.data() : nullptr, xi.data(), rows,
                     n, 1024, inverse);
        EXPECT_TRUE(same_bits(xi.data(), y.data(), y.size()));
        std::vector<float> y1(n);
        be->hadamard(x.data() + n, with_signs ? s.data() : nullptr, with_perm ? perm.data() : nullptr, y1.data(), 1,
                     n, 1024, inverse);
        EXPECT_TRUE(same_bits(y1.data(), y.data() + n, n));
      }
  EXPECT_THROW(be->hadamard(x.data(), s.data(), perm.data(), y.data(), rows, n, 1024, true), Error);
  EXPECT_THROW(be->hadamard(x.data(), nullptr, nullptr, y.data(), 1, 1000, 1024, false), Error);
}

// Blocks other than 1024 (tiny models' prism.hadamard.block_size): H_b[r][c] = (-1)^popcount(r&c)/sqrt(b).
TEST(CpuHadamard, SmallerBlocksMatchTheirMatrix) {
  std::mt19937 rng(8);
  auto be = cpu();
  for (int64_t block : {2, 16, 64, 256}) {
    const int64_t rows = 2, n = 4 * block;
    auto x = random_vec(rng, rows * n);
    std::vector<float> s(n);
    for (auto& v : s) v = (rng() & 1) ? 1.0f : -1.0f;
    std::vector<float> y(x.size());
    for (bool inverse : {false, true}) {
      be->hadamard(x.data(), s.data(), nullptr, y.data(), rows, n, block, inverse);
      std::vector<double> ref(x.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c0 = 0; c0 < n; c0 += block)
          for (int64_t i = 0; i < block; ++i) {
            double acc = 0;
            for (int64_t j = 0; j < block; ++j) {
              const double hij = (std::popcount(uint64_t(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(block));
              const double xj = x[r * n + c0 + j];
              acc += hij * (inverse ? xj : xj * s[c0 + j]);
            }
            ref[r * n + c0 + i] = inverse ? acc * s[c0 + i] : acc;
          }
      expect_close(y, ref, 2e-6, 1e-6, "hadamard block " + std::to_string(block));
    }
  }
  std::vector<float> x(96), y(96);
  EXPECT_THROW(be->hadamard(x.data(), nullptr, nullptr, y.data(), 1, 96, 48, false), Error);  // not a power of 2
  EXPECT_THROW(be->hadamard(x.data(), nullptr, nullptr, y.data(), 1, 96, 64, false), Error);  // 96 % 64 != 0
}

TEST(CpuHadamard, IsAnInvolutionAndInverseUndoesForward) {
  std::mt19937 rng(6);
  auto be = cpu();
  const int64_t n = 2048;
  auto x = random_vec(rng, n);
  std::vector<float> s(n);
  for (auto& v : s) v = (rng() & 1) ? 1.0f : -1.0f;
  std::vector<float> y(n), z(n);
  be->hadamard(x.data(), nullptr, nullptr, y.data(), 1, n, 1024, false);
  be->hadamard(y.data(), nullptr, nullptr, z.data(), 1, n, 1024, false);
  expect_close(z, x, 1e-6, 0, "H H x");
  be->hadamard(x.data(), s.data(), nullptr, y.data(), 1, n, 1024, false);
  be->hadamard(y.data(), s.data(), nullptr, z.data(), 1, n, 1024, true);
  expect_close(z, x, 1e-6, 0, "inverse(forward(x))");
}

// ---- DFlash drafter conv ---------------------------------------------------------------------------

TEST(CpuDflashConv, MatchesReferenceWithAndWithoutResidual) {
  std::mt19937 rng(9);
  auto be = cpu();
  auto be1 = cpu(1);
  for (auto [M, C, K, group] : {std::tuple{8, 64, 2, 16}, {5, 96, 3, 32}, {1, 8, 2, 8}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " C " << C << " K " << K << " group " << group);
    const int64_t G = C / group, d_stride = 2 * K * G + 3;  // wider rows than one stage needs
    auto x = random_vec(rng, M * C), base = random_vec(rng, K * C), d = random_vec(rng, M * d_stride);
    auto res = random_vec(rng, M * C);
    for (bool with_res : {false, true}) {
      std::vector<float> y(M * C);
      be->dflash_conv(x.data(), base.data(), d.data(), d_stride, with_res ? res.data() : nullptr, y.data(), M, C, K,
                      group);
      std::vector<double> ref(M * C);
      for (int64_t t = 0; t < M; ++t)
        for (int64_t c = 0; c < C; ++c) {
          double acc = 0;
          for (int64_t o = 0; o < K && o <= t; ++o)
            acc += (double(base[o * C + c]) + d[t * d_stride + o * G + c / group]) * x[(t - o) * C + c];
          ref[t * C + c] = acc + (with_res ? res[t * C + c] : 0.0);
        }
      expect_close(y, ref, 1e-6, 1e-5, "dflash_conv");
      std::vector<float> y1(M * C);
      be1->dflash_conv(x.data(), base.data(), d.data(), d_stride, with_res ? res.data() : nullptr, y1.data(), M, C, K,
                       group);
      EXPECT_TRUE(same_bits(y1.data(), y.data(), y.size())) << "thread count changed bits";
      // The residual may alias y.
      if (with_res) {
        std::vector<float> yr = res;
        be->dflash_conv(x.data(), base.data(), d.data(), d_stride, yr.data(), yr.data(), M, C, K, group);
        EXPECT_TRUE(same_bits(yr.data(), y.data(), y.size())) << "res aliasing y";
      }
    }
  }
  std::vector<float> x(16), y(16), base(32), d(16);
  EXPECT_THROW(be->dflash_conv(x.data(), base.data(), d.data(), 4, nullptr, x.data(), 1, 16, 2, 4), Error);  // alias
  EXPECT_THROW(be->dflash_conv(x.data(), base.data(), d.data(), 4, nullptr, y.data(), 1, 16, 2, 5), Error);  // group
}

// ---- argmax / top_k -------------------------------------------------------------------------------

TEST(CpuSampling, ArgmaxLowestIndexWinsTies) {
  auto be = cpu();
  std::vector<float> x = {1, 5, 5, 2,  -1, -1, -1, -1,  0, 0, 3, 3};
  std::vector<int32_t> ids(3);
  be->argmax(x.data(), ids.data(), 3, 4);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 0, 2}));
}

TEST(CpuSampling, TopKSortedDescendingTiesToLowerIndex) {
  auto be = cpu();
  std::vector<float> x = {1, 5, 3, 5, 3, 0,  2, 2, 2, 2, 2, 9};
  std::vector<int32_t> ids(2 * 4);
  std::vector<float> vals(2 * 4);
  be->top_k(x.data(), ids.data(), vals.data(), 2, 6, 4);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 2, 4, 5, 0, 1, 2}));
  EXPECT_EQ(vals, (std::vector<float>{5, 5, 3, 3, 9, 2, 2, 2}));

  // Random rows against a stable sort.
  std::mt19937 rng(7);
  const int64_t M = 5, n = 1000, k = 17;
  std::vector<float> r(M * n);
  for (auto& v : r) v = float(rng() % 50);  // many ties
  std::vector<int32_t> ri(M * k);
  std::vector<float> rv(M * k);
  be->top_k(r.data(), ri.data(), rv.data(), M, n, k);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<int32_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return r[m * n + a] > r[m * n + b]; });
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ri[m * k + j], idx[j]) << m << "," << j;
  }
  EXPECT_THROW(be->top_k(x.data(), ids.data(), vals.data(), 1, 6, 7), Error);
}

}  // namespace
}  // namespace dflash::test
