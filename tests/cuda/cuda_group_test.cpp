// matmul_group of small block-layout weights (the 27B target's GDN alpha | beta, BF16 48 x 5120) in one
// launch of the k-split kernel: every output must have the bits of its own matmul (grouping changes
// only which CTA computes it), for full 8-row tiles and the rest tile. And the same weights beside GDN's
// conv (gdn_conv_and_matmuls).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"
#include "quant/types.h"

namespace dflash::cudatest {
namespace {

void split_group_case(GgmlType t, int64_t in, const std::vector<int64_t>& outs, const std::vector<int64_t>& Ms,
                      uint32_t seed) {
  std::vector<std::vector<uint8_t>> host;
  std::vector<WeightRef> wg;
  std::string shape = fmt::format("{} in {} outs", type_name(t), in);
  for (size_t i = 0; i < outs.size(); ++i) {
    host.push_back(make_weight(t, in, outs[i], seed + static_cast<uint32_t>(i)).bytes);
    wg.push_back(gpu().upload_weight(host.back().data(), t, in, outs[i]));
    shape += fmt::format(" {}", outs[i]);
  }
  std::mt19937 rng(seed);
  bool same = true;
  std::string where;
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in);
    Buf<float> xg(gpu(), x);
    std::vector<std::unique_ptr<Buf<float>>> yg, y1;
    std::vector<Backend::MatmulOut> og;
    for (size_t i = 0; i < outs.size(); ++i) {
      yg.push_back(std::make_unique<Buf<float>>(gpu(), M * outs[i]));
      y1.push_back(std::make_unique<Buf<float>>(gpu(), M * outs[i]));
      og.push_back({&wg[i], *yg.back()});
    }
    gpu().matmul_group(og, xg, M);
    for (size_t i = 0; i < outs.size(); ++i) {
      gpu().matmul(wg[i], xg, *y1[i], M);
      if (std::memcmp(yg[i]->get().data(), y1[i]->get().data(), M * outs[i] * 4) != 0 || !yg[i]->guard_ok()) {
        same = false;
        where += fmt::format(" M={},part={}", M, i);
      }
    }
  }
  record({"matmul_group (k-split kernel) == own matmuls", shape, 0, 0, 0, same,
          same ? std::string("memcmp equal") : fmt::format("differs at{}", where)});
  EXPECT_TRUE(same) << shape << where;
}

TEST(CudaMatmulGroup, SmallOutputWeightsInOneLaunch) {
  REQUIRE_GPU();
  split_group_case(GgmlType::BF16, 5120, {48, 48}, {1, 2, 8, 13}, 1300);  // GDN beta | alpha
  split_group_case(GgmlType::F32, 1000, {37, 5, 100}, {1, 3, 9}, 1310);   // odd outs, K % 256 != 0
  split_group_case(GgmlType::Q8_0, 2304, {64, 200, 1}, {1, 8}, 1320);
  split_group_case(GgmlType::F16, 512, {96, 512, 33, 7}, {2, 11}, 1330);   // four weights
}

