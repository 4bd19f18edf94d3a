// Q4_K / Q6_K on the integer tensor cores (matmul_kquant.cu) and get_rows of every layout.
//
// The Q4_K / Q6_K weights are transcoded at upload to the "kquant-mma" layout (the default); these
// tests check that the layout is really the one in use, that the matmul stays within the matmul bound
// of the CPU (matmul_bound: the integer sums are exact, the activations are rounded to 2 digit planes
// per 128-block) at the 27B drafter's shapes, that an M-row call and a matmul_group give each row the bits
// of a one-row call, and that get_rows returns the CPU's dequantized rows bit for bit (an id outside
// the table gives NaN).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"
#include "quant/types.h"

namespace dflash::cudatest {
namespace {

// The matmul against the CPU, each row of the M-row call against its one-row call, and the layout.
void kquant_case(GgmlType t, int64_t in, int64_t out, const std::vector<int64_t>& Ms, uint32_t seed) {
  const auto bytes = make_weight(t, in, out, seed).bytes;
  const WeightRef wg = gpu().upload_weight(bytes.data(), t, in, out);
  const WeightRef wc = cpu().upload_weight(bytes.data(), t, in, out);
  const std::string layout = cuda::weight_layout(gpu(), wg);
  EXPECT_EQ(layout, "kquant-mma") << type_name(t) << " " << in << "x" << out;
  std::mt19937 rng(seed);
  bool rows_same = true;
  std::string where;
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in);
    Buf<float> xg(gpu(), x), yg(gpu(), M * out), xc(cpu(), x), yc(cpu(), M * out);
    gpu().matmul(wg, xg, yg, M);
    cpu().matmul(wc, xc, yc, M);
    const auto multi = yg.get();
    check(std::string("matmul ") + type_name(t), shape_str({M, in, out}), multi, yc.get(), matmul_bound(t),
          yg.guard_ok(), layout);
    for (int64_t m = 0; M > 1 && m < M; ++m) {
      Buf<float> x1(gpu(), std::vector<float>(x.begin() + m * in, x.begin() + (m + 1) * in)), y1(gpu(), out);
      gpu().matmul(wg, x1, y1, 1);
      if (std::memcmp(y1.get().data(), multi.data() + m * out, out * 4) != 0) {
        rows_same = false;
        where += fmt::format(" M={},row={}", M, m);
      }
    }
  }
  record({std::string("kquant matmul M-row==1-row ") + type_name(t), fmt::format("{}x{}", in, out), 0, 0, 0,
          rows_same, rows_same ? std::string("memcmp equal") : fmt::format("differs at{}", where)});
  EXPECT_TRUE(rows_same) << type_name(t) << where;
}

// The 27B drafter's shapes (hidden 5120, 32 x 128 query heads, 8 x 128 kv heads, ffn 17408, the conv
// projections 1280, the 5-tap fc 25600 -> 5120) at the draft block (8 rows), decode (1) and a few others.
TEST(CudaKQuant, DrafterShapes) {
  REQUIRE_GPU();
  struct S {
    GgmlType t;
    int64_t in, out;
  };
  const S shapes[] = {
      {GgmlType::Q4_K, 5120, 4096},  {GgmlType::Q4_K, 5120, 1024},  {GgmlType::Q6_K, 5120, 1024},
      {GgmlType::Q4_K, 4096, 5120},  {GgmlType::Q4_K, 5120, 17408}, {GgmlType::Q4_K, 17408, 5120},
      {GgmlType::Q6_K, 17408, 5120}, {GgmlType::Q4_K, 5120, 1280},  {GgmlType::Q4_K, 25600, 5120},
  };
  uint32_t seed = 900;
  for (const S& s : shapes) kquant_case(s.t, s.in, s.out, {1, 8}, seed++);
}

// Odd shapes: out not a multiple of 16 (pad rows) or of 64 (a short last CTA), one superblock, a k
// split with a ragged share, every row count of a tile.
TEST(CudaKQuant, OddShapesAndRowCounts) {
  REQUIRE_GPU();
  uint32_t seed = 950;
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q6_K}) {
    kquant_case(t, 256, 37, {1, 2, 3, 4, 5, 6, 7, 8, 9, 17}, seed++);
    kquant_case(t, 2304, 200, {1, 3, 8, 13}, seed++);
    kquant_case(t, 768, 1000, {2, 8}, seed++);
  }
}

