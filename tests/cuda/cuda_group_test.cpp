// matmul_group of small block-layout weights (the 27B target's GDN alpha | beta, BF16 48 x 5120) in one
// launch of the k-split kernel: every output must have the bits of its own matmul (grouping changes
// only which CTA computes it), for full 8-row tiles and the rest tile.
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

}  // namespace
}  // namespace dflash::cudatest