// Backend::gdn_conv_and_matmuls: on CUDA one launch of the projections' CTAs beside the conv's (up to 8
// rows, 4 taps), otherwise matmul_group, then gdn_conv. Either way every output, the conv state and the
// undo checkpoint must have the bits of the two ops run apart, nothing may be written past them, and the
// conv must work in place (y == x, as gdn_conv allows).
void conv_and_matmuls_case(GgmlType t, int64_t in, const std::vector<int64_t>& outs, int64_t M, int64_t C, int64_t K,
                           bool in_place, uint32_t seed) {
  std::vector<WeightRef> wg;
  std::string shape = fmt::format("{} in {} M={} C={} K={}{} outs", type_name(t), in, M, C, K, in_place ? " in place" : "");
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto bytes = make_weight(t, in, outs[i], seed + static_cast<uint32_t>(i)).bytes;
    wg.push_back(gpu().upload_weight(bytes.data(), t, in, outs[i]));
    shape += fmt::format(" {}", outs[i]);
  }
  std::mt19937 rng(seed);
  const auto mx = randn_vec(rng, M * in), x = randn_vec(rng, M * C), st = randn_vec(rng, (K - 1) * C),
             w = randn_vec(rng, C * K, 0.5f);
  Buf<float> mxg(gpu(), mx), wcv(gpu(), w);
  // fused: the op; apart: matmul_group, then gdn_conv
  Buf<float> xf(gpu(), x), sf(gpu(), st), bf(gpu(), (K - 1) * C), yf(gpu(), M * C);
  Buf<float> xa(gpu(), x), sa(gpu(), st), ba(gpu(), (K - 1) * C), ya(gpu(), M * C);
  std::vector<std::unique_ptr<Buf<float>>> pf, pa;
  std::vector<Backend::MatmulOut> of, oa;
  for (size_t i = 0; i < outs.size(); ++i) {
    pf.push_back(std::make_unique<Buf<float>>(gpu(), M * outs[i]));
    pa.push_back(std::make_unique<Buf<float>>(gpu(), M * outs[i]));
    of.push_back({&wg[i], *pf.back()});
    oa.push_back({&wg[i], *pa.back()});
  }
  gpu().gdn_conv_and_matmuls(of, mxg, xf, sf, bf, wcv, in_place ? xf.get_ptr() : yf.get_ptr(), M, C, K);
  gpu().matmul_group(oa, mxg, M);
  gpu().gdn_conv(xa, sa, ba, wcv, in_place ? xa.get_ptr() : ya.get_ptr(), M, C, K);
  std::string where;
  const auto differs = [&](const char* what, Buf<float>& f, Buf<float>& a) {
    if (f.get() != a.get() || !f.guard_ok()) where += fmt::format(" {}", what);
  };
  for (size_t i = 0; i < outs.size(); ++i) differs(fmt::format("out{}", i).c_str(), *pf[i], *pa[i]);
  differs(in_place ? "conv (in place)" : "conv", in_place ? xf : yf, in_place ? xa : ya);
  differs("state", sf, sa);
  differs("state_before", bf, ba);
  if (bf.get() != st) where += " state_before != the state before";
  const bool same = where.empty();
  record({"gdn_conv_and_matmuls == matmul_group + gdn_conv", shape, 0, 0, 0, same,
          same ? std::string("memcmp equal") : fmt::format("differs:{}", where)});
  EXPECT_TRUE(same) << shape << where;
}

TEST(CudaMatmulGroup, ConvAndProjectionsInOneLaunch) {
  REQUIRE_GPU();
  // the 27B target's GDN layer: beta | alpha (BF16 48 x 5120) beside the conv of 10240 channels
  for (int64_t M : {1, 2, 8}) conv_and_matmuls_case(GgmlType::BF16, 5120, {48, 48}, M, 10240, 4, false, 1400 + M);
  conv_and_matmuls_case(GgmlType::BF16, 5120, {48, 48}, 8, 10240, 4, true, 1410);
  // channels that do not fill the last CTA, odd outputs, one and four weights
  conv_and_matmuls_case(GgmlType::F32, 1000, {37, 5}, 3, 300, 4, false, 1420);
  conv_and_matmuls_case(GgmlType::Q8_0, 2304, {64}, 5, 1000, 4, true, 1430);
  conv_and_matmuls_case(GgmlType::F16, 512, {96, 512, 33, 7}, 7, 2050, 4, false, 1440);
  // the fallbacks: more than one row tile, another tap count
  conv_and_matmuls_case(GgmlType::BF16, 5120, {48, 48}, 13, 10240, 4, false, 1450);
  conv_and_matmuls_case(GgmlType::BF16, 512, {16, 16}, 4, 384, 3, false, 1460);
}