// matmul_group of Q4_K weights sharing the input (the drafter's gate | up and q | k): one launch; each
// output within the bound of the CPU and each row of the 8-row call == the 1-row call.
TEST(CudaKQuant, GroupSharedInput) {
  REQUIRE_GPU();
  const int64_t in = 5120;
  const int64_t outs[] = {4096, 1024};
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<WeightRef> wg, wc;
  for (int i = 0; i < 2; ++i) {
    bytes.push_back(make_weight(GgmlType::Q4_K, in, outs[i], 980 + i).bytes);
    wg.push_back(gpu().upload_weight(bytes.back().data(), GgmlType::Q4_K, in, outs[i]));
    wc.push_back(cpu().upload_weight(bytes.back().data(), GgmlType::Q4_K, in, outs[i]));
  }
  std::mt19937 rng(99);
  const int64_t M = 8;
  const auto x = randn_vec(rng, M * in);
  Buf<float> xg(gpu(), x), xc(cpu(), x), y0(gpu(), M * outs[0]), y1(gpu(), M * outs[1]), c0(cpu(), M * outs[0]),
      c1(cpu(), M * outs[1]);
  const Backend::MatmulOut og[] = {{&wg[0], y0}, {&wg[1], y1}}, oc[] = {{&wc[0], c0}, {&wc[1], c1}};
  gpu().matmul_group(og, xg, M);
  cpu().matmul_group(oc, xc, M);
  const auto g0 = y0.get(), g1 = y1.get();
  check("kquant matmul_group part 0", "Q4_K 8x5120x4096", g0, c0.get(), matmul_bound(GgmlType::Q4_K), y0.guard_ok());
  check("kquant matmul_group part 1", "Q4_K 8x5120x1024", g1, c1.get(), matmul_bound(GgmlType::Q4_K), y1.guard_ok());
  bool same = true;
  for (int64_t m = 0; m < M; ++m) {
    Buf<float> x1(gpu(), std::vector<float>(x.begin() + m * in, x.begin() + (m + 1) * in)), z0(gpu(), outs[0]),
        z1(gpu(), outs[1]);
    const Backend::MatmulOut o1[] = {{&wg[0], z0}, {&wg[1], z1}};
    gpu().matmul_group(o1, x1, 1);
    same = same && std::memcmp(z0.get().data(), g0.data() + m * outs[0], outs[0] * 4) == 0 &&
           std::memcmp(z1.get().data(), g1.data() + m * outs[1], outs[1] * 4) == 0;
  }
  record({"kquant matmul_group M-row==1-row", "Q4_K 5120 -> 4096 + 1024, M=8", 0, 0, 0, same,
          same ? "memcmp equal" : "differs"});
  EXPECT_TRUE(same);
}

