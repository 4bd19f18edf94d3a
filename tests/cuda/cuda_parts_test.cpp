// Backend::matmul_parts on CUDA: an integer-mma matmul whose k split is > 1 leaves its ks partial
// products in y ([parts][M][out]) instead of adding them inside a thread-block cluster; the residual's
// norm kernel (residual_norm_rotate) or sum_parts adds them in part order. Checked bit for bit:
//   - sum_parts(parts) == matmul()'s y, and nothing is written past the parts returned;
//   - residual_norm_rotate(res = the parts) == residual_norm_rotate(res = matmul()'s y): x, n and the
//     rotated y, with and without rotation;
//   - dflash_conv_parts(parts) == dflash_conv(matmul()'s y) (the drafter's residual);
//   - a weight without a k split, an output the norm chain cannot read (out not a multiple of 1024), or
//     a buffer without room gets one part: matmul()'s y itself.
// DFLASH_CUDA_MM_PARTS=0 (the matmul reduces in a cluster) gives one part everywhere: the same checks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "cuda_test_util.h"
#include "ops/backend.h"
#include "quant/types.h"

namespace dflash::cudatest {
namespace {

// The backend's switch (cuda_backend.cpp): parts only while it is on.
bool parts_enabled() {
  const char* v = std::getenv("DFLASH_CUDA_MM_PARTS");
  return !(v && std::string(v) == "0");
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct PartsCase {
  GgmlType type;
  int64_t in, out;
  bool expect_split;  // an integer-mma layout, few output tiles, out % 1024 == 0: the k split is > 1
};

void parts_case(const PartsCase& c, uint32_t seed) {
  const HostWeight hw = make_weight(c.type, c.in, c.out, seed);
  const WeightRef w = gpu().upload_weight(hw.bytes.data(), c.type, c.in, c.out);
  std::mt19937 rng(seed);
  for (int64_t M : {1, 3, 8}) {
    const std::string shp = fmt::format("{} {}x{} M={}", type_name(c.type), c.out, c.in, M);
    const auto x = randn_vec(rng, M * c.in);
    Buf<float> xg(gpu(), x), y(gpu(), M * c.out), parts(gpu(), 8 * M * c.out);
    gpu().matmul(w, xg, y, M);
    const int n = gpu().matmul_parts(w, xg, parts, M, 8 * M);
    const bool split_as_expected = (n > 1) == (c.expect_split && parts_enabled()) && n >= 1 && n <= 8;
    record({"matmul_parts: k split as expected", shp, 0, 0, 0, split_as_expected, fmt::format("{} parts", n)});
    EXPECT_TRUE(split_as_expected) << shp << ": " << n << " parts";

    // Nothing past the parts returned (their room stays poisoned).
    std::vector<float> all = parts.get();
    std::vector<uint32_t> rest(all.size() - n * M * c.out);
    std::memcpy(rest.data(), all.data() + n * M * c.out, rest.size() * 4);
    bool untouched = parts.guard_ok();
    for (uint32_t v : rest) untouched = untouched && v == kPoison;
    record({"matmul_parts writes only its parts", shp, 0, 0, 0, untouched, untouched ? "" : "wrote past its parts"});
    EXPECT_TRUE(untouched) << shp;

    gpu().sum_parts(parts, n, M * c.out);
    all = parts.get();
    check("sum_parts(matmul_parts) == matmul", shp, std::vector<float>(all.begin(), all.begin() + M * c.out), y.get(),
          0);

    // No room for the parts: one part, matmul's own bits.
    Buf<float> one(gpu(), M * c.out);
    const int n1 = gpu().matmul_parts(w, xg, one, M, M);
    check("matmul_parts without room == matmul", shp, one.get(), y.get(), 0, one.guard_ok() && n1 == 1,
          fmt::format("{} parts", n1));
  }
}

TEST(CudaMatmulParts, PartsSumToTheMatmul) {
  REQUIRE_GPU();
  parts_case({GgmlType::PTQ1_0, 5120, 1024, true}, 1900);
  parts_case({GgmlType::PQ2_0, 2048, 1024, true}, 1910);
  parts_case({GgmlType::Q4_K, 4096, 1024, true}, 1920);
  parts_case({GgmlType::Q6_K, 2048, 2048, true}, 1930);
  parts_case({GgmlType::PQ2_0, 2048, 320, false}, 1935);     // k split, but no norm chain for 320-wide rows
  parts_case({GgmlType::PTQ1_0, 1024, 17408, false}, 1940);  // many output tiles: no k split
  parts_case({GgmlType::Q8_0, 1024, 1024, false}, 1950);     // no integer-mma layout
}

// The residual as parts through the norm chain (with and without the prism rotation): the bits of the
// residual as one matmul output. dim = the weight's out (a multiple of 1024, <= 8192: the chain's).
TEST(CudaMatmulParts, ResidualNormAddsThePartsInOrder) {
  REQUIRE_GPU();
  struct C {
    GgmlType type;
    int64_t in, dim;
    bool rotate;
  };
  const C cases[] = {{GgmlType::PTQ1_0, 6144, 5120, true},   // the 27B ssm_out
                     {GgmlType::PTQ1_0, 6144, 5120, false},
                     {GgmlType::Q4_K, 2048, 2048, false}};   // a drafter-like K-quant
  uint32_t seed = 1960;
  for (const C& c : cases) {
    const HostWeight hw = make_weight(c.type, c.in, c.dim, seed++);
    const WeightRef w = gpu().upload_weight(hw.bytes.data(), c.type, c.in, c.dim);
    std::mt19937 rng(seed++);
    const auto nw = rand_vec(rng, c.dim, 0.5f, 1.5f), signs = rand_vec(rng, c.dim, -1.0f, 1.0f);
    for (int64_t M : {1, 8}) {
      const std::string shp = fmt::format("{} {}x{} M={}{}", type_name(c.type), c.dim, c.in, M, c.rotate ? " rotated" : "");
      const auto xin = randn_vec(rng, M * c.in), x0 = randn_vec(rng, M * c.dim);
      Buf<float> xg(gpu(), xin), res(gpu(), M * c.dim), parts(gpu(), 8 * M * c.dim), wb(gpu(), nw), sg(gpu(), signs);
      gpu().matmul(w, xg, res, M);
      const int n = gpu().matmul_parts(w, xg, parts, M, 8 * M);
      if (parts_enabled()) {
        EXPECT_GT(n, 1) << shp << ": no k split, the case checks nothing";
      }
      Backend::Rotation rot;
      if (c.rotate) rot = {sg, nullptr, 1024};
      Buf<float> xa(gpu(), x0), na(gpu(), M * c.dim), ya(gpu(), M * c.dim);
      Buf<float> xb(gpu(), x0), nb(gpu(), M * c.dim), yb(gpu(), M * c.dim);
      gpu().residual_norm_rotate(xa, res, 1, wb, na, ya, rot, M, c.dim, 1e-6f);
      gpu().residual_norm_rotate(xb, parts, n, wb, nb, yb, rot, M, c.dim, 1e-6f);
      const std::string note = fmt::format("{} parts", n);
      check("residual_norm_rotate(parts): x", shp, xb.get(), xa.get(), 0, xb.guard_ok(), note);
      check("residual_norm_rotate(parts): n", shp, nb.get(), na.get(), 0, nb.guard_ok(), note);
      if (c.rotate) check("residual_norm_rotate(parts): rotated y", shp, yb.get(), ya.get(), 0, yb.guard_ok(), note);
      // And the next matmul reads the chain's quantization of the same bits.
      Buf<float> oa(gpu(), M * 256), ob(gpu(), M * 256);
      const HostWeight hn = make_weight(GgmlType::PTQ1_0, c.dim, 256, seed);
      const WeightRef wn = gpu().upload_weight(hn.bytes.data(), GgmlType::PTQ1_0, c.dim, 256);
      gpu().matmul(wn, c.rotate ? yb.get_ptr() : nb.get_ptr(), ob, M);
      Buf<float> again(gpu(), c.rotate ? ya.get() : na.get());
      gpu().matmul(wn, again, oa, M);
      check("residual_norm_rotate(parts) -> matmul", shp, ob.get(), oa.get(), 0, ob.guard_ok(), note);
      EXPECT_TRUE(same_bits(ob.get(), oa.get())) << shp;
    }
  }
}

// The drafter's residual: the conv reads the wo / ffn_down output as parts (dflash_conv_parts, the
// residual x aliasing y as in the drafter): the bits of dflash_conv of matmul()'s y.
TEST(CudaMatmulParts, DrafterConvReadsTheParts) {
  REQUIRE_GPU();
  const int64_t in = 4096, C = 5120, K = 2, group = 16, G = C / group, d_stride = 2 * K * G;
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q6_K}) {
    const HostWeight hw = make_weight(t, in, C, 1980);
    const WeightRef w = gpu().upload_weight(hw.bytes.data(), t, in, C);
    std::mt19937 rng(1981);
    for (int64_t M : {1, 8}) {
      const std::string shp = fmt::format("{} {}x{} M={} K={} group={}", type_name(t), C, in, M, K, group);
      const auto xin = randn_vec(rng, M * in), x0 = randn_vec(rng, M * C), base = randn_vec(rng, K * C, 0.5f),
                 d = randn_vec(rng, M * d_stride, 0.2f);
      Buf<float> xg(gpu(), xin), whole(gpu(), M * C), parts(gpu(), 8 * M * C), bg(gpu(), base), dg(gpu(), d);
      gpu().matmul(w, xg, whole, M);
      const int n = gpu().matmul_parts(w, xg, parts, M, 8 * M);
      if (parts_enabled()) {
        EXPECT_GT(n, 1) << shp << ": no k split, the case checks nothing";
      }
      Buf<float> ya(gpu(), x0), yb(gpu(), x0);  // the residual stream, updated in place
      gpu().dflash_conv(whole, bg, dg, d_stride, ya, ya, M, C, K, group);
      gpu().dflash_conv_parts(parts, n, bg, dg, d_stride, yb, yb, M, C, K, group);
      check("dflash_conv_parts(matmul_parts) == dflash_conv(matmul)", shp, yb.get(), ya.get(), 0, yb.guard_ok(),
            fmt::format("{} parts", n));
    }
  }
}

}  // namespace
}  // namespace dflash::cudatest