// Backend::gdn_input: on CUDA (ternary qkv and z, BF16 beta | alpha, up to 8 rows, 4 taps) one launch of the
// ternary kernel with the split group's CTAs beside the tiles and the conv in the qkv tiles; otherwise the
// qkv | z group, then gdn_conv_and_matmuls. Either way every output, the conv state and the undo checkpoint
// must have the bits of the ops apart, nothing may be written past them, and `fused` says which path ran.
void gdn_input_case(GgmlType tp, GgmlType tab, int64_t in, int64_t C, int64_t nz, int64_t nab, int64_t K,
                    const std::vector<int64_t>& Ms, bool fused, uint32_t seed) {
  const auto bq = make_weight(tp, in, C, seed).bytes, bz = make_weight(tp, in, nz, seed + 1).bytes;
  const auto bb = make_weight(tab, in, nab, seed + 2).bytes, ba = make_weight(tab, in, nab, seed + 3).bytes;
  const WeightRef wq = gpu().upload_weight(bq.data(), tp, in, C), wz = gpu().upload_weight(bz.data(), tp, in, nz);
  const WeightRef wb = gpu().upload_weight(bb.data(), tab, in, nab), wa = gpu().upload_weight(ba.data(), tab, in, nab);
  std::mt19937 rng(seed);
  const auto cw = randn_vec(rng, C * K, 0.5f);
  Buf<float> cwg(gpu(), cw);
  const std::string shape = fmt::format("{} / {} in {} C {} z {} ab {} K {}", type_name(tp), type_name(tab), in, C, nz,
                                        nab, K);
  std::string where;
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in), mx = randn_vec(rng, M * in), st = randn_vec(rng, (K - 1) * C);
    Buf<float> xg(gpu(), x), mxg(gpu(), mx);
    // f: the op; a: the ops apart
    Buf<float> cif(gpu(), M * C), zf(gpu(), M * nz), bf(gpu(), M * nab), af(gpu(), M * nab), sf(gpu(), st),
        sbf(gpu(), (K - 1) * C), cof(gpu(), M * C);
    Buf<float> cia(gpu(), M * C), za(gpu(), M * nz), bA(gpu(), M * nab), aa(gpu(), M * nab), sa(gpu(), st),
        sba(gpu(), (K - 1) * C), coa(gpu(), M * C);
    const Backend::MatmulOut abf[2] = {{&wb, bf}, {&wa, af}}, aba[2] = {{&wb, bA}, {&wa, aa}};
    const int64_t fused0 = cuda::gdn_input_launches(gpu());
    gpu().gdn_input(wq, wz, xg, cif, zf, abf, mxg, sf, sbf, cwg, cof, M, C, K);
    const bool ran_fused = cuda::gdn_input_launches(gpu()) == fused0 + 1;
    const Backend::MatmulOut outs[2] = {{&wq, cia}, {&wz, za}};
    gpu().matmul_group(outs, xg, M);
    gpu().gdn_conv_and_matmuls(aba, mxg, cia, sa, sba, cwg, coa, M, C, K);
    const auto differs = [&](const char* what, Buf<float>& f, Buf<float>& a) {
      if (f.get() != a.get() || !f.guard_ok()) where += fmt::format(" M={}:{}", M, what);
    };
    differs("conv_in", cif, cia);
    differs("z", zf, za);
    differs("beta", bf, bA);
    differs("alpha", af, aa);
    differs("conv_out", cof, coa);
    differs("state", sf, sa);
    differs("state_before", sbf, sba);
    if (sbf.get() != st) where += fmt::format(" M={}:state_before != the state before", M);
    if (ran_fused != fused) where += fmt::format(" M={}:{}", M, ran_fused ? "fused (expected the ops)" : "the ops (expected fused)");
  }
  const bool same = where.empty();
  record({fused ? "gdn_input (one launch) == qkv | z group + gdn_conv_and_matmuls"
                : "gdn_input (fallback) == qkv | z group + gdn_conv_and_matmuls",
          shape, 0, 0, 0, same, same ? std::string("memcmp equal") : fmt::format("differs:{}", where)});
  EXPECT_TRUE(same) << shape << where;
}

TEST(CudaMatmulGroup, GdnInputInOneLaunch) {
  REQUIRE_GPU();
  // the 27B target's GDN layer (PTQ1_0 / PQ2_0 5120 -> 10240 | 6144, BF16 48 | 48), every verify width
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::BF16, 5120, 10240, 6144, 48, 4, {1, 2, 3, 5, 8}, true, 1600);
  gdn_input_case(GgmlType::PQ2_0, GgmlType::BF16, 5120, 10240, 6144, 48, 4, {1, 8}, true, 1610);
  // channels that do not fill the last CTA's tiles, odd alpha | beta widths, a shorter K (one wave: no k split)
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::BF16, 2048, 10256, 6160, 37, 4, {1, 4, 7}, true, 1620);
  // the fallbacks: more than one row tile, another tap count, alpha | beta in F32, a k split (few tiles)
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::BF16, 5120, 10240, 6144, 48, 4, {9}, false, 1630);
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::BF16, 1024, 2048, 1024, 16, 3, {2}, false, 1640);
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::F32, 1024, 2048, 1024, 16, 4, {2}, false, 1650);
  gdn_input_case(GgmlType::PTQ1_0, GgmlType::BF16, 4096, 1024, 512, 16, 4, {1, 8}, false, 1660);
}

}  // namespace
}  // namespace dflash::cudatest