// A Q4_K_M layer's attention projections: q | k in Q4_K, v in Q6_K (the 27B drafter's heavy layers).
// matmul_group launches q | k as one group and v alone (matmul_group_by_layout): each output within the
// bound of the CPU, the same bits as matmul_group(q | k) and matmul(v) (a group's k split is its own, so
// q | k may round differently from q alone), and each row of the 8-row call == the 1-row call.
TEST(CudaKQuant, MixedGroupOneLaunchPerLayout) {
  REQUIRE_GPU();
  const int64_t in = 5120;
  const GgmlType types[] = {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K};
  const int64_t outs[] = {4096, 1024, 1024};
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<WeightRef> wg, wc;
  for (int i = 0; i < 3; ++i) {
    bytes.push_back(make_weight(types[i], in, outs[i], 990 + i).bytes);
    wg.push_back(gpu().upload_weight(bytes.back().data(), types[i], in, outs[i]));
    wc.push_back(cpu().upload_weight(bytes.back().data(), types[i], in, outs[i]));
  }
  // The mixed group of weights w on backend be, input x (M rows): its outputs, or (split) the same outputs
  // as q | k grouped and v alone.
  const auto run = [&](Backend& be, const std::vector<WeightRef>& w, const std::vector<float>& x, int64_t M,
                       bool split) {
    Buf<float> xb(be, x);
    std::vector<std::unique_ptr<Buf<float>>> y;
    std::vector<Backend::MatmulOut> o;
    for (int i = 0; i < 3; ++i) {
      y.push_back(std::make_unique<Buf<float>>(be, M * outs[i]));
      o.push_back({&w[i], *y.back()});
    }
    if (split) {
      be.matmul_group(std::span<const Backend::MatmulOut>(o.data(), 2), xb, M);
      be.matmul(w[2], xb, *y[2], M);
    } else {
      be.matmul_group(o, xb, M);
    }
    std::vector<std::vector<float>> r;
    for (auto& b : y) {
      if (&be == &gpu()) {
        EXPECT_TRUE(b->guard_ok());
      }
      r.push_back(b->get());
    }
    return r;
  };
  std::mt19937 rng(98);
  const int64_t M = 8;
  const auto x = randn_vec(rng, M * in);
  const auto mixed = run(gpu(), wg, x, M, false), split = run(gpu(), wg, x, M, true);
  const auto ref = run(cpu(), wc, x, M, false);
  bool same = true, rows_same = true;
  for (int i = 0; i < 3; ++i) {
    check(fmt::format("kquant mixed matmul_group part {}", i), fmt::format("{} 8x{}x{}", type_name(types[i]), in, outs[i]),
          mixed[i], ref[i], matmul_bound(types[i]), true);
    same = same && std::memcmp(mixed[i].data(), split[i].data(), M * outs[i] * 4) == 0;
  }
  for (int64_t m = 0; m < M; ++m) {
    const auto one = run(gpu(), wg, std::vector<float>(x.begin() + m * in, x.begin() + (m + 1) * in), 1, false);
    for (int i = 0; i < 3; ++i)
      rows_same = rows_same && std::memcmp(one[i].data(), mixed[i].data() + m * outs[i], outs[i] * 4) == 0;
  }
  const char* shape = "Q4_K 4096 + Q4_K 1024 + Q6_K 1024, M=8";
  record({"kquant mixed matmul_group == group(q | k) + matmul(v)", shape, 0, 0, 0, same, same ? "memcmp equal" : "differs"});
  record({"kquant mixed matmul_group M-row==1-row", shape, 0, 0, 0, rows_same, rows_same ? "memcmp equal" : "differs"});
  EXPECT_TRUE(same);
  EXPECT_TRUE(rows_same);
}

// get_rows (embeddings, the DFlash 2 codebooks) of every type and layout: the CPU's rows bit for bit;
// an id outside [0, out) gives a NaN row.
TEST(CudaKQuant, GetRowsBitExact) {
  REQUIRE_GPU();
  const GgmlType types[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,  GgmlType::Q8_0,
                            GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K,  GgmlType::Q6_K,
                            GgmlType::PQ2_0, GgmlType::PTQ1_0};
  uint32_t seed = 990;
  for (GgmlType t : types) {
    const int64_t in = 512, out = 70;
    const auto bytes = make_weight(t, in, out, seed++).bytes;
    const WeightRef wg = gpu().upload_weight(bytes.data(), t, in, out);
    const WeightRef wc = cpu().upload_weight(bytes.data(), t, in, out);
    const std::vector<int32_t> ids = {0, 69, 15, 16, 33, 64, 1};
    Buf<int32_t> ig(gpu(), ids), ic(cpu(), ids);
    const int64_t M = static_cast<int64_t>(ids.size());
    Buf<float> yg(gpu(), M * in), yc(cpu(), M * in);
    gpu().get_rows(wg, ig, yg, M);
    cpu().get_rows(wc, ic, yc, M);
    const auto a = yg.get(), b = yc.get();
    const bool exact = std::memcmp(a.data(), b.data(), a.size() * 4) == 0 && yg.guard_ok();
    record({std::string("get_rows ") + type_name(t), fmt::format("{} ids of {}x{} ({})", M, out, in,
                                                                  cuda::weight_layout(gpu(), wg)),
            0, 0, 0, exact, exact ? "memcmp equal" : "differs"});
    EXPECT_TRUE(exact) << type_name(t);
    // an id past the table: NaN, not a read out of bounds
    const std::vector<int32_t> bad = {static_cast<int32_t>(out)};
    Buf<int32_t> ib(gpu(), bad);
    Buf<float> yb(gpu(), in);
    gpu().get_rows(wg, ib, yb, 1);
    const auto v = yb.get();
    EXPECT_TRUE(std::isnan(v[0]) && std::isnan(v[in - 1])) << type_name(t);
  }
}

}  // namespace
}  // namespace dflash::cudatest
